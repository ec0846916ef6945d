"""Multi-layer perceptron torso and activation factory."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from impala_rl.config import ACTIVATIONS

__all__ = ["ACTIVATIONS", "MLP", "make_activation"]

_ACTIVATION_CLASSES: dict[str, type[nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}

assert tuple(_ACTIVATION_CLASSES) == ACTIVATIONS  # the config's choices, one class each


def make_activation(name: str) -> nn.Module:
    """Return a fresh activation module by (case-insensitive) name; see :data:`ACTIVATIONS`."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _ACTIVATION_CLASSES:
        raise ValueError(
            f"Unknown activation {name!r}; valid activations are: {', '.join(ACTIVATIONS)}"
        )
    return _ACTIVATION_CLASSES[key]()


class MLP(nn.Module):
    """Stack of ``Linear + activation`` layers over any leading dims ``[*batch, in_features]``.

    Linear layers use orthogonal init with gain ``sqrt(2)`` and zero bias. With empty
    ``hidden_sizes`` the module is the identity and ``out_features == in_features``.
    """

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], activation: str) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.hidden_sizes = tuple(int(h) for h in hidden_sizes)
        if self.in_features <= 0 or any(h <= 0 for h in self.hidden_sizes):
            raise ValueError(
                f"MLP sizes must be positive, got in_features={in_features}, "
                f"hidden_sizes={tuple(hidden_sizes)}"
            )
        make_activation(activation)  # validate early, even when hidden_sizes is empty
        layers: list[nn.Module] = []
        prev = self.in_features
        for size in self.hidden_sizes:
            linear = nn.Linear(prev, size)
            nn.init.orthogonal_(linear.weight, gain=math.sqrt(2.0))
            nn.init.zeros_(linear.bias)
            layers += [linear, make_activation(activation)]
            prev = size
        self.layers = nn.Sequential(*layers)
        self.out_features = prev

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)
