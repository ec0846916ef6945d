"""Build the actor-critic a run config describes."""

from __future__ import annotations

import gymnasium as gym

from impala_rl.config import ConfigError, ModelConfig
from impala_rl.nn.actor_critic import ActorCritic


def build_model(
    model_cfg: ModelConfig, observation_space: gym.spaces.Box, action_space: gym.Space
) -> ActorCritic:
    """The model for these spaces; a mismatch (e.g. a CNN on vectors) is a ``ConfigError``."""
    try:
        return ActorCritic(
            observation_space,
            action_space,
            hidden_sizes=tuple(model_cfg.hidden_sizes),
            activation=model_cfg.activation,
            shared_torso=model_cfg.shared_torso,
            encoder=model_cfg.encoder,
            core=model_cfg.core,
            lstm_hidden_size=model_cfg.lstm_hidden_size,
            use_last_action_reward=model_cfg.use_last_action_reward,
            precision=model_cfg.precision,
            channels_last=model_cfg.channels_last,
        )
    except ValueError as exc:
        raise ConfigError(f"model (encoder={model_cfg.encoder!r}): {exc}") from None
