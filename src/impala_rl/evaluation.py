"""The rollout evaluator: run whole episodes with the current policy, report returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from impala_rl.envs import make_vector_env
from impala_rl.nn import ActorCritic


@dataclass
class EvaluationResult:
    returns: list[float]
    lengths: list[int]

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))


@torch.no_grad()
def evaluate(
    model: ActorCritic,
    env_factory: Callable[[], gym.Env],
    n_episodes: int,
    deterministic: bool = True,
    seed: int = 0,
    max_episode_steps: int | None = None,
) -> EvaluationResult:
    """Run ``n_episodes`` episodes in parallel (one per env), each to its end.

    ``deterministic`` takes the distribution's mode; otherwise actions are sampled from a
    generator seeded with ``seed``. ``max_episode_steps`` cuts episodes that run longer.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    envs = make_vector_env(env_factory, n_episodes)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    try:
        obs, _ = envs.reset(seed=seed)
        returns = np.zeros(n_episodes)
        lengths = np.zeros(n_episodes, dtype=np.int64)
        running = np.ones(n_episodes, dtype=bool)
        while running.any():
            dist = model(torch.as_tensor(obs, device=device)).dist
            action = dist.mode() if deterministic else dist.sample(generator)
            obs, reward, terminated, truncated, _ = envs.step(
                model.action_head.to_env(action.cpu())
            )
            returns += np.where(running, reward, 0.0)
            lengths += running
            done = np.logical_or(terminated, truncated)
            if max_episode_steps is not None:
                done |= lengths >= max_episode_steps
            running &= ~done
    finally:
        envs.close()
        model.train(was_training)
    return EvaluationResult([float(r) for r in returns], [int(n) for n in lengths])
