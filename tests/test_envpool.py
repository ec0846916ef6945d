"""envpool as the actor's vector env: same-step autoreset and the Gymnasium env's meaning."""

from __future__ import annotations

import logging
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch

import impala_rl
from impala_rl import startup
from impala_rl.config import ConfigError, load_config
from impala_rl.envs import EnvError, EnvFactory, make_env_factory, make_vector_env
from impala_rl.envs import factory as env_factory_module
from impala_rl.nn import ActorCritic
from impala_rl.rollout import ActorLoop, actor_loop_rate, rollout_spec_for

pytest.importorskip("envpool")

from impala_rl.envs.envpool import EnvpoolVectorEnv  # noqa: E402
from impala_rl.envs.vector import SameStepVectorEnv  # noqa: E402


def _sync(env: gym.Env, obs: np.ndarray) -> None:
    """Start a Gymnasium CartPole episode from envpool's state (CartPole observes its state)."""
    env.reset()
    env.unwrapped.state = np.asarray(obs, dtype=np.float64)


def test_envpool_cartpole_matches_gymnasium_step_for_step_with_same_step_autoreset():
    n, limit = 4, 20
    pool = EnvpoolVectorEnv("CartPole-v1", n, max_episode_steps=limit)
    refs = [EnvFactory("CartPole-v1", max_episode_steps=limit)() for _ in range(n)]
    rng = np.random.default_rng(0)
    seen = {"terminated": 0, "truncated": 0}
    try:
        obs, _ = pool.reset(seed=7)
        for env, o in zip(refs, obs, strict=True):
            _sync(env, o)
        for step in range(120):
            actions = rng.integers(0, 2, n)
            obs, reward, term, trunc, info = pool.step(actions)
            for i, env in enumerate(refs):
                ref_obs, ref_reward, ref_term, ref_trunc, _ = env.step(int(actions[i]))
                assert reward[i] == ref_reward and term[i] == ref_term, (step, i)
                assert (trunc[i] and not term[i]) == (ref_trunc and not ref_term)
                if ref_term or ref_trunc:
                    seen["terminated" if ref_term else "truncated"] += 1
                    # the final observation in info, the next episode's first in obs
                    np.testing.assert_allclose(info["final_obs"][i], ref_obs, atol=1e-4)
                    assert info["_final_obs"][i]
                    assert np.abs(obs[i]).max() <= 0.05  # CartPole starts in [-0.05, 0.05]
                    _sync(env, obs[i])
                else:
                    np.testing.assert_allclose(obs[i], ref_obs, atol=1e-4)
                    assert "final_obs" not in info or not info["_final_obs"][i]
    finally:
        pool.close()
        for env in refs:
            env.close()
    assert seen["terminated"] > 0 and seen["truncated"] > 0, seen


def test_envpool_is_seeded_by_reset():
    pool = EnvpoolVectorEnv("CartPole-v1", 3)
    try:
        a, _ = pool.reset(seed=1)
        b, _ = pool.reset(seed=2)
        c, _ = pool.reset(seed=1)
    finally:
        pool.close()
    np.testing.assert_array_equal(a, c)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("faster", ["envpool", "python"])
def test_auto_picks_the_vector_env_that_steps_faster_and_keeps_it(monkeypatch, faster):
    timed = []

    def rate(factory, num_envs, seconds):
        timed.append((factory.vector, num_envs))
        return 2.0 if factory.vector == faster else 1.0

    monkeypatch.setattr(env_factory_module, "steps_per_second", rate)
    factory = EnvFactory("CartPole-v1", vector="auto")
    envs = make_vector_env(factory, 2)
    assert isinstance(envs, EnvpoolVectorEnv if faster == "envpool" else SameStepVectorEnv)
    envs.close()
    assert factory.vector == faster
    assert sorted(timed) == [("envpool", 2), ("envpool", 2), ("python", 2), ("python", 2)]
    for settled in (factory, pickle.loads(pickle.dumps(factory))):  # actors get a copy
        make_vector_env(settled, 2).close()
    assert len(timed) == 4  # settled once: neither a second vector env nor a copy re-times


def test_auto_times_candidates_with_every_setting_of_the_run(monkeypatch):
    seen = []

    def rate(factory, num_envs, seconds):
        seen.append(factory)
        return 1.0

    monkeypatch.setattr(env_factory_module, "steps_per_second", rate)
    factory = EnvFactory(
        "CartPole-v1", max_episode_steps=50, vector="auto", frame_stack=3, action_mask=False
    )
    factory.check_env = True
    factory.resolve_vector(2)
    assert {candidate.vector for candidate in seen} == {"python", "envpool"}
    settings = {
        key: value for key, value in vars(factory).items() if key not in ("vector", "check_env")
    }
    for candidate in seen:
        assert candidate is not factory and not candidate.check_env
        assert {key: vars(candidate)[key] for key in settings} == settings


def test_auto_times_real_vector_envs_and_is_python_where_envpool_cannot_step_the_env(
    monkeypatch,
):
    raw = env_factory_module.steps_per_second
    assert raw(EnvFactory("CartPole-v1", vector="envpool"), 4, 0.05) > 1000
    rate = lambda factory, seconds: raw(factory, 4, 0.05)  # noqa: E731
    factory = EnvFactory("CartPole-v1", vector="auto")
    assert factory.resolve_vector(4, rate) in ("python", "envpool")
    monkeypatch.setattr(env_factory_module, "steps_per_second", None)  # must not be timed
    for factory in (
        EnvFactory("CartPole-v1"),  # the default is python
        EnvFactory("CartPole-v1", vector="python"),
        EnvFactory("CartPole-v1", {"render_mode": "rgb_array"}, vector="auto"),  # Gymnasium's
        EnvFactory("FrozenLake-v1", vector="auto"),  # envpool lacks it
    ):
        envs = make_vector_env(factory, 2)
        assert isinstance(envs, SameStepVectorEnv), factory
        envs.close()
    envs = make_vector_env(EnvFactory("Acrobot-v1", vector="envpool"), 2)
    assert isinstance(envs, EnvpoolVectorEnv)
    envs.close()


@pytest.mark.parametrize("faster", ["envpool", "python"])
def test_the_trainer_settles_auto_by_timing_an_actors_loop_before_actors_start(
    tmp_path, monkeypatch, caplog, faster
):
    timed = []

    def rate(factory, num_envs, model, unroll_length, seconds):
        timed.append((factory.vector, num_envs, unroll_length))
        return 2.0 if factory.vector == faster else 1.0

    monkeypatch.setattr(startup, "actor_loop_rate", rate)
    caplog.set_level(logging.INFO, logger="impala_rl.envs.factory")
    overrides = ["env.vector=auto", "algorithm.envs_per_actor=6", "algorithm.n_rollout_steps=7"]
    impala_rl.train(
        "cartpole",
        ["log.console=false", "log.tensorboard=false", *overrides, "max_env_steps=500"],
        run_dir=tmp_path,
    )
    assert sorted(timed) == [("envpool", 6, 7)] * 2 + [("python", 6, 7)] * 2
    assert f"using {faster}" in caplog.text


def test_an_actor_loops_rate_is_timed_on_a_copy_of_the_model():
    factory = EnvFactory("CartPole-v1")
    probe = factory()
    model = ActorCritic(probe.observation_space, probe.action_space)
    probe.close()
    model.train()
    before = [p.clone() for p in model.parameters()]
    assert actor_loop_rate(factory, 4, model, 8, 0.05) > 100
    assert model.training  # the loop puts its own copy in eval mode
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_envpool_refusals_name_the_setting():
    with pytest.raises(ConfigError, match=r"'env.vector'.*auto \| python \| envpool"):
        load_config("cartpole", ["env.vector=cpp"])
    cfg = load_config("cartpole", ["env.vector=envpool", "env.id=LunarLander-v3"])
    with pytest.raises(EnvError, match="env.vector=envpool does not support env.id"):
        make_env_factory(cfg.env)


def test_actor_loop_on_envpool_bootstraps_truncation_from_the_final_observation():
    factory = EnvFactory("CartPole-v1", max_episode_steps=10, vector="envpool")
    probe = factory()
    torch.manual_seed(0)
    model = ActorCritic(probe.observation_space, probe.action_space)
    probe.close()
    loop = ActorLoop(factory, 3, model, seed=5, unroll_length=25)
    try:
        assert isinstance(loop.envs, EnvpoolVectorEnv)
        slot = rollout_spec_for(model, probe.observation_space, 25, 3).allocate()
        loop.unroll(slot)
    finally:
        loop.close()
    trunc = slot["truncated"]
    assert trunc.any(), "10-step episodes must be cut within 25 steps"
    t, i = (int(v) for v in np.argwhere(trunc.numpy())[0])
    assert slot["first"][t + 1, i]
    assert slot["truncation_value"][t, i] != 0  # V(final obs), not the next episode's
