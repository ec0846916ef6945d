"""Build the actor-critic a run config describes."""

from __future__ import annotations

import gymnasium as gym

from impala_rl.config import ModelConfig
from impala_rl.nn.actor_critic import ActorCritic


def build_model(
    model_cfg: ModelConfig, observation_space: gym.spaces.Box, action_space: gym.Space
) -> ActorCritic:
    return ActorCritic(
        observation_space,
        action_space,
        hidden_sizes=tuple(model_cfg.hidden_sizes),
        activation=model_cfg.activation,
        shared_torso=model_cfg.shared_torso,
    )
