"""Observation encoders: an MLP for vectors (:class:`MLP`, with the activation functions); the
Nature CNN, the IMPALA ResNet and the MinAtar CNN for images; or the user's own, by import
path (:class:`ImportedEncoder`).

Image encoders take ``uint8`` frames ``[*batch, C, H, W]`` (e.g. 4 stacked 84x84 grayscale
frames) and scale them to [0, 1] inside the first layer, so observations stay ``uint8`` from
the env to the network. Every encoder maps ``[*batch, *obs_shape]`` to ``[*batch, out_features]``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import Tensor, nn

from impala_rl.config import ACTIVATIONS, ENCODERS, ConfigError, is_import_path
from impala_rl.envs.factory import carried_callable, where_a_module_lies
from impala_rl.envs.spaces import TextTokens

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


class _ImageEncoder(nn.Module):
    """Runs a conv trunk over ``[*batch, C, H, W]``, flattening the batch dims around it."""

    def __init__(self, obs_shape: Sequence[int]):
        super().__init__()
        if len(obs_shape) != 3:
            raise ValueError(
                f"{type(self).__name__} needs image observations [C, H, W], got shape "
                f"{tuple(obs_shape)}; use model.encoder=auto for vectors"
            )
        self.obs_shape = tuple(int(d) for d in obs_shape)
        self.channels_last = False

    def use_channels_last(self) -> None:
        """Keep conv weights and inputs in channels-last memory format (NHWC kernels)."""
        self.to(memory_format=torch.channels_last)
        self.channels_last = True

    def trunk(self, x: Tensor) -> Tensor:  # [N, C, H, W] float -> [N, F]
        raise NotImplementedError

    def forward(self, obs: Tensor) -> Tensor:
        batch = obs.shape[: obs.ndim - 3]
        x = obs.reshape(-1, *self.obs_shape)
        if self.channels_last:  # before the float copy: the NHWC copy is 4x smaller
            x = x.contiguous(memory_format=torch.channels_last)
        x = x.float().div_(255.0) if not x.is_floating_point() else x.float()
        return self.trunk(x).reshape(*batch, -1)

    def _flat_size(self, convs: nn.Module) -> int:
        """Features ``convs`` makes of one frame; too small a frame is a ``ValueError``."""
        try:
            with torch.no_grad():
                return int(convs(torch.zeros(1, *self.obs_shape)).shape[-1])
        except RuntimeError as exc:
            raise ValueError(
                f"{type(self).__name__} cannot take frames of shape {self.obs_shape} ({exc}); "
                "use model.encoder=minatar_cnn for small frames such as MinAtar's 10x10"
            ) from None

    def _out_features(self) -> int:
        with torch.no_grad():
            return int(self.trunk(torch.zeros(1, *self.obs_shape)).shape[-1])


class NatureCNN(_ImageEncoder):
    """Mnih et al. (2015): conv 32x8x8/4, 64x4x4/2, 64x3x3/1, then a 512-unit layer."""

    def __init__(self, obs_shape: Sequence[int], hidden: int = 512):
        super().__init__(obs_shape)
        c = self.obs_shape[0]
        self.convs = nn.Sequential(
            nn.Conv2d(c, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )  # fmt: skip
        flat = self._flat_size(self.convs)
        self.fc = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU())
        self.out_features = hidden
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(m.weight, gain=float(np.sqrt(2)))
                nn.init.zeros_(m.bias)

    def trunk(self, x: Tensor) -> Tensor:
        return self.fc(self.convs(x))


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaResNet(_ImageEncoder):
    """The IMPALA paper's "deep" network: per stage conv 3x3, max-pool 3x3/2 and two residual
    blocks (16, 32, 32 channels), then ReLU and a 256-unit layer."""

    def __init__(
        self, obs_shape: Sequence[int], channels: Sequence[int] = (16, 32, 32), hidden: int = 256
    ):
        super().__init__(obs_shape)
        layers: list[nn.Module] = []
        in_channels = self.obs_shape[0]
        for out_channels in channels:
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1),
                nn.MaxPool2d(3, stride=2, padding=1),
                _ResidualBlock(out_channels),
                _ResidualBlock(out_channels),
            ]
            in_channels = out_channels
        self.stages = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        flat = self._flat_size(self.stages)
        self.fc = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU())
        self.out_features = hidden

    def trunk(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(x))


class MinAtarCNN(_ImageEncoder):
    """Young & Tian (2019), MinAtar's network: one conv 16x3x3/1, ReLU, a 128-unit layer.

    Fits the 10x10 MinAtar frames (the Nature CNN's strides need at least 36x36)."""

    def __init__(self, obs_shape: Sequence[int], channels: int = 16, hidden: int = 128):
        super().__init__(obs_shape)
        c = self.obs_shape[0]
        self.convs = nn.Sequential(nn.Conv2d(c, channels, 3, stride=1), nn.ReLU(), nn.Flatten())
        flat = self._flat_size(self.convs)
        self.fc = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU())
        self.out_features = hidden

    def trunk(self, x: Tensor) -> Tensor:
        return self.fc(self.convs(x))


class MLPEncoder(nn.Module):
    """Flattens ``[*batch, *obs_shape]`` to float vectors and applies an :class:`MLP`."""

    def __init__(self, obs_shape: Sequence[int], hidden_sizes: Sequence[int], activation: str):
        super().__init__()
        self.obs_shape = tuple(int(d) for d in obs_shape)
        self.obs_dim = int(np.prod(self.obs_shape, dtype=np.int64))
        self.mlp = MLP(self.obs_dim, hidden_sizes, activation)
        self.out_features = self.mlp.out_features

    def forward(self, obs: Tensor) -> Tensor:
        batch = obs.shape[: obs.ndim - len(self.obs_shape)]
        return self.mlp(obs.reshape(*batch, self.obs_dim).to(torch.float32))


class ImportedEncoder(nn.Module):
    """The user's encoder, ``model.encoder=package.module:Class``, under the model's batch
    dimensions.

    The protocol: ``Class(observation_space, **kwargs)`` builds an ``nn.Module`` with an int
    ``out_features``; its forward maps observations ``[N, *obs_shape]``, in the space's dtype
    (``uint8`` images stay ``uint8``: scale them in the module), to float features
    ``[N, out_features]``. One batch dimension keeps user code simple; this wrapper folds the
    model's ``[*batch]`` (``[B]`` acting, ``[T + 1, B]`` learning) into it and back. The class
    is checked on a batch of two sampled observations when built, so an import error or a
    wrong shape is a :class:`~impala_rl.config.ConfigError` naming ``field`` before training
    starts. The module is ``self.module`` (its parameters are saved as ``module.*``).
    """

    def __init__(
        self,
        path: str,
        observation_space: gymnasium.Space,
        kwargs: Mapping[str, Any] | None = None,
        field: str = "model.encoder",
    ):
        super().__init__()
        self.path, self.field = path, field
        kwargs = dict(kwargs or {})
        cls = self._import(path)
        try:
            module = cls(observation_space, **kwargs)
        except Exception as exc:
            space = f"{type(observation_space).__name__}{observation_space.shape}"
            if observation_space.dtype is not None:
                space += f" {observation_space.dtype}"
            raise self._error(
                f"{path}(<{space}>, **{kwargs}) raised {type(exc).__name__}: {exc} "
                f"(kwargs come from {field}_kwargs)"
            ) from exc
        if not isinstance(module, nn.Module):
            raise self._error(f"built a {type(module).__name__}, not a torch.nn.Module")
        out = getattr(module, "out_features", None)
        if isinstance(out, bool) or not isinstance(out, (int, np.integer)) or out < 1:
            raise self._error(
                f"a {type(module).__name__} declares out_features={out!r}; valid: an int >= 1, "
                "the width of the features it returns"
            )
        self.module = module
        self.out_features = int(out)
        self.obs_shape = tuple(int(d) for d in (observation_space.shape or ()))
        self.entry_shapes: dict[str, tuple[int, ...]] = {}  # a Dict observation's entries
        if isinstance(observation_space, gymnasium.spaces.Dict):
            self.entry_shapes = {k: tuple(s.shape) for k, s in observation_space.spaces.items()}
        self._check(observation_space)

    def _error(self, text: str) -> ConfigError:
        return ConfigError(f"{self.field}={self.path!r}: {text}")

    def _import(self, path: str) -> Any:
        if not is_import_path(path):
            raise self._error(f"expected package.module:Class; valid: {', '.join(ENCODERS)}")
        carried = carried_callable(path)  # a further learner's, of the leader's notebook
        if carried is not None:
            return carried
        module_name, _, attr = path.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            where = where_a_module_lies(exc, module_name)
            raise self._error(f"cannot import module {module_name!r} ({exc}){where}") from None
        for part in attr.split("."):
            if not hasattr(target, part):
                raise self._error(f"module {module_name!r} has no attribute {attr!r}")
            target = getattr(target, part)
        if not callable(target):
            raise self._error(f"{attr!r} is not callable; valid: an nn.Module class")
        return target

    def _check(self, space: gymnasium.Space) -> None:
        """One forward on two sampled observations must give ``[2, out_features]`` floats."""
        samples = [space.sample() for _ in range(2)]
        if isinstance(space, gymnasium.spaces.Dict):
            obs: Any = {k: torch.as_tensor(np.stack([x[k] for x in samples])) for k in samples[0]}
            shown = {k: list(v.shape) for k, v in obs.items()}
        else:
            obs = torch.as_tensor(np.stack(samples))
            shown = list(obs.shape)
        try:
            with torch.no_grad():
                out = self.module(obs)
        except Exception as exc:
            raise self._error(
                f"forward on observations {shown} raised {type(exc).__name__}: {exc}"
            ) from exc
        shape = tuple(out.shape) if isinstance(out, Tensor) else None
        if shape != (2, self.out_features) or not out.is_floating_point():
            got = f"{list(shape)} {out.dtype}" if shape is not None else f"a {type(out).__name__}"
            raise self._error(
                f"returned {got} for observations {shown}; valid: a float tensor "
                f"[N, out_features] = [2, {self.out_features}]"
            )

    def use_channels_last(self) -> None:
        """``model.channels_last``: the module's own ``use_channels_last()``, if it has one."""
        own = getattr(self.module, "use_channels_last", None)
        if callable(own):
            own()

    def forward(self, obs: Any) -> Tensor:
        if self.entry_shapes:  # a Dict observation: every entry's batch dims folded alike
            name, shape = next(iter(self.entry_shapes.items()))
            batch = obs[name].shape[: obs[name].ndim - len(shape)]
            folded = {k: obs[k].reshape(-1, *s) for k, s in self.entry_shapes.items()}
            return self.module(folded).reshape(*batch, self.out_features)
        if obs.ndim == len(self.obs_shape) + 1:  # acting: already the one batch dimension
            return self.module(obs)
        batch = obs.shape[: obs.ndim - len(self.obs_shape)]
        features = self.module(obs.reshape(-1, *self.obs_shape))
        return features.reshape(*batch, self.out_features)


class OneHotEncoder(nn.Module):
    """A ``Discrete(n)`` entry's index ``[*batch]`` as a one-hot ``[*batch, n]``."""

    def __init__(self, n: int):
        super().__init__()
        self.n = self.out_features = int(n)

    def forward(self, index: Tensor) -> Tensor:
        return torch.nn.functional.one_hot(index.long(), self.n).float()


class TextEncoder(nn.Module):
    """A text entry's words (:class:`~impala_rl.envs.spaces.TextTokens`: two hashed ids a
    word, ``[*batch, W, 2]``) as ``[*batch, W * embed_dim]``: each word the sum of its ids'
    embeddings, kept in its place (zeros after the last word), so that a layer above can tell
    "put the red ball near the blue key" from the blue ball near the red key."""

    def __init__(self, space: TextTokens, embed_dim: int = 8):
        super().__init__()
        words, buckets = int(space.nvec.shape[0]), int(space.nvec.max())
        self.embed = nn.Embedding(buckets, embed_dim, padding_idx=0)
        self.out_features = words * int(embed_dim)

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed(ids.long()).sum(-2).flatten(-2)


IMAGE_ENCODERS = ("nature_cnn", "impala_resnet", "minatar_cnn")
NATURE_CNN_MIN_SIDE = 36  # 8x8 stride 4, 4x4 stride 2, 3x3 stride 1 leave >= 1 pixel
MINATAR_CNN_MIN_SIDE = 3  # its one 3x3 convolution, stride 1


def is_image(space: gymnasium.Space | None) -> bool:
    """A ``uint8 [C, H, W]`` Box: an image as the model takes it."""
    return (
        isinstance(space, gymnasium.spaces.Box)
        and space.dtype == np.uint8
        and len(space.shape) == 3
    )


def largest_image_side(spaces: Iterable[gymnasium.Space]) -> int:
    """The longest side of the images (:func:`is_image`) among ``spaces`` and their Dict
    entries; 0 without one."""
    sides = [0]
    for space in spaces:
        entries = space.spaces.values() if isinstance(space, gymnasium.spaces.Dict) else [space]
        sides += [max(int(d) for d in s.shape[1:]) for s in entries if is_image(s)]
    return max(sides)


def fitting_cnn(shape: Sequence[int]) -> str:
    """The built-in encoder that fits an image ``[C, H, W]``: the Nature CNN from
    :data:`NATURE_CNN_MIN_SIDE` pixels a side, the MinAtar CNN from
    :data:`MINATAR_CNN_MIN_SIDE`, and below that (no convolution fits) an MLP."""
    side = min(shape[1:])
    if side >= NATURE_CNN_MIN_SIDE:
        return "nature_cnn"
    return "minatar_cnn" if side >= MINATAR_CNN_MIN_SIDE else "mlp"


def is_cnn_image(space: gymnasium.Space | None) -> bool:
    """An image that ``auto`` reads with a CNN: :func:`is_image`, and not too small for a
    convolution (:func:`fitting_cnn`)."""
    return is_image(space) and fitting_cnn(space.shape) != "mlp"


def encoder_for(kind: str, space: gymnasium.Space | None) -> str:
    """What ``kind`` builds for observations of ``space``: ``auto`` resolved for a Box (the
    CNN that fits an image, ``mlp`` otherwise); any other kind, and ``auto`` on a Dict (an
    encoder per entry), as given."""
    if kind != "auto" or isinstance(space, gymnasium.spaces.Dict):
        return kind
    return fitting_cnn(space.shape) if is_image(space) else "mlp"


class DictEncoder(nn.Module):
    """An encoder per entry of a Dict observation, their features concatenated: the CNN that
    fits an image entry (``kind`` when it names one, else the Nature CNN from 36 pixels a
    side, the MinAtar CNN below; one under 3 pixels a side is a vector), a one-hot for a
    ``Discrete`` entry, and for the vectors one MLP over all of them concatenated
    (``vectors="joint"``) or an MLP each (``"per_entry"``, as runs of an earlier version were
    built). A text entry's words are embedded (:class:`TextEncoder`) and read as a vector:
    in the joint MLP, so that its features combine the text with the other vectors.

    Takes ``{entry: [*batch, *o_entry]}`` and returns ``[*batch, out_features]``."""

    def __init__(
        self,
        space: gymnasium.spaces.Dict,
        kind: str,
        hidden_sizes: Sequence[int],
        activation: str,
        vectors: str = "joint",
    ):
        super().__init__()
        encoders: dict[str, nn.Module] = {}
        joint: dict[str, tuple[int, ...]] = {}
        texts: dict[str, TextEncoder] = {}  # joint entries read through their embedding
        for name, sub in space.spaces.items():
            shape = tuple(sub.shape)
            if isinstance(sub, TextTokens) and vectors == "joint":
                texts[name] = TextEncoder(sub)
                joint[name] = (texts[name].out_features,)
            elif isinstance(sub, TextTokens):
                encoders[name] = TextEncoder(sub)
            elif isinstance(sub, gymnasium.spaces.Discrete):
                encoders[name] = OneHotEncoder(int(sub.n))
            elif is_image(sub) and kind in IMAGE_ENCODERS:
                encoders[name] = make_encoder(kind, shape)
            elif is_cnn_image(sub):
                encoders[name] = make_encoder(fitting_cnn(shape), shape)
            elif vectors == "joint":
                joint[name] = shape
            else:
                encoders[name] = MLPEncoder(shape, hidden_sizes, activation)
        # lists in the entries' order: any string names an entry ("type", "agent.pos"), and
        # a module's children cannot have every name
        self.names = list(space.spaces)
        self._own = list(encoders)
        self.entries = nn.ModuleList(encoders.values())
        self._joint = joint
        self._texts = {name: i for i, name in enumerate(texts)}  # entry -> its module's index
        self.texts = nn.ModuleList(texts.values())
        width = sum(int(np.prod(s, dtype=np.int64)) for s in joint.values())
        self.vectors = MLPEncoder((width,), hidden_sizes, activation) if joint else None
        self.out_features = sum(int(e.out_features) for e in encoders.values())
        self.out_features += self.vectors.out_features if self.vectors is not None else 0
        self._register_load_state_dict_pre_hook(self._entries_by_index)

    def entry(self, name: str) -> nn.Module:
        """The encoder that reads entry ``name`` (the joint MLP for a vector)."""
        if name in self._joint:
            return self.vectors
        return self.entries[self._own.index(name)]

    def _entries_by_index(self, state_dict: dict, prefix: str, *_args: Any) -> None:
        """Checkpoints of an earlier version keyed an entry's encoder by the entry's name
        (``entries.<name>.*``); it is the entry's index now (``entries.<i>.*``)."""
        for i, name in enumerate(self._own):
            old = f"{prefix}entries.{name}."
            for key in [k for k in state_dict if k.startswith(old)]:
                state_dict[f"{prefix}entries.{i}.{key[len(old) :]}"] = state_dict.pop(key)

    def use_channels_last(self) -> None:
        for encoder in self.entries:
            if hasattr(encoder, "use_channels_last"):
                encoder.use_channels_last()

    def forward(self, obs: Mapping[str, Tensor]) -> Tensor:
        parts = [encoder(obs[name]) for name, encoder in zip(self._own, self.entries, strict=True)]
        if self.vectors is not None:
            flat = []
            for name, shape in self._joint.items():
                x = obs[name]
                if name in self._texts:
                    flat.append(self.texts[self._texts[name]](x).to(torch.float32))
                    continue
                flat.append(x.reshape(*x.shape[: x.ndim - len(shape)], -1).to(torch.float32))
            parts.append(self.vectors(torch.cat(flat, dim=-1)))
        return torch.cat([p.to(parts[0].dtype) for p in parts], dim=-1)


def make_encoder(
    kind: str,
    obs_shape: Sequence[int],
    hidden_sizes: Sequence[int] = (64, 64),
    activation: str = "tanh",
    observation_space: gymnasium.Space | None = None,
    kwargs: Mapping[str, Any] | None = None,
    field: str = "model.encoder",
    dict_vectors: str = "joint",
) -> nn.Module:
    """An encoder with an ``out_features`` attribute: ``auto`` (:func:`encoder_for`),
    ``mlp``, ``nature_cnn``, ``impala_resnet``, ``minatar_cnn``, or ``package.module:Class`` (an
    :class:`ImportedEncoder` built from ``observation_space`` and ``kwargs``; ``field`` names
    the config field in its errors)."""
    if ":" in kind:
        if observation_space is None:
            raise ValueError(f"encoder {kind!r} is built from an observation space; none given")
        return ImportedEncoder(kind, observation_space, kwargs, field)
    if isinstance(observation_space, gymnasium.spaces.Dict):
        return DictEncoder(observation_space, kind, hidden_sizes, activation, dict_vectors)
    kind = encoder_for(kind, observation_space)
    if kind == "mlp":
        return MLPEncoder(obs_shape, hidden_sizes, activation)
    if kind == "nature_cnn":
        return NatureCNN(obs_shape)
    if kind == "impala_resnet":
        return ImpalaResNet(obs_shape)
    if kind == "minatar_cnn":
        return MinAtarCNN(obs_shape)
    raise ValueError(
        f"unknown encoder {kind!r}; valid: {', '.join(ENCODERS)} or package.module:Class"
    )
