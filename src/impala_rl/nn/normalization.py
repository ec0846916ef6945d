"""Running observation normalization: statistics kept as module buffers.

As buffers they are part of the model's state dict, so the actors' weight copies, the
checkpoints, the evaluator and :func:`impala_rl.policy.load_policy` all use the same
statistics; only the learner updates them, from the observations of each training batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import gymnasium
import numpy as np
import torch
from torch import Tensor, nn

Combine = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


class RunningObsNorm(nn.Module):
    """``clamp((x - mean) / sqrt(var + eps), -clip, clip)`` over ``[*batch, *shape]``; with
    ``center=False``, ``clamp(x / sqrt(mean**2 + var + eps), -clip, clip)``: divided by the
    running root mean square, so an entry keeps its offset (a reading's resting value).

    Mean and (population) variance are merged batch by batch with Chan et al.'s parallel
    update, so after any sequence of :meth:`update` calls they equal those of all the data seen.
    Before the first update the mean is 0 and the variance 1 (the identity up to ``eps``).
    """

    def __init__(
        self, shape: Sequence[int], clip: float = 10.0, eps: float = 1e-8, center: bool = True
    ):
        super().__init__()
        self.shape = tuple(int(s) for s in shape)
        self.clip = float(clip)
        self.eps = float(eps)
        self.center = bool(center)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(self.shape, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: Tensor, combine: Combine | None = None) -> None:
        """Merge the statistics of ``x [*batch, *shape]`` into the running ones.

        ``combine`` (several learners) maps this batch's count, mean and variance to those
        of every learner's batch together; every learner calls it, even with no rows."""
        x = x.detach().reshape(-1, *self.shape).to(self.mean.device, torch.float64)
        n = x.shape[0]
        if combine is not None:
            zeros = torch.zeros_like(self.mean)
            batch_mean = x.mean(dim=0) if n else zeros
            batch_var = x.var(dim=0, unbiased=False) if n else zeros
            count, batch_mean, batch_var = combine(self.count.new_tensor(n), batch_mean, batch_var)
            n = int(count)
        elif n:
            batch_mean = x.mean(dim=0)
            batch_var = x.var(dim=0, unbiased=False)
        if n == 0:
            return
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.mean.add_(delta * n / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x: Tensor) -> Tensor:
        mean = self.mean.to(torch.float32)
        var = self.var.to(torch.float32)
        if self.center:
            x, scale = x.float() - mean, torch.sqrt(var + self.eps)
        else:  # the root mean square: the reading keeps its resting value
            x, scale = x.float(), torch.sqrt(mean.square() + var + self.eps)
        return (x / scale).clamp(-self.clip, self.clip)


class DictObsNorm(nn.Module):
    """A :class:`RunningObsNorm` per vector entry of a Dict observation (``shapes``); the
    other entries (images, Discrete indices) pass through unchanged."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        clip: float = 10.0,
        eps: float = 1e-8,
        center: bool = True,
    ):
        super().__init__()
        # a list in the entries' order: any string names an entry ("type", "agent.pos")
        self.names = list(shapes)
        self.norms = nn.ModuleList(RunningObsNorm(s, clip, eps, center) for s in shapes.values())
        self._index = {name: i for i, name in enumerate(self.names)}
        self._register_load_state_dict_pre_hook(self._norms_by_index)

    def norm(self, name: str) -> RunningObsNorm:
        """The statistics of entry ``name``."""
        return self.norms[self._index[name]]  # type: ignore[return-value]

    def _norms_by_index(self, state_dict: dict, prefix: str, *_args: object) -> None:
        """Checkpoints of an earlier version keyed an entry's statistics by its name."""
        for i, name in enumerate(self.names):
            old = f"{prefix}norms.{name}."
            for key in [k for k in state_dict if k.startswith(old)]:
                state_dict[f"{prefix}norms.{i}.{key[len(old) :]}"] = state_dict.pop(key)

    @torch.no_grad()
    def update(self, x: Mapping[str, Tensor], combine: Combine | None = None) -> None:
        """Merge each vector entry of ``x {entry: [*batch, *shape]}`` into its statistics (in
        one order, so every learner of a group combines the same entry at once)."""
        for name, norm in zip(self.names, self.norms, strict=True):
            norm.update(x[name], combine)

    def forward(self, x: Mapping[str, Tensor]) -> dict[str, Tensor]:
        index = self._index
        return {k: self.norms[index[k]](v) if k in index else v for k, v in x.items()}


def obs_norm_for(
    space: gymnasium.Space, center: bool = True
) -> RunningObsNorm | DictObsNorm | None:
    """The statistics ``normalize_obs`` keeps for observations of ``space``: one
    :class:`RunningObsNorm` for a ``Box``, one per vector (float32) entry of a ``Dict``;
    ``None`` for a Dict without vectors (its images are their CNNs', its indices one-hot)."""
    if not isinstance(space, gymnasium.spaces.Dict):
        return RunningObsNorm(tuple(space.shape or ()), center=center)
    vectors = {
        k: s.shape
        for k, s in space.spaces.items()
        if isinstance(s, gymnasium.spaces.Box) and s.dtype == np.float32
    }
    return DictObsNorm(vectors, center=center) if vectors else None
