"""Image observations: the encoders, the uint8 path, and a short Pong run."""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

import impala_rl
from impala_rl.config import ConfigError, load_config
from impala_rl.nn import ActorCritic
from impala_rl.nn.encoders import ImpalaResNet, MLPEncoder, NatureCNN, make_encoder
from impala_rl.plot import load_metrics
from impala_rl.rollout import ActorLoop, rollout_spec_for

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

from impala_rl.envs import EnvError, EnvFactory, make_vector_env  # noqa: E402

ATARI = "impala_rl.envs.atari:make_atari_env"


@pytest.mark.parametrize(
    ("cls", "features"), [(NatureCNN, 512), (ImpalaResNet, 256)], ids=["nature", "resnet"]
)
def test_image_encoders_map_uint8_frames_to_features(cls, features):
    encoder = cls((4, 84, 84))
    assert encoder.out_features == features
    frames = torch.randint(0, 256, (3, 5, 4, 84, 84), dtype=torch.uint8)
    out = encoder(frames)
    assert out.shape == (3, 5, features)
    # uint8 frames are scaled to [0, 1] inside: the same frames as floats in [0, 1] match
    torch.testing.assert_close(encoder(frames.float() / 255.0), out)


def test_impala_resnet_has_the_papers_stages():
    encoder = ImpalaResNet((4, 84, 84))
    convs = [m for m in encoder.stages if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 32, 32]
    pools = [m for m in encoder.stages if isinstance(m, torch.nn.MaxPool2d)]
    assert len(pools) == 3
    blocks = [m for m in encoder.stages if type(m).__name__ == "_ResidualBlock"]
    assert len(blocks) == 6


def test_image_encoders_refuse_vectors_and_unknown_kinds():
    with pytest.raises(ValueError, match=r"image observations \[C, H, W\]"):
        NatureCNN((4,))
    with pytest.raises(ValueError, match="valid: auto, mlp, nature_cnn, impala_resnet"):
        make_encoder("vit", (4, 84, 84))
    assert isinstance(make_encoder("mlp", (4,)), MLPEncoder)


def test_cnn_on_vector_observations_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        impala_rl.train(
            "cartpole", ["model.encoder=nature_cnn", "log.console=false"], run_dir=tmp_path
        )


def test_pong_observations_stay_uint8_into_the_slot():
    factory = EnvFactory(ATARI, {"game": "ALE/Pong-v5"})
    env = factory()
    assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    model = ActorCritic(env.observation_space, env.action_space, encoder="nature_cnn")
    env.close()
    loop = ActorLoop(factory, 2, model, seed=0, unroll_length=5)
    slot = rollout_spec_for(model, env.observation_space, 5, 2).allocate()
    assert slot["obs"].dtype == torch.uint8
    loop.unroll(slot)
    loop.close()
    assert slot["obs"].shape == (6, 2, 4, 84, 84)
    assert slot["obs"].max() > 0  # real frames were written


def test_short_pong_run_completes_with_all_events(tmp_path):
    summary = impala_rl.train(
        "pong",
        [
            "algorithm.n_epochs=1",
            "algorithm.epoch_length=2",
            "algorithm.n_rollout_steps=10",
            "algorithm.num_actors=2",
            "algorithm.envs_per_actor=2",
            "algorithm.actors_batch_size=2",
            "algorithm.rollout_evaluator.n_episodes=1",
            "algorithm.rollout_evaluator.max_episode_steps=20",
            "log.console=false",
            "log.tensorboard=false",
        ],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "n_epochs"
    passes = load_config("pong").algorithm.num_passes  # optimizer steps per batch
    assert summary["updates"] == 2 * passes and summary["env_steps"] == 2 * 2 * 2 * 10
    # One row per epoch, the latest winning: a background evaluation writes it again.
    (row,) = load_metrics(tmp_path)
    assert row["epoch"] == 1
    for name in (
        "policy_loss/0",
        "critic_value_loss/0",
        "policy_entropy/0",
        "time_backprob/percent",
        "estimated_queue_sizes/before",
        "policy_lag/max",
        "eval_return/mean",
    ):
        assert name in row and np.isfinite(row[name]), name
    assert load_config("pong").model.encoder == "nature_cnn"


def _ale_factory(**kwargs) -> EnvFactory:
    return EnvFactory(ATARI, {"game": "ALE/Pong-v5", "vector": "ale", **kwargs})


def test_ale_vector_env_matches_the_python_env_and_autoresets_on_the_same_step():
    python_env = EnvFactory(ATARI, {"game": "ALE/Pong-v5"})()
    # 120 frames = 30 agent steps per episode: every env is cut at step 30
    envs = make_vector_env(_ale_factory(max_episode_frames=120), 3)
    try:
        assert envs.single_observation_space == python_env.observation_space
        assert envs.single_action_space == python_env.action_space
        first, _ = envs.reset(seed=2**32 - 1)  # actor seeds span 32 bits
        again, _ = envs.reset(seed=2**32 - 1)
        assert first.dtype == np.uint8 and first.shape == (3, 4, 84, 84)
        np.testing.assert_array_equal(first, again)  # seeded
        ended = None
        for step in range(1, 40):
            obs, reward, term, trunc, info = envs.step(np.zeros(3, dtype=np.int64))
            if (term | trunc).any():
                ended = step
                break
        assert ended is not None and ended <= 31, "the frame limit did not end the episodes"
        done = np.flatnonzero(term | trunc)
        # the step that ends an episode returns the next episode's first frame and keeps the
        # final one in info, as SameStepVectorEnv does
        assert info["final_obs"].shape == (3, 4, 84, 84)
        for i in done:
            assert not np.array_equal(info["final_obs"][i], obs[i])
            assert not obs[i][:3].any()  # a fresh frame stack: the older frames are zero
    finally:
        envs.close()
        python_env.close()


def test_ale_vector_env_in_the_actor_loop_records_cut_episodes():
    factory = _ale_factory(max_episode_frames=120)
    probe = factory()
    cfg = load_config("pong")
    model = ActorCritic(probe.observation_space, probe.action_space, encoder="nature_cnn")
    loop = ActorLoop(factory, 2, model, seed=3, unroll_length=40)
    try:
        assert type(loop.envs).__name__ != "SameStepVectorEnv"
        slot = rollout_spec_for(model, probe.observation_space, 40, 2).allocate()
        result = loop.unroll(slot)
    finally:
        loop.close()
        probe.close()
    cut = slot["truncated"] | slot["terminated"]
    assert cut.any(dim=0).all(), "every env ends an episode within 40 steps"
    t, n = np.argwhere(cut.numpy())[0]
    assert slot["first"][t + 1, n] and len(result.episode_returns) >= 2
    assert slot["obs"].dtype == torch.uint8
    assert cfg.env.kwargs["vector"] == "ale"  # the preset uses it


def test_ale_vector_options_are_checked_by_name():
    with pytest.raises(EnvError, match=r"env.kwargs \['gmae'\] are not Atari settings.*'game'"):
        EnvFactory(ATARI, {"gmae": "ALE/Pong-v5"})()
    with pytest.raises(EnvError, match=r"env.kwargs.vector='envpool'.*valid: python \| ale"):
        EnvFactory(ATARI, {"vector": "envpool"})()
    with pytest.raises(EnvError, match="env.kwargs.vector_threads=0"):
        make_vector_env(_ale_factory(vector_threads=0), 2)
    with pytest.raises(EnvError, match="env.max_episode_steps cannot limit"):
        make_vector_env(
            EnvFactory(ATARI, {"game": "ALE/Pong-v5", "vector": "ale"}, max_episode_steps=10), 2
        )


def test_python_and_ale_vector_paths_give_the_same_frames_rewards_and_dones():
    # sticky actions and noop starts off, the only randomness: the same actions must give the
    # same stacks (zero padding at a reset included), rewards, dones and final frames
    settings = {"game": "ALE/Pong-v5", "repeat_action_probability": 0.0, "noop_max": 0}
    python = make_vector_env(EnvFactory(ATARI, {**settings, "vector": "python"}), 1)
    ale = make_vector_env(EnvFactory(ATARI, {**settings, "vector": "ale"}), 1)
    try:
        assert type(python).__name__ == "SameStepVectorEnv" and type(ale) is not type(python)
        obs_p, _ = python.reset(seed=7)
        obs_a, _ = ale.reset(seed=7)
        np.testing.assert_array_equal(obs_p, obs_a)
        assert not obs_p[0, :3].any() and obs_p[0, 3].any()  # zero-padded, newest frame last
        rng = np.random.default_rng(0)
        rewards, ends = [], []
        for t in range(1000):
            actions = rng.integers(0, 6, size=1)
            obs_p, r_p, term_p, trunc_p, info_p = python.step(actions)
            obs_a, r_a, term_a, trunc_a, info_a = ale.step(actions)
            np.testing.assert_array_equal(obs_p, obs_a, err_msg=f"step {t}")
            assert r_p[0] == r_a[0] and term_p[0] == term_a[0] and trunc_p[0] == trunc_a[0], t
            rewards.append(r_p[0])
            if term_p[0]:
                ends.append(t)
                np.testing.assert_array_equal(info_p["final_obs"][0], info_a["final_obs"][0])
        # a random policy loses one game of Pong within the 1000 steps: the opponent's 21st
        # point is the reward of the terminal step itself, not of the next episode's first
        assert len(ends) == 1 and rewards[ends[0]] == -1.0
        assert rewards[: ends[0] + 1].count(-1.0) == 21
    finally:
        python.close()
        ale.close()


def test_actor_loop_attaches_each_reward_and_done_to_the_action_that_caused_it():
    # replay the actions an actor took (ale vector env) in a python env: step t of the slot
    # must hold the frame the action was chosen on, and that action's reward and episode end
    settings = {
        "game": "ALE/Pong-v5",
        "repeat_action_probability": 0.0,
        "noop_max": 0,
        "max_episode_frames": 600,  # every 150 agent steps an episode is cut
    }
    factory = EnvFactory(ATARI, {**settings, "vector": "ale"})
    replay = EnvFactory(ATARI, {**settings, "vector": "python"})()
    model = ActorCritic(replay.observation_space, replay.action_space, encoder="nature_cnn")
    T = 240
    loop = ActorLoop(factory, 1, model, seed=3, unroll_length=T)
    try:
        slot = rollout_spec_for(model, replay.observation_space, T, 1).allocate()
        result = loop.unroll(slot)
        obs, _ = replay.reset(seed=3)
        ends = []
        for t in range(T):
            np.testing.assert_array_equal(slot["obs"][t, 0].numpy(), obs, err_msg=f"step {t}")
            obs, reward, term, trunc, _ = replay.step(int(slot["action"][t, 0]))
            assert float(slot["reward"][t, 0]) == reward, t
            assert bool(slot["terminated"][t, 0]) == term, t
            assert bool(slot["truncated"][t, 0]) == (trunc and not term), t
            assert bool(slot["first"][t + 1, 0]) == (term or trunc), t
            if term or trunc:
                ends.append(t)
                obs, _ = replay.reset()
        assert ends == [149]
        assert (slot["reward"] != 0).sum() >= 2, "a random policy concedes points in 150 steps"
        assert result.episode_returns == [float(slot["reward"][:150, 0].sum())]
    finally:
        loop.close()
        replay.close()


def test_ale_ids_are_registered_on_demand_with_the_atari_preprocessing(caplog):
    from impala_rl.envs import make_env_factory

    # a fresh process, where nothing has imported ale_py: the id alone must be enough
    code = "from impala_rl.envs import EnvFactory; print(EnvFactory('ALE/Pong-v5')().spec.id)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["ALE/Pong-v5"]
    cfg = load_config("cartpole", ["env.id=ALE/Pong-v5", "env.kwargs.noop_max=0"])
    with caplog.at_level("WARNING"):
        factory = make_env_factory(cfg.env)
    assert "impala train atari" not in caplog.text  # it runs as typed, no other command
    env = factory()
    reference = EnvFactory(ATARI, {"game": "ALE/Pong-v5", "noop_max": 0})()
    try:
        assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        assert env.action_space == reference.action_space
        obs, _ = env.reset(seed=5)
        ref, _ = reference.reset(seed=5)
        np.testing.assert_array_equal(obs, ref)
    finally:
        env.close()
        reference.close()
    with pytest.raises(EnvError, match="give the game once"):
        EnvFactory("ALE/Pong-v5", {"game": "ALE/Breakout-v5"})()
    envs = make_vector_env(EnvFactory("ALE/Pong-v5", {"vector": "ale"}), 2)
    try:
        assert type(envs).__name__ != "SameStepVectorEnv"
        assert envs.reset(seed=0)[0].shape == (2, 4, 84, 84)
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("env_id", "sticky", "rom"),
    [
        ("PongNoFrameskip-v4", 0.0, "pong"),
        ("SpaceInvaders-v4", 0.0, "space_invaders"),
        ("Breakout-v0", 0.25, "breakout"),
        ("ALE/Pong-v5", 0.25, "pong"),
    ],
)
def test_legacy_ale_ids_get_the_preprocessing_and_their_own_sticky_actions(env_id, sticky, rom):
    """``PongNoFrameskip-v4`` as older tutorials type it: ale-py registers it on demand and it
    runs as ``ALE/Pong-v5`` does, with its own sticky actions (v4: none) in both the python
    and the ale vector paths."""
    from impala_rl.envs.atari import AtariSettings, ale_rom_id, is_ale_id, sticky_actions

    assert is_ale_id(env_id)
    assert ale_rom_id(env_id) == rom
    assert sticky_actions(AtariSettings(game=env_id)) == sticky
    assert sticky_actions(AtariSettings(game=env_id, repeat_action_probability=0.1)) == 0.1
    env = EnvFactory(env_id)()
    try:
        assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(sticky)
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84)
    finally:
        env.close()
    envs = make_vector_env(EnvFactory(env_id, {"vector": "ale"}), 2)
    try:
        assert envs.reset(seed=0)[0].shape == (2, 4, 84, 84)
    finally:
        envs.close()


def test_ids_that_only_look_legacy_are_not_ale_games():
    from impala_rl.envs.atari import is_ale_id

    for env_id in ("CartPole-v0", "Taxi-v4", "MountainCar-v0", "NoSuchGame-v4", "Pong-v5"):
        assert not is_ale_id(env_id), env_id


@pytest.mark.parametrize("env_id", ["Breakout-v5", "Pong-ram-v5"])
def test_a_v5_game_typed_without_its_namespace_names_the_id_to_type(env_id):
    """In a fresh process too, where nothing has registered ale-py's ids yet."""
    code = (
        "from impala_rl.envs import EnvError, EnvFactory\n"
        f"try:\n    EnvFactory({env_id!r})()\nexcept EnvError as e:\n    print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert f"Did you mean ALE/{env_id}?" in out.stdout
    with pytest.raises(EnvError, match=rf"Did you mean ALE/{env_id}\?"):
        EnvFactory(env_id)()


@pytest.mark.parametrize(
    ("env_id", "kwargs", "game"),
    [
        ("ALE/Pong-ram-v5", {}, "ALE/Pong-v5"),
        ("Pong-ramNoFrameskip-v4", {}, "PongNoFrameskip-v4"),
        ("Breakout-ram-v4", {}, "Breakout-v4"),
        ("ALE/Pong-v5", {"obs_type": "ram"}, "ALE/Pong-v5"),
    ],
)
def test_ram_observations_are_the_consoles_bytes_stacked(env_id, kwargs, game):
    """Gym's RAM ids (ale-py no longer registers them) and ``obs_type=ram`` on a game's id: the
    128 bytes of RAM after each skipped step, ``frame_stack`` of them in one vector, the newest
    last (uint8 from the env, floats to the model); the game's own sticky actions."""
    from impala_rl.envs.atari import (
        AtariSettings,
        is_ale_id,
        make_atari_env,
        split_ram_id,
        sticky_actions,
    )

    assert is_ale_id(env_id)
    assert split_ram_id(env_id) == (game, "-ram" in env_id)
    settings = AtariSettings.from_kwargs({"game": env_id, **kwargs})
    assert (settings.game, settings.obs_type) == (game, "ram")
    raw = make_atari_env(game=env_id, **kwargs)
    try:
        assert raw.observation_space == gym.spaces.Box(0, 255, (4 * 128,), np.uint8)
    finally:
        raw.close()
    env = EnvFactory(env_id, kwargs)()
    try:
        assert env.observation_space.shape == (4 * 128,)
        sticky = env.unwrapped.ale.getFloat("repeat_action_probability")
        assert sticky == pytest.approx(sticky_actions(settings))
        obs, _ = env.reset(seed=3)
        first = obs.reshape(4, 128)
        assert not first[:3].any() and first[3].any()  # zero padding before the first state
        obs, *_ = env.step(0)
        assert np.array_equal(obs.reshape(4, 128)[2], first[3])  # shifted by one
        np.testing.assert_array_equal(obs.reshape(4, 128)[3], env.unwrapped.ale.getRAM())
    finally:
        env.close()


def test_ram_no_op_starts_are_seeded_and_vary():
    """Up to ``noop_max`` no-ops after a reset, drawn from the seeded generator: one seed gives
    one start, and the seeds give more than one."""

    def start_frame(seed: int) -> int:
        env = EnvFactory("ALE/Breakout-v5", {"obs_type": "ram", "repeat_action_probability": 0})()
        try:
            env.reset(seed=seed)
            return env.unwrapped.ale.getEpisodeFrameNumber()
        finally:
            env.close()

    assert start_frame(0) == start_frame(0)
    assert len({start_frame(seed) for seed in range(6)}) > 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"game": "ALE/Pong-ram-v5", "obs_type": "rgb"}, "give the game's own id"),
        ({"game": "ALE/Pong-v5", "obs_type": "grayscale"}, "obs_type='grayscale' is not valid"),
        ({"game": "ALE/Pong-v5", "obs_type": "ram", "vector": "ale"}, "vector=ale steps screens"),
        (
            {"game": "ALE/Pong-v5", "obs_type": "ram", "terminal_on_life_loss": True},
            "terminal_on_life_loss=true",
        ),
    ],
)
def test_ram_settings_that_cannot_hold_are_refused_by_name(kwargs, message):
    from impala_rl.envs.atari import AtariSettings

    with pytest.raises(EnvError, match=message):
        AtariSettings.from_kwargs(kwargs)


def test_a_ram_id_trains_on_the_any_env_preset_with_an_mlp(tmp_path, caplog):
    """A game's RAM is a vector: ``env.id`` chooses ``any_env`` (an MLP over normalized
    bytes), not the ALE preset's CNN, says so, and a short run trains and evaluates."""
    from impala_rl.env_defaults import GENERIC_PRESET, resolve_config
    from impala_rl.trainer import Trainer

    with caplog.at_level("INFO"):
        cfg = resolve_config(None, ["env.id=ALE/Breakout-ram-v5", "max_env_steps=2048"])
    assert "an ALE game's RAM, vectors: the any_env preset" in caplog.text
    assert "4 states of its 128 bytes of RAM stacked" in caplog.text
    generic = load_config(GENERIC_PRESET)
    assert cfg.model.normalize_obs and cfg.model.encoder == generic.model.encoder
    assert cfg.algorithm.num_passes == generic.algorithm.num_passes
    same = resolve_config(None, ["env.id=ALE/Breakout-v5", "env.kwargs.obs_type=ram"])
    assert same.algorithm.num_passes == generic.algorithm.num_passes
    summary = Trainer(cfg, run_dir=tmp_path).train()
    assert summary["env_steps"] >= 2048 and summary["best_eval_return"] is not None


@pytest.mark.parametrize(
    ("preset", "overrides", "encoder", "id_form"),
    [
        ("atari", ["env.kwargs.obs_type=ram"], "impala_resnet", "env.id=ALE/Breakout-v5 "),
        ("pong", ["env.kwargs.obs_type=ram"], "nature_cnn", "env.id=ALE/Pong-v5 "),
        ("pong_appo", ["env.kwargs.game=ALE/Pong-ram-v5"], "nature_cnn", "env.id=ALE/Pong-v5 "),
    ],
)
def test_an_atari_presets_cnn_on_a_games_ram_is_refused_before_the_env_is_built(
    monkeypatch, preset, overrides, encoder, id_form
):
    """The Atari presets' CNNs read screens: on the RAM the config is refused by the encoder's
    name, pointing to the id form (a vector env's settings), before any env is built; an
    encoder for vectors is let through."""
    from impala_rl.env_defaults import resolve_config
    from impala_rl.envs import factory

    def built(*args, **kwargs):
        raise AssertionError("an env was built before the config was refused")

    monkeypatch.setattr(factory.EnvFactory, "__call__", built)
    with pytest.raises(ConfigError, match="'model.encoder'") as refused:
        resolve_config(preset, overrides)
    assert repr(encoder) in str(refused.value) and id_form in str(refused.value)
    cfg = resolve_config(preset, [*overrides, "model.encoder=auto"])
    assert cfg.model.encoder == "auto"
