"""Helpers shared by the actor-backend tests: small backends on CartPole, and their processes."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from impala_rl.actors import DistributedActors, SequentialDistributedActors
from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig, RunnerConfig
from impala_rl.envs import EnvFactory
from impala_rl.nn.factory import build_model

CRASH_ENV = "fault_envs:make_crashing_env"
BACKENDS = ["subprocess", "ray"]  # the multi-actor backends, behind one supervisor


def make_actors(
    backend: str,
    *,
    env_id: str = "CartPole-v1",
    env_kwargs: dict | None = None,
    max_episode_steps: int | None = None,
    seed: int = 0,
    max_actor_restarts: int = 3,
    shutdown_timeout_s: float = 5.0,
    normalize_obs: bool = False,
    hidden_sizes: tuple[int, ...] = (16,),
    **algorithm: object,
) -> DistributedActors:
    """A small ``backend`` on CartPole (or ``env_id``) with a seeded random MLP policy."""
    factory = EnvFactory(env_id, env_kwargs or {}, max_episode_steps)
    probe = factory()
    observation_space, action_space = probe.observation_space, probe.action_space
    probe.close()
    torch.manual_seed(1234)
    model = build_model(
        ModelConfig(hidden_sizes=list(hidden_sizes), normalize_obs=normalize_obs),
        observation_space,
        action_space,
    )
    if normalize_obs:  # statistics far from the identity, so that using them shows
        model.observation_normalizer(0).update(
            torch.randn(64, *observation_space.shape) * 0.1 + 0.5
        )
    settings = {
        "num_actors": 2,
        "envs_per_actor": 2,
        "n_rollout_steps": 8,
        "actors_batch_size": 2,
        **algorithm,
    }
    cfg = ImpalaAlgorithmConfig(**settings)  # type: ignore[arg-type]
    if backend == "sequential":
        return SequentialDistributedActors(factory, model, cfg, seed)
    runner = RunnerConfig(
        backend=backend,
        max_actor_restarts=max_actor_restarts,
        shutdown_timeout_s=shutdown_timeout_s,
        ray_num_cpus_per_actor=0.5,
    )
    if backend == "subprocess":
        from impala_rl.actors.subprocess import SubprocessDistributedActors

        return SubprocessDistributedActors(factory, model, cfg, seed, runner=runner)
    from impala_rl.actors.ray import RayDistributedActors

    return RayDistributedActors(factory, model, cfg, seed, runner=runner)


def actor_pid(actors, index: int) -> int:
    """The process id of actor ``index`` (a Ray actor's once it is up)."""
    actor = actors.actors[index]
    if getattr(actor, "process", None) is not None:
        return actor.process.pid
    import ray

    return ray.get(actor.handle.pid.remote(), timeout=60)


def proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def watch_actors(monkeypatch, on_returns: Callable) -> list:
    """Wrap the trainer's ``make_actors`` so that a test sees the actors it makes and calls
    ``on_returns(cfg, actors, returns)`` with each return feed (after every update)."""
    import impala_rl.trainer

    make = impala_rl.trainer.make_actors
    created: list = []

    def make_and_watch(cfg, env_factory, model, seed=None, device="cpu"):
        actors = make(cfg, env_factory, model, seed=seed, device=device)
        created.append(actors)
        feed = actors.recent_returns_since_last_call

        def watched() -> list[float]:
            returns = feed()
            on_returns(cfg, actors, returns)
            return returns

        actors.recent_returns_since_last_call = watched
        return actors

    monkeypatch.setattr(impala_rl.trainer, "make_actors", make_and_watch)
    return created


def stop_once_train_return_reaches(monkeypatch, threshold: float) -> None:
    """End the next run after the update at which the mean of its last 100 training episodes
    (the trainer's ``train_return_recent``, computed the same way) first reaches
    ``threshold``: it lowers ``max_env_steps``, which the trainer reads after every update, so
    the run stops as ``max_env_steps`` with that mean in its summary. A seeded sequential run
    takes the same steps up to there as one that trains on to its budget."""
    recent: deque[float] = deque(maxlen=100)

    def on_returns(cfg, actors, returns):
        recent.extend(returns)
        if recent and sum(recent) / len(recent) >= threshold:
            cfg.max_env_steps = 1  # stop after this update

    watch_actors(monkeypatch, on_returns)
