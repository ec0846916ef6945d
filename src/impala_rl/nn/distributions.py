"""Action distributions and action heads, one per supported Gymnasium action space.

Every distribution works over arbitrary leading batch dims ``[*batch]`` and samples with an
optional explicit :class:`torch.Generator`, so each actor can draw reproducible actions.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from impala_rl.envs.spaces import assemble_leaves, is_composite, mask_width, space_leaves

__all__ = [
    "SUPPORTED_ACTION_SPACES",
    "ActionDistribution",
    "ActionHead",
    "BernoulliDistribution",
    "BoxHead",
    "CategoricalDistribution",
    "CompositeDistribution",
    "CompositeHead",
    "DiagGaussianDistribution",
    "DiscreteHead",
    "MultiBinaryHead",
    "MultiCategoricalDistribution",
    "MultiDiscreteHead",
    "make_action_head",
]

SUPPORTED_ACTION_SPACES: tuple[str, ...] = (
    "Discrete",
    "MultiDiscrete",
    "MultiBinary",
    "Box",
    "Tuple or Dict of these (nested too)",
)

_LOG_2PI = math.log(2.0 * math.pi)


def _noise(
    shape: Sequence[int], like: Tensor, generator: torch.Generator | None, normal: bool = False
) -> Tensor:
    """Draw U[0, 1) (or N(0, 1)) noise of ``shape`` for ``like`` (device/dtype) via ``generator``.

    The noise is drawn on the generator's own device (so a CPU generator works for CUDA
    tensors) and then moved next to ``like``.
    """
    device = generator.device if generator is not None else like.device
    draw = torch.randn if normal else torch.rand
    noise = draw(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    return noise.to(device=like.device, dtype=like.dtype)


class ActionDistribution(ABC):
    """A batch of action distributions with leading batch dims ``[*batch]``."""

    @property
    @abstractmethod
    def batch_shape(self) -> torch.Size:
        """Leading batch dims of this distribution."""

    @abstractmethod
    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        """Draw one action per batch element (reproducible given ``generator``)."""

    @abstractmethod
    def log_prob(self, actions: Tensor) -> Tensor:
        """Log-probability of ``actions``, summed over action components: ``[*batch]``."""

    @abstractmethod
    def entropy(self) -> Tensor:
        """Entropy, summed over action components: ``[*batch]``."""

    @abstractmethod
    def mode(self) -> Tensor:
        """Most likely (deterministic) action, for evaluation."""


class CategoricalDistribution(ActionDistribution):
    """Categorical over ``n`` classes from ``logits [*batch, n]``; actions ``[*batch]`` int64.

    ``mask [*batch, n]`` (bool, optional) marks the legal actions: illegal ones get
    probability 0 (their logits are set to the dtype's lowest value). A row without any legal
    action is left unmasked rather than turned into NaN.
    """

    def __init__(self, logits: Tensor, mask: Tensor | None = None) -> None:
        if logits.ndim < 1:
            raise ValueError("CategoricalDistribution needs logits with a trailing class dim")
        if mask is not None:
            mask = mask.to(device=logits.device, dtype=torch.bool)
            if mask.shape != logits.shape:
                raise ValueError(
                    f"action mask shape {tuple(mask.shape)} != logits shape {tuple(logits.shape)}"
                )
            mask = mask | ~mask.any(dim=-1, keepdim=True)
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        self.logits = logits - logits.logsumexp(dim=-1, keepdim=True)

    @property
    def batch_shape(self) -> torch.Size:
        return self.logits.shape[:-1]

    @property
    def probs(self) -> Tensor:
        return self.logits.exp()

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        # Gumbel-max trick: argmax(logits + Gumbel noise) ~ Categorical(softmax(logits)).
        with torch.no_grad():
            u = _noise(self.logits.shape, self.logits, generator)
            u = u.clamp_(min=torch.finfo(u.dtype).tiny)
            gumbel = -torch.log(-torch.log(u))
            return torch.argmax(self.logits.detach() + gumbel, dim=-1)

    def log_prob(self, actions: Tensor) -> Tensor:
        idx = actions.long().unsqueeze(-1)
        logits = self.logits
        if idx.shape[:-1] != logits.shape[:-1]:
            logits = logits.expand(*idx.shape[:-1], logits.shape[-1])
        return logits.gather(-1, idx).squeeze(-1)

    def entropy(self) -> Tensor:
        logits = self.logits.clamp(min=torch.finfo(self.logits.dtype).min)
        return -(logits.exp() * logits).sum(dim=-1)

    def mode(self) -> Tensor:
        return self.logits.argmax(dim=-1)


class MultiCategoricalDistribution(ActionDistribution):
    """Independent categoricals from ``logits [*batch, sum(nvec)]``; actions ``[*batch, k]``.
    ``mask [*batch, sum(nvec)]`` (optional): each dimension's legal values, as for
    :class:`CategoricalDistribution`, concatenated."""

    def __init__(self, logits: Tensor, nvec: Sequence[int], mask: Tensor | None = None) -> None:
        self.nvec = tuple(int(n) for n in nvec)
        if logits.shape[-1] != sum(self.nvec):
            raise ValueError(
                f"logits trailing dim {logits.shape[-1]} != sum(nvec) = {sum(self.nvec)}"
            )
        chunks = torch.split(logits, self.nvec, dim=-1)
        masks: Sequence[Tensor | None] = [None] * len(chunks)
        if mask is not None:
            if mask.shape[-1] != sum(self.nvec):
                raise ValueError(
                    f"action mask trailing dim {mask.shape[-1]} != sum(nvec) = {sum(self.nvec)}"
                )
            masks = torch.split(mask, self.nvec, dim=-1)
        self.components = [
            CategoricalDistribution(chunk, m) for chunk, m in zip(chunks, masks, strict=True)
        ]

    @property
    def batch_shape(self) -> torch.Size:
        return self.components[0].batch_shape

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return torch.stack([c.sample(generator) for c in self.components], dim=-1)

    def log_prob(self, actions: Tensor) -> Tensor:
        parts = [c.log_prob(actions[..., i]) for i, c in enumerate(self.components)]
        return torch.stack(parts, dim=-1).sum(dim=-1)

    def entropy(self) -> Tensor:
        return torch.stack([c.entropy() for c in self.components], dim=-1).sum(dim=-1)

    def mode(self) -> Tensor:
        return torch.stack([c.mode() for c in self.components], dim=-1)


FORCED_LOGIT = 1.0e4
"""A masked bit's logit: ``sigmoid`` rounds it to exactly 0 or 1 in every float dtype, and
unlike the dtype's largest value it stays finite through the loss's arithmetic."""


class BernoulliDistribution(ActionDistribution):
    """Independent Bernoullis from ``logits [*batch, n]``; actions ``[*batch, n]`` (0/1).

    ``mask [*batch, 2 * n]`` (bool, optional): per bit whether 0 and whether 1 is legal (the
    bit as a dimension of two values, as :class:`MultiCategoricalDistribution` reads a mask). A
    bit with one legal value takes it with probability 1 (its logit set to
    :data:`FORCED_LOGIT` or its negative, so it carries no gradient, no entropy and a log-prob
    of 0); a bit with both, or neither, is left free.
    """

    def __init__(self, logits: Tensor, mask: Tensor | None = None) -> None:
        if mask is not None:
            mask = mask.to(device=logits.device, dtype=torch.bool)
            if mask.shape[-1] != 2 * logits.shape[-1]:
                raise ValueError(
                    f"action mask trailing dim {mask.shape[-1]} != 2 x {logits.shape[-1]} bits"
                )
            pairs = mask.unflatten(-1, (logits.shape[-1], 2))
            only_zero, only_one = pairs[..., 0] & ~pairs[..., 1], pairs[..., 1] & ~pairs[..., 0]
            logits = logits.masked_fill(only_one, FORCED_LOGIT)
            logits = logits.masked_fill(only_zero, -FORCED_LOGIT)
        self.logits = logits

    @property
    def batch_shape(self) -> torch.Size:
        return self.logits.shape[:-1]

    @property
    def probs(self) -> Tensor:
        return torch.sigmoid(self.logits)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        with torch.no_grad():
            u = _noise(self.logits.shape, self.logits, generator)
            return (u < torch.sigmoid(self.logits.detach())).long()

    def log_prob(self, actions: Tensor) -> Tensor:
        a = actions.to(self.logits.dtype)
        logits = self.logits
        if a.shape != logits.shape:
            logits, a = torch.broadcast_tensors(logits, a)
        return -F.binary_cross_entropy_with_logits(logits, a, reduction="none").sum(dim=-1)

    def entropy(self) -> Tensor:
        p = torch.sigmoid(self.logits)
        return F.binary_cross_entropy_with_logits(self.logits, p, reduction="none").sum(dim=-1)

    def mode(self) -> Tensor:
        return (self.logits > 0).long()


class DiagGaussianDistribution(ActionDistribution):
    """Diagonal Gaussian from ``mean [*batch, d]`` and broadcastable ``log_std``."""

    def __init__(self, mean: Tensor, log_std: Tensor) -> None:
        self.mean = mean
        self.log_std = log_std.expand_as(mean)

    @property
    def batch_shape(self) -> torch.Size:
        return self.mean.shape[:-1]

    @property
    def std(self) -> Tensor:
        return self.log_std.exp()

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        with torch.no_grad():
            noise = _noise(self.mean.shape, self.mean, generator, normal=True)
            return self.mean.detach() + self.std.detach() * noise

    def log_prob(self, actions: Tensor) -> Tensor:
        z = (actions.to(self.mean.dtype) - self.mean) / self.std
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(dim=-1)

    def entropy(self) -> Tensor:
        return (0.5 + 0.5 * _LOG_2PI + self.log_std).sum(dim=-1)

    def mode(self) -> Tensor:
        return self.mean


def split_actions(actions: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Each part's actions ``[*batch, *shape]`` of joined ``actions [*batch, W]``
    (:class:`CompositeDistribution`)."""
    widths = [math.prod(s) for s in shapes]  # not numpy's: a graph break when compiled
    chunks = torch.split(actions, widths, dim=-1)
    return [c.reshape(*actions.shape[:-1], *s) for c, s in zip(chunks, shapes, strict=True)]


class CompositeDistribution(ActionDistribution):
    """Independent parts, one per leaf of a ``Tuple`` or ``Dict`` action space; an action is
    ``[*batch, W]`` float32: each part's action flattened to its columns, in order (a discrete
    part's indices as floats, exact below 2**24). Log-probabilities and entropies add up."""

    def __init__(self, parts: Sequence[ActionDistribution], shapes: Sequence[tuple[int, ...]]):
        self.parts = list(parts)
        self.shapes = [tuple(s) for s in shapes]
        self.widths = [math.prod(s) for s in self.shapes]

    @property
    def batch_shape(self) -> torch.Size:
        return self.parts[0].batch_shape

    def _joined(self, actions: Sequence[Tensor]) -> Tensor:
        batch = self.batch_shape
        parts = [a.reshape(*batch, w).float() for a, w in zip(actions, self.widths, strict=True)]
        return torch.cat(parts, dim=-1)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self._joined([p.sample(generator) for p in self.parts])

    def log_prob(self, actions: Tensor) -> Tensor:
        split = split_actions(actions, self.shapes)
        parts = [p.log_prob(a) for p, a in zip(self.parts, split, strict=True)]
        return torch.stack(parts, dim=-1).sum(dim=-1)

    def entropy(self) -> Tensor:
        return torch.stack([p.entropy() for p in self.parts], dim=-1).sum(dim=-1)

    def mode(self) -> Tensor:
        return self._joined([p.mode() for p in self.parts])


def _small_linear(in_features: int, out_features: int, gain: float = 0.01) -> nn.Linear:
    """Linear layer with orthogonal init (small gain) and zero bias, for policy outputs."""
    layer = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(layer.weight, gain=gain)
    nn.init.zeros_(layer.bias)
    return layer


def _to_numpy(actions: Tensor) -> np.ndarray:
    return actions.detach().cpu().numpy()


class ActionHead(nn.Module, ABC):
    """Maps features ``[*batch, F]`` to an :class:`ActionDistribution` over ``[*batch]``.

    ``action_shape`` / ``action_dtype`` describe one action as the model stores it (e.g. in a
    rollout buffer); :meth:`to_env` converts model actions into what the env expects.
    """

    action_shape: tuple[int, ...]
    action_dtype: torch.dtype

    def __init__(self, action_space: gymnasium.Space) -> None:
        super().__init__()
        self.action_space = action_space
        self.mask_width = mask_width(action_space)
        """Entries of an action mask (``None``: the head takes none)."""

    @abstractmethod
    def forward(self, features: Tensor, mask: Tensor | None = None) -> ActionDistribution:
        """Return the action distribution for ``features [*batch, F]``; ``mask
        [*batch, mask_width]`` (bool, heads that take one) marks the legal actions."""

    @abstractmethod
    def to_env(self, actions: Tensor) -> np.ndarray:
        """Convert model actions ``[N, *action_shape]`` into a vector-env action batch."""


class DiscreteHead(ActionHead):
    """Head for ``Discrete(n, start)``; model actions are ``0..n-1``, env gets ``start + a``."""

    def __init__(self, action_space: gymnasium.spaces.Discrete, in_features: int) -> None:
        super().__init__(action_space)
        self.n = int(action_space.n)
        self.start = int(action_space.start)
        self.action_shape = ()
        self.action_dtype = torch.int64
        self.logits = _small_linear(in_features, self.n)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> CategoricalDistribution:
        return CategoricalDistribution(self.logits(features), mask)

    def to_env(self, actions: Tensor) -> np.ndarray:
        return _to_numpy(actions).astype(np.int64) + self.start


class MultiDiscreteHead(ActionHead):
    """Head for ``MultiDiscrete(nvec, start)`` (any nvec shape, flattened to ``k`` components)."""

    def __init__(self, action_space: gymnasium.spaces.MultiDiscrete, in_features: int) -> None:
        super().__init__(action_space)
        self.space_shape = tuple(action_space.shape)
        self.nvec = tuple(int(n) for n in np.asarray(action_space.nvec).reshape(-1))
        self.start = np.asarray(action_space.start, dtype=np.int64).reshape(-1)
        self.action_shape = (len(self.nvec),)
        self.action_dtype = torch.int64
        self.logits = _small_linear(in_features, sum(self.nvec))

    def forward(self, features: Tensor, mask: Tensor | None = None) -> MultiCategoricalDistribution:
        return MultiCategoricalDistribution(self.logits(features), self.nvec, mask)

    def to_env(self, actions: Tensor) -> np.ndarray:
        arr = _to_numpy(actions).astype(np.int64) + self.start
        return arr.reshape(arr.shape[:-1] + self.space_shape)


class MultiBinaryHead(ActionHead):
    """Head for ``MultiBinary(n)`` (any shape, flattened); the env gets an int8 array."""

    def __init__(self, action_space: gymnasium.spaces.MultiBinary, in_features: int) -> None:
        super().__init__(action_space)
        self.space_shape = tuple(action_space.shape)
        self.n = int(np.prod(self.space_shape, dtype=np.int64))
        self.action_shape = (self.n,)
        self.action_dtype = torch.int64
        self.logits = _small_linear(in_features, self.n)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> BernoulliDistribution:
        return BernoulliDistribution(self.logits(features), mask)

    def to_env(self, actions: Tensor) -> np.ndarray:
        arr = _to_numpy(actions).astype(np.int8)
        return arr.reshape(arr.shape[:-1] + self.space_shape)


class BoxHead(ActionHead):
    """Head for a ``Box`` action space: Gaussian mean + state-independent learnable log-std.

    Samples stay unclipped (for exact log-probs); :meth:`to_env` clips to the bounds
    (infinite bounds mean no clipping) and reshapes to the space shape.
    """

    def __init__(self, action_space: gymnasium.spaces.Box, in_features: int) -> None:
        super().__init__(action_space)
        self.space_shape = tuple(action_space.shape)
        self.dim = int(np.prod(self.space_shape, dtype=np.int64))
        self.action_shape = (self.dim,)
        self.action_dtype = torch.float32
        self.env_dtype = np.dtype(action_space.dtype)
        self.low = np.asarray(action_space.low, dtype=np.float64).reshape(-1)
        self.high = np.asarray(action_space.high, dtype=np.float64).reshape(-1)
        self.mean = _small_linear(in_features, self.dim)
        self.log_std = nn.Parameter(torch.zeros(self.dim))

    def forward(self, features: Tensor) -> DiagGaussianDistribution:
        return DiagGaussianDistribution(self.mean(features), self.log_std)

    def to_env(self, actions: Tensor) -> np.ndarray:
        arr = np.clip(_to_numpy(actions).astype(np.float64), self.low, self.high)
        if np.issubdtype(self.env_dtype, np.integer):
            arr = np.rint(arr)
        arr = arr.astype(self.env_dtype)
        return arr.reshape(arr.shape[:-1] + self.space_shape)


class CompositeHead(ActionHead):
    """Head for a ``Tuple`` or ``Dict`` action space (nested too) of the other spaces: one
    head per leaf on the same features, the parts independent given them
    (:class:`CompositeDistribution`). The env gets one tuple or dict per row, as the space's
    ``sample()`` gives."""

    def __init__(self, action_space: gymnasium.Space, in_features: int) -> None:
        super().__init__(action_space)
        heads = []
        for path, leaf in space_leaves(action_space):
            if is_composite(leaf):
                where = f"an empty entry {path}" if path else "no entries"
                raise ValueError(f"the action space {action_space!r} has {where}")
            try:
                heads.append(make_action_head(leaf, in_features))
            except ValueError:
                raise ValueError(
                    f"the action space {action_space!r} has an entry {path} of {leaf!r}; "
                    f"supported entries: {', '.join(SUPPORTED_ACTION_SPACES[:-1])}"
                ) from None
        self.heads = nn.ModuleList(heads)
        self.shapes = [tuple(h.action_shape) for h in heads]
        self.action_shape = (sum(math.prod(s) for s in self.shapes),)
        self.action_dtype = torch.float32
        self.mask_widths = [h.mask_width for h in heads if h.mask_width is not None]
        """The masked parts' widths, in order: how a mask splits."""

    def forward(self, features: Tensor, mask: Tensor | None = None) -> CompositeDistribution:
        if mask is None:
            return CompositeDistribution([h(features) for h in self.heads], self.shapes)
        masks = iter(torch.split(mask, self.mask_widths, dim=-1))  # each masked part's own
        parts = [
            h(features) if h.mask_width is None else h(features, next(masks)) for h in self.heads
        ]
        return CompositeDistribution(parts, self.shapes)

    def split(self, actions: Tensor) -> list[Tensor]:
        """Each leaf's model actions, in its own dtype, from joined ``actions [*batch, W]``."""
        parts = split_actions(actions, self.shapes)
        return [a.to(h.action_dtype) for a, h in zip(parts, self.heads, strict=True)]

    def to_env(self, actions: Tensor) -> list[Any]:  # type: ignore[override]
        """A list of ``N`` actions (tuples or dicts) for model actions ``[N, W]``."""
        parts = [h.to_env(a) for h, a in zip(self.heads, self.split(actions), strict=True)]
        return [
            assemble_leaves(self.action_space, iter([p[i] for p in parts]))
            for i in range(actions.shape[0])
        ]


def make_action_head(action_space: gymnasium.Space, in_features: int) -> ActionHead:
    """Build the :class:`ActionHead` matching ``action_space``.

    Raises:
        ValueError: if the space is not one of :data:`SUPPORTED_ACTION_SPACES`.
    """
    spaces = gymnasium.spaces
    if isinstance(action_space, spaces.Discrete):
        return DiscreteHead(action_space, in_features)
    if isinstance(action_space, spaces.MultiDiscrete):
        return MultiDiscreteHead(action_space, in_features)
    if isinstance(action_space, spaces.MultiBinary):
        return MultiBinaryHead(action_space, in_features)
    if isinstance(action_space, spaces.Box):
        return BoxHead(action_space, in_features)
    if is_composite(action_space):
        return CompositeHead(action_space, in_features)
    raise ValueError(
        f"Unsupported action space {action_space!r}; supported action spaces are: "
        f"{', '.join(SUPPORTED_ACTION_SPACES)}"
    )


def action_feature_size(space: gymnasium.Space) -> int:
    """Width of :func:`encode_actions`' output for ``space``."""
    if isinstance(space, gymnasium.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        return int(np.asarray(space.nvec).sum())
    if is_composite(space):
        return sum(action_feature_size(leaf) for _, leaf in space_leaves(space))
    return int(np.prod(space.shape, dtype=np.int64))


def encode_actions(head: ActionHead, actions: Tensor) -> Tensor:
    """Model actions ``[*batch, *action_shape]`` as float features ``[*batch, A]``: one-hot
    for (multi-)discrete actions, the flat vector for binary and continuous ones."""
    if isinstance(head, DiscreteHead):
        return F.one_hot(actions.long(), head.n).float()
    if isinstance(head, MultiDiscreteHead):
        parts = [F.one_hot(actions[..., i].long(), n) for i, n in enumerate(head.nvec)]
        return torch.cat(parts, dim=-1).float()
    if isinstance(head, (MultiBinaryHead, BoxHead)):
        return actions.float()
    if isinstance(head, CompositeHead):
        parts = [encode_actions(h, a) for h, a in zip(head.heads, head.split(actions), strict=True)]
        return torch.cat(parts, dim=-1)
    raise ValueError(f"cannot encode actions of {type(head).__name__}")
