"""What a run does first in its process, before any epoch: the process set up for training
(the forkserver, seeds, the learner's threads, the allocator) and the env probed once (its
spaces, the model built for it, the vector env settled).

The leader and every further learner start this way; ``Trainer`` then only runs epochs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from impala_rl.config import ConfigError, RunConfig
from impala_rl.envs import EnvFactory, make_env_factory
from impala_rl.machine import available_cores
from impala_rl.malloc import keep_freed_memory
from impala_rl.nn import Model
from impala_rl.nn.factory import build_model_for_env
from impala_rl.rollout import actor_loop_rate


def resolve_device(name: str) -> torch.device:
    """``algorithm.device`` on this machine. The config checks the name; whether the machine
    has that device is checked here, when a run starts (before it builds or starts anything),
    and refused as a :class:`ConfigError` that says what this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (gpus == 0 or (device.index or 0) >= gpus):
        have = "no CUDA device" if gpus == 0 else f"{gpus} CUDA device(s)"
        valid = "cpu | auto" if gpus == 0 else f"cpu | cuda | cuda:N with N < {gpus} | auto"
        raise ConfigError(
            f"invalid value for 'algorithm.device': {name!r}; valid: {valid} (this machine "
            f"has {have})"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"invalid value for 'algorithm.device': {name!r}; valid: cpu | auto (MPS is not "
            "available on this machine)"
        )
    return device


def learner_threads(cfg: RunConfig) -> int:
    """Intra-op threads for the learner: as configured, else the cores actors leave free."""
    if cfg.runner.learner_threads is not None:
        return cfg.runner.learner_threads
    cores = available_cores()
    local_ray = cfg.runner.backend == "ray" and cfg.runner.ray_address is None
    learners = cfg.algorithm.num_learners  # several learners on one machine share the cores
    if cfg.runner.backend == "subprocess" or local_ray:  # actor processes share these cores
        return max(1, (cores - cfg.algorithm.num_actors) // learners)
    return max(1, cores // learners) if cfg.runner.ray_address is None else cores


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_process(cfg: RunConfig) -> None:
    """The forkserver started first (its imports overlap the learner's build), the seeds, the
    learner's intra-op threads and, where asked, freed memory kept by the allocator."""
    if cfg.runner.backend == "subprocess" and cfg.runner.start_method == "forkserver":
        from impala_rl.actors.subprocess import start_forkserver

        start_forkserver()
    seed_everything(cfg.seed)
    torch.set_num_threads(learner_threads(cfg))
    if cfg.runner.keep_freed_memory:
        keep_freed_memory()


@dataclass
class EnvProbe:
    """What one env built at start-up tells the run: its spaces and the model for them, and
    the factories actors and evaluation build their envs with."""

    env_factory: EnvFactory
    eval_env_factory: EnvFactory
    observation_space: Any
    action_space: Any
    model: Model


def probe_env(cfg: RunConfig) -> EnvProbe:
    """Build one env to read its spaces and build the model; settle ``env.vector=auto`` by
    timing an actor's loop on each candidate, before any actor gets the factory."""
    env_factory = make_env_factory(cfg.env)
    probe = env_factory()
    observation_space, action_space = probe.observation_space, probe.action_space
    try:
        model = build_model_for_env(cfg.model, probe, cfg.env.observation_entries)
    finally:
        probe.close()
    n_envs, unroll = cfg.algorithm.envs_per_actor, cfg.algorithm.n_rollout_steps
    env_factory.resolve_vector(
        n_envs, lambda f, seconds: actor_loop_rate(f, n_envs, model, unroll, seconds)
    )
    eval_env_factory = env_factory
    if cfg.env.eval_kwargs:
        kwargs = {**cfg.env.kwargs, **cfg.env.eval_kwargs}
        eval_env_factory = EnvFactory.of(cfg.env, kwargs, env_factory.vector)
    return EnvProbe(env_factory, eval_env_factory, observation_space, action_space, model)
