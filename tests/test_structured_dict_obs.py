"""Structured envs whose step keys observe Dicts: each key's observation keeps its entries (an
encoder per entry, a ``Text`` entry as its words), the slot stores each entry in its own
dtype, the learner recomputes the actors' log-probs (with a core, with normalization per vector
entry), and a run trains, evaluates and loads with ``load_policy``.

The env is ``tests/dict_envs.py``'s ``DictKeysEnv`` (two keys taking turns, one with MiniGrid's
observation in small, one with an action mask).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gymnasium import spaces

import dict_envs
import impala_rl
from impala_rl.config import ConfigError, load_config
from impala_rl.envs import make_env_factory
from impala_rl.envs.spaces import TextTokens, text_tokens
from impala_rl.learner import forward_batch, update_observation_statistics
from impala_rl.nn.encoders import DictEncoder
from impala_rl.nn.factory import build_model_for_env
from impala_rl.nn.normalization import DictObsNorm
from impala_rl.policy import load_policy
from impala_rl.rollout import ActorLoop, rollout_spec_for

T, N = 5, 2
FAST = ["log.console=false", "log.tensorboard=false", "target_return=null"]
CORE = ["model.core=lstm", "model.shared_torso=true", "model.lstm_hidden_size=32"]


def _model(overrides=()):
    cfg = load_config("multistep_example", list(overrides))
    return build_model_for_env(cfg.model, dict_envs.DictKeysEnv())


def test_each_step_key_gets_an_encoder_per_entry_and_text_is_read_as_words(caplog):
    with caplog.at_level(logging.WARNING):
        make_env_factory(load_config("cartpole", ["env.id=dict_envs:make_keys_env"]).env)
    model = _model()
    first, second = model.observation_spaces[0], model.observation_spaces[1]
    assert isinstance(first, spaces.Dict) and isinstance(second, spaces.Dict)
    assert list(first.spaces) == ["direction", "image", "mission", "pos"]
    assert first["image"] == spaces.Box(0, 255, (3, 5, 5), np.uint8)  # channels first
    assert isinstance(first["mission"], TextTokens)
    assert list(second.spaces) == ["mode", "pos"]  # the action mask is the mask
    assert model.mask_sizes == {0: None, 1: 3}
    for k in (0, 1):
        assert isinstance(model.action_head(k), torch.nn.Module)
        assert isinstance(model._policy_net(k).torso, DictEncoder)
    assert "mission" not in caplog.text  # nothing left out


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.normalize_obs=true"], [*CORE, "model.use_last_action_reward=true"]],
    ids=["plain", "normalized", "core"],
)
def test_slots_keep_each_entry_and_the_learner_recomputes_the_actors_log_probs(overrides):
    model = _model(overrides)
    with torch.no_grad():  # weights that make every entry matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    spec = rollout_spec_for(model, None, T, N)
    warm_up = spec.allocate()
    ActorLoop(dict_envs.make_keys_env, N, model, seed=1, unroll_length=T).unroll(warm_up)
    update_observation_statistics(model, warm_up)  # statistics that are not the identity
    loop = ActorLoop(dict_envs.make_keys_env, N, model, seed=0, unroll_length=T)
    for _ in range(3):
        slot = spec.allocate()
        loop.unroll(slot)
        assert slot["obs_0.image"].dtype == torch.uint8
        assert tuple(slot["obs_0.image"].shape) == (T + 1, N, 3, 5, 5)
        assert slot["obs_0.direction"].dtype == torch.int64
        assert slot["obs_1.mode"].dtype == torch.int64
        keys = slot["step_key"]
        assert set(keys.flatten().tolist()) == {0, 1}
        assert slot["obs_0.mission"].dtype == torch.int16
        go = torch.as_tensor(text_tokens("go").copy())
        assert (slot["obs_0.mission"][keys == 0] == go).all()  # key 0's mission, as words
        # the rows a key decides hold that key's observation: direction index 0..3, mode 0..2
        assert slot["obs_0.direction"][keys == 0].max() <= 3
        assert slot["obs_1.mode"][keys == 1].max() <= 2
        assert slot["action_mask_1"][keys == 1].sum(-1).eq(2).all()
        with torch.no_grad():
            log_prob = forward_batch(model, slot).log_prob[:-1]
        torch.testing.assert_close(log_prob, slot["behaviour_log_prob"], atol=1e-5, rtol=0)
    norm = model.observation_normalizer(1)
    if "model.normalize_obs=true" in overrides:
        assert isinstance(norm, DictObsNorm) and norm.names == ["pos"]
        rows = warm_up["step_key"][:-1] == 1
        expected = warm_up["obs_1.pos"][:-1][rows].double().mean(0)
        torch.testing.assert_close(norm.norm("pos").mean, expected)
    else:
        assert norm is None


def test_a_shared_critic_is_refused_for_dict_keys_and_obs_keys_name_their_field():
    with pytest.raises(ConfigError, match=r"critic=shared .* step keys \[0, 1\] observe a Dict"):
        _model(["model.critic=shared"])
    with pytest.raises(ConfigError, match=r"model\.policy_obs_keys: .* valid: null"):
        _model(["model.policy_obs_keys=[pos]"])


def test_a_structured_env_with_dict_keys_learns_evaluates_and_loads(tmp_path):
    """Random actions earn ~3 an episode of 8 sub-steps, reading the Discrete entries 8."""
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            "env.id=dict_envs:make_keys_env",
            "runner.backend=sequential",
            "seed=0",
            "max_env_steps=30000",
            "algorithm.rollout_evaluator.n_episodes=4",
        ],
        run_dir=tmp_path,
    )
    assert summary["best_eval_return"] >= 7.0, summary
    policy = load_policy(tmp_path)
    env = policy.env_factory()
    obs, _ = env.reset(seed=1)
    total, done = 0.0, False
    while not done:
        key = env.actor_id().step_key
        action = policy.act(obs, step_key=key, deterministic=True)
        assert env.action_spaces[key].contains(action)
        obs, reward, terminated, truncated, _ = env.step(action)
        total += reward
        done = terminated or truncated
    assert total >= 7.0
