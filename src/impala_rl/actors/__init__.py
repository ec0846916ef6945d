"""Actor backends behind one ``DistributedActors`` interface."""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import torch

from impala_rl.actors.base import ActorError, CollectedOutputs, DistributedActors, actor_seed
from impala_rl.actors.sequential import SequentialDistributedActors
from impala_rl.config import RunConfig
from impala_rl.nn import Model


def make_actors(
    cfg: RunConfig,
    env_factory: Callable[[], gym.Env],
    model: Model,
    seed: int | None = None,
    device: torch.device | str = "cpu",
) -> DistributedActors:
    """The backend ``runner.backend`` names; ``seed`` (default ``cfg.seed``) seeds the actors;
    ``device`` is the learner's (where central inference acts)."""
    backend = cfg.runner.backend
    seed = cfg.seed if seed is None else seed
    if backend == "sequential":
        return SequentialDistributedActors(env_factory, model, cfg.algorithm, seed)
    if backend == "subprocess":
        from impala_rl.actors.subprocess import SubprocessDistributedActors

        return SubprocessDistributedActors(
            env_factory, model, cfg.algorithm, seed, runner=cfg.runner, device=device
        )
    if backend == "ray":
        from impala_rl.actors.ray import RayDistributedActors  # imports ray (optional)

        return RayDistributedActors(env_factory, model, cfg.algorithm, seed, runner=cfg.runner)
    raise NotImplementedError(
        f"runner.backend={backend!r} is not available; valid: sequential | subprocess | ray"
    )


__all__ = [
    "ActorError",
    "CollectedOutputs",
    "DistributedActors",
    "SequentialDistributedActors",
    "actor_seed",
    "make_actors",
]
