"""Weight initialisation schemes applied to a built model (``model.init``).

- ``builtin``: each layer's own init, as built: orthogonal (gain sqrt(2), zero bias) for the
  MLP and Nature-CNN layers, orthogonal LSTM weights, policy outputs with gain 0.01 and the
  value head with gain 1; PyTorch's defaults for the ResNet and MinAtar convolutions.
- ``orthogonal``: every hidden linear and convolution layer orthogonal with gain sqrt(2) (the
  ReLU gain, as in the IMPALA/PPO reference implementations), LSTM weights orthogonal, the
  policy's output layers gain 0.01, value heads gain 1.0; all biases zero.
- ``torch``: PyTorch's own default init for every layer (``reset_parameters``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from impala_rl.config import INITS
from impala_rl.nn.distributions import ActionHead

__all__ = ["INITS", "VALUE_HEAD", "initialize"]

VALUE_HEAD = "_impala_value_head"  # attribute marking a value head's output layer


def _orthogonal(layer: nn.Module, gain: float) -> None:
    weight = layer.weight
    if weight.is_contiguous():
        nn.init.orthogonal_(weight, gain=gain)
    else:  # a channels-last convolution: torch's orthogonal_ views the weight as rows
        with torch.no_grad():
            weight.copy_(nn.init.orthogonal_(torch.empty(weight.shape), gain=gain))
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


def initialize(model: nn.Module, scheme: str) -> None:
    """Re-initialise ``model``'s layers in place by ``scheme`` (see the module docstring)."""
    if scheme not in INITS:
        raise ValueError(f"unknown init {scheme!r}; valid: {', '.join(INITS)}")
    if scheme == "builtin":
        return
    layers = (nn.Linear, nn.Conv2d, nn.LSTM)
    if scheme == "torch":
        for module in model.modules():
            if isinstance(module, layers):
                module.reset_parameters()
        return
    heads = {id(m) for h in model.modules() if isinstance(h, ActionHead) for m in h.modules()}
    for module in model.modules():
        if isinstance(module, nn.LSTM):
            for name, param in module.named_parameters():
                (nn.init.zeros_ if "bias" in name else nn.init.orthogonal_)(param)
        elif isinstance(module, (nn.Linear, nn.Conv2d)):
            if getattr(module, VALUE_HEAD, False):
                _orthogonal(module, 1.0)
            elif id(module) in heads:
                _orthogonal(module, 0.01)
            else:
                _orthogonal(module, math.sqrt(2.0))
