"""Build the actor-critic a run config describes."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from impala_rl.config import ConfigError, ModelConfig
from impala_rl.nn.actor_critic import ActorCritic
from impala_rl.nn.init import initialize


def _model_kwargs(model_cfg: ModelConfig) -> dict[str, Any]:
    """What the model takes from ``model`` for every env: torsos, the user's encoders, the
    core, precision, normalization and PopArt."""
    return {
        "hidden_sizes": tuple(model_cfg.hidden_sizes),
        "activation": model_cfg.activation,
        "shared_torso": model_cfg.shared_torso,
        "encoder": model_cfg.encoder,
        "dict_vectors": model_cfg.dict_vectors,
        "read_text": model_cfg.read_text,
        "core": model_cfg.core,
        "lstm_hidden_size": model_cfg.lstm_hidden_size,
        "use_last_action_reward": model_cfg.use_last_action_reward,
        "precision": model_cfg.precision,
        "channels_last": model_cfg.channels_last,
        "actor_hidden_sizes": model_cfg.actor_hidden_sizes,
        "critic_hidden_sizes": model_cfg.critic_hidden_sizes,
        "normalize_obs": model_cfg.normalize_obs,
        "normalize_obs_center": model_cfg.normalize_obs_center,
        "popart_beta": model_cfg.popart_beta if model_cfg.popart else None,
        "popart_sigma_min": model_cfg.popart_sigma_min,
        "encoder_kwargs": dict(model_cfg.encoder_kwargs),
        "value_encoder": model_cfg.value_encoder,
        "value_encoder_kwargs": dict(model_cfg.value_encoder_kwargs),
    }


def _model(model_cfg: ModelConfig, obs_spaces: Any, action_spaces: Any, **keys: Any) -> ActorCritic:
    """The model for one space each (a plain env) or ``{step_key: space}``; a mismatch (e.g. a
    CNN on vectors) is a ``ConfigError`` naming the encoder."""
    try:
        model = ActorCritic(obs_spaces, action_spaces, **keys, **_model_kwargs(model_cfg))
    except ConfigError:
        raise  # already names its field (a user's encoder, Dict entries)
    except ValueError as exc:
        raise ConfigError(f"model (encoder={model_cfg.encoder!r}): {exc}") from None
    initialize(model, model_cfg.init)
    return model


def build_model(
    model_cfg: ModelConfig, observation_space: gym.Space, action_space: gym.Space
) -> ActorCritic:
    """The model of a plain env with these spaces (one step key)."""
    return _model(
        model_cfg,
        observation_space,
        action_space,
        policy_obs_keys=model_cfg.policy_obs_keys,
        value_obs_keys=model_cfg.value_obs_keys,
    )


def build_model_for_env(model_cfg: ModelConfig, env: Any, entries: bool = True) -> ActorCritic:
    """:func:`build_model` for a plain env, or the model with a structured env's step keys
    (per-key spaces as the structured vector env presents them, ``entries`` as
    ``env.observation_entries``)."""
    from impala_rl.envs.structured import KeyObservation, check_structured_env, is_structured

    if not is_structured(env):
        return build_model(model_cfg, env.observation_space, env.action_space)
    for key in ("policy_obs_keys", "value_obs_keys"):
        if getattr(model_cfg, key) is not None:
            raise ConfigError(
                f"model.{key}: selects entries of a plain env's Dict observation; a structured "
                "env's step keys each read their whole observation; valid: null"
            )
    check_structured_env(env)
    converters = {k: KeyObservation(s, k, entries) for k, s in env.observation_spaces.items()}
    return _model(
        model_cfg,
        {k: c.space for k, c in converters.items()},
        env.action_spaces,
        shared_policy=model_cfg.shared_policy,
        critic=model_cfg.critic,
        mask_sizes={k: c.mask_size for k, c in converters.items()},
        n_agents=int(env.n_agents),
    )
