"""Hand-made learner batches for tests that call ``Learner.update`` without actors."""

from __future__ import annotations

import math

import torch


def vector_batch(T: int, B: int, obs_size: int = 3, n_actions: int = 2) -> dict[str, torch.Tensor]:
    """A slot of ``B`` columns of ``T`` steps of a plain env with ``obs_size`` float
    observations and ``n_actions`` actions, acted by the uniform policy at version 0; no episode
    ends. Rewards are standard normal: set ``batch["reward"]`` to change them."""
    return {
        "obs": torch.randn(T + 1, B, obs_size),
        "first": torch.zeros(T + 1, B, dtype=torch.bool),
        "action": torch.randint(0, n_actions, (T + 1, B)),
        "behaviour_log_prob": torch.full((T, B), -math.log(n_actions)),
        "reward": torch.randn(T, B),
        "terminated": torch.zeros(T, B, dtype=torch.bool),
        "truncated": torch.zeros(T, B, dtype=torch.bool),
        "truncation_value": torch.zeros(T, B),
        "policy_version": torch.zeros(B, dtype=torch.int64),
    }
