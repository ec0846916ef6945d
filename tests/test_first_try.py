"""A user's first run on their own env: six findings of a review, each fixed with a test that
failed before its fix (sizing and the user's keys, Dict entry names, channels-last images
everywhere, one observation told from a batch, a vector env that resets on the next step)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import impala_rl
from impala_rl import sizing
from impala_rl.config import ModelConfig, load_config
from impala_rl.env_defaults import IMAGE_REUSE, describe_spaces, resolve_config
from impala_rl.envs import EnvFactory
from impala_rl.envs.spaces import ObservationConverter
from impala_rl.nn.actor_critic import ActorCritic
from impala_rl.nn.encoders import MinAtarCNN, MLPEncoder, NatureCNN
from impala_rl.nn.factory import build_model, build_model_for_env
from impala_rl.policy import load_policy
from impala_rl.sizing import Machine

GPU_BOX = Machine(16, "NVIDIA H100 80GB HBM3")
FAST = [
    "log.console=false",
    "log.tensorboard=false",
    "runner.backend=sequential",
    "target_return=null",
    "algorithm.rollout_evaluator.background=false",
]


# -- 1. sizing sets only what fits the user's own settings ------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [["runner.inference=actor"], ["algorithm.num_learners=2", "algorithm.num_actors=2"]],
    ids=["actor-inference", "two-learners-two-actors"],
)
def test_sizing_a_gpu_box_sets_no_inference_servers_the_users_settings_cannot_take(
    overrides, monkeypatch
):
    monkeypatch.setattr(sizing, "detect_machine", lambda: GPU_BOX)
    cfg = resolve_config("pong_appo", overrides)  # before: refused, naming inference_servers
    a, r = cfg.algorithm, cfg.runner
    assert r.inference_servers <= a.num_actors // a.num_learners
    if r.inference == "actor":
        assert r.inference_servers == 1


# -- 2. a config file's settings are the user's ------------------------------------------------
def test_sizing_keeps_what_a_users_config_file_sets(tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "detect_machine", lambda: GPU_BOX)
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: pong_appo\nalgorithm:\n  num_actors: 3\n")
    cfg = resolve_config(str(mine), [])
    assert cfg.algorithm.num_actors == 3  # before: 16, the cores of the box
    assert cfg.algorithm.device == "cuda"  # what the file leaves open is sized
    # a file of the user's on top of another of theirs counts too
    top = tmp_path / "top.yaml"
    top.write_text(f"base: {mine}\nalgorithm:\n  lr: 1.0e-4\n")
    assert resolve_config(str(top), []).algorithm.num_actors == 3


def test_a_folder_named_as_a_preset_does_not_shadow_the_preset(tmp_path, monkeypatch):
    (tmp_path / "cartpole").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_config("cartpole").env.id == "CartPole-v1"


# -- 3. any Dict entry name ---------------------------------------------------------------------
class OddNames(gym.Env):
    """A Dict observation whose entry names are a module's attributes or hold a dot."""

    def __init__(self):
        box = spaces.Box(-1.0, 1.0, (3,), np.float32)
        names = ["type", "values", "keys", "train", "agent.pos"]
        self.observation_space = spaces.Dict({n: box for n in names})
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), float(action), self.t >= 8, False, {}


def test_any_dict_entry_name_builds_trains_and_loads(tmp_path):
    overrides = [*FAST, "env.id=test_first_try:OddNames", "max_env_steps=512"]
    cfg = load_config("cartpole", [*overrides, "model.normalize_obs=true"])
    model = build_model_for_env(cfg.model, EnvFactory(cfg.env.id)())  # before: KeyError
    obs = {k: torch.zeros(4, 3) for k in OddNames().observation_space.spaces}
    assert model.policy_value(0, obs)[1].shape == (4,)
    impala_rl.train("cartpole", [*overrides, "model.normalize_obs=true"], run_dir=tmp_path)
    policy = load_policy(tmp_path, which="last")
    assert policy.act(OddNames().observation_space.sample()) in (0, 1)


# -- 4. every uint8 image reaches the model channels first ---------------------------------------
class Frames(gym.Env):
    """Channels-last frames ``[7, 7, 3]``: the red channel's top-left pixel says the action
    that pays (MiniGrid's ``ImgObsWrapper`` observes this shape)."""

    def __init__(self, dict_obs: bool = False):
        frame = spaces.Box(0, 255, (7, 7, 3), np.uint8)
        self.dict_obs = dict_obs
        self.observation_space = spaces.Dict({"image": frame}) if dict_obs else frame
        self.action_space = spaces.Discrete(2)

    def _obs(self):
        self.answer = int(self.np_random.integers(2))
        frame = np.zeros((7, 7, 3), np.uint8)
        frame[0, 0, 0] = 255 * self.answer
        return {"image": frame} if self.dict_obs else frame

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.answer)
        return self._obs(), reward, True, False, {}


@pytest.mark.parametrize("dict_obs", [False, True], ids=["plain", "dict"])
def test_a_channels_last_image_reaches_the_model_channels_first(dict_obs):
    convert = ObservationConverter(Frames(dict_obs).observation_space)
    space = convert.space["image"] if dict_obs else convert.space
    assert space.shape == (3, 7, 7) and space.dtype == np.uint8  # before: (7, 7, 3) plain
    env = Frames(dict_obs)
    raw, _ = env.reset(seed=0)
    image = convert(raw)["image"] if dict_obs else convert(raw)
    frame = raw["image"] if dict_obs else raw
    assert np.array_equal(image, np.moveaxis(frame, -1, 0))


def test_frames_stacked_by_one_setting_become_channels():
    factory = EnvFactory("impala_rl.envs.samples:Catch", frame_stack=3)
    env = factory()
    assert env.observation_space.shape == (9, 40, 40)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (9, 40, 40) and obs.dtype == np.uint8
    obs, *_ = env.step(1)
    assert not np.array_equal(obs[3:6], obs[6:9])  # the last two frames differ: motion
    env.close()


def test_the_grid_encoder_reads_a_plain_channels_last_grid_as_cells(tmp_path):
    """MiniGrid's ``ImgObsWrapper``-like ``[7, 7, 3]`` frames under ``GridEncoder``: it reads 3
    code channels of 7 x 7 cells and learns which action pays (before: 7 channels of 7 x 3)."""
    overrides = [
        *FAST,
        "env.id=test_first_try:Frames",
        "model.encoder=impala_rl.nn.grid:GridEncoder",
        "model.shared_torso=true",
        "max_env_steps=3072",
    ]
    cfg = load_config("cartpole", overrides)
    model = build_model_for_env(cfg.model, EnvFactory(cfg.env.id)())
    grid = model.policies["0"].torso.module
    assert grid.offsets.shape[1] == 3  # three code channels
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_eval_return"] >= 0.9


def test_a_structured_keys_channels_last_image_reaches_the_model_channels_first():
    from impala_rl.envs.structured import KeyObservation

    frame = spaces.Box(0, 255, (7, 7, 3), np.uint8)
    key = KeyObservation(spaces.Dict({"image": frame, "action_mask": spaces.MultiBinary(2)}), 0)
    assert key.space.shape == (3, 7, 7)


def test_the_default_encoder_reads_an_image_with_the_cnn_that_fits_it():
    """``model.encoder=auto`` (the default): the Nature CNN from 36 pixels a side, the MinAtar
    CNN below, an MLP for vectors, under every step key and for the value torso too;
    ``normalize_obs`` normalizes the vectors and leaves an image to its CNN. ``mlp`` keeps the
    MLP over the pixels that a run saved before ``auto`` trained."""
    big = spaces.Box(0, 255, (3, 96, 96), np.uint8)
    small = spaces.Box(0, 255, (4, 10, 10), np.uint8)
    vector = spaces.Box(-1, 1, (5,), np.float32)
    act = spaces.Discrete(3)

    def torso(model, key=0):
        return model.policies[str(key)].torso

    assert ModelConfig().encoder == "auto"
    assert isinstance(torso(build_model(ModelConfig(), big, act)), NatureCNN)
    assert isinstance(torso(build_model(ModelConfig(), small, act)), MinAtarCNN)
    assert isinstance(torso(build_model(ModelConfig(), vector, act)), MLPEncoder)
    assert isinstance(torso(build_model(ModelConfig(encoder="mlp"), big, act)), MLPEncoder)
    keyed = ActorCritic({0: small, 1: vector}, {0: act, 1: act}, normalize_obs=True)
    assert isinstance(torso(keyed, 0), MinAtarCNN) and isinstance(torso(keyed, 1), MLPEncoder)
    assert isinstance(keyed.critics["0"].torso, MinAtarCNN)  # a value torso of its own
    assert keyed.observation_normalizer(0) is None
    assert keyed.observation_normalizer(1) is not None
    frames = torch.randint(0, 256, (2, 4, 10, 10), dtype=torch.uint8)
    dist, value = keyed.policy_value(0, frames)
    assert value.shape == (2,) and dist.sample().shape == (2,)


def test_the_default_encoder_reads_an_image_too_small_for_a_convolution_with_an_mlp():
    """A ``uint8 [C, H, W]`` Box with a side under 3 pixels fits no built-in CNN (the MinAtar
    CNN's 3x3 convolution would refuse it): ``auto`` flattens it into an MLP, plain and in a
    Dict, the model runs, and it is read as a vector (normalized, no CNN settings)."""
    tiny = spaces.Box(0, 255, (3, 2, 5), np.uint8)
    act = spaces.Discrete(3)
    model = build_model(ModelConfig(), tiny, act)
    assert isinstance(model.policies["0"].torso, MLPEncoder)
    frames = torch.randint(0, 256, (4, 3, 2, 5), dtype=torch.uint8)
    dist, value = model.policy_value(0, frames)
    assert value.shape == (4,) and dist.sample().shape == (4,)
    both = spaces.Dict({"tiny": tiny, "pos": spaces.Box(-1, 1, (2,), np.float32)})
    model = build_model(ModelConfig(), both, act)
    dist, value = model.policy_value(0, {"tiny": frames, "pos": torch.zeros(4, 2)})
    assert value.shape == (4,)
    # its MLP reads raw values: normalize_obs normalizes them, as a vector's, and the env
    # gets no CNN settings (PPO's Atari reuse, a shared torso)
    assert ActorCritic({0: tiny}, {0: act}, normalize_obs=True).observation_normalizer(0)
    env = SimpleNamespace(observation_space=tiny, action_space=act)
    assert describe_spaces(env) == ("discrete actions, vector observations", {})


def test_a_preset_that_names_no_encoder_learns_a_channels_last_image_with_a_cnn(tmp_path):
    """``Frames`` (``[7, 7, 3]``, channels last) under the ``cartpole`` preset, which names no
    encoder: the model reads ``[3, 7, 7]`` with the MinAtar CNN and learns which action pays."""
    overrides = [*FAST, "env.id=test_first_try:Frames", "max_env_steps=3072"]
    cfg = load_config("cartpole", overrides)
    model = build_model_for_env(cfg.model, EnvFactory(cfg.env.id)())
    assert isinstance(model.policies["0"].torso, MinAtarCNN)
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_eval_return"] >= 0.9


def test_a_family_preset_that_names_no_encoder_gives_an_image_env_a_cnn(caplog):
    """``env.id=CarRacing-v3`` runs the ``box2d`` preset (tuned on vectors): its 96x96 frames
    get the Nature CNN with one torso, PPO's Atari reuse, and no normalization (the CNN scales
    them), said on the console; a vector env of the family keeps the preset's network."""
    with caplog.at_level(logging.INFO, logger="impala_rl.env_defaults"):
        cfg = resolve_config(None, ["env.id=CarRacing-v3"])
    m = cfg.model
    assert (m.encoder, m.shared_torso, m.normalize_obs) == ("nature_cnn", True, False)
    assert (cfg.algorithm.num_passes, cfg.algorithm.num_minibatches) == IMAGE_REUSE
    assert "the box2d preset" in caplog.text and "nature_cnn encoder" in caplog.text
    env = EnvFactory.of(cfg.env)()
    assert isinstance(build_model_for_env(m, env).policies["0"].torso, NatureCNN)
    env.close()
    lunar = resolve_config(None, ["env.id=LunarLander-v3"])
    assert lunar.model == load_config("box2d").model


# -- 5. one observation of a float32 Box given as float64 ----------------------------------------
class Plane(gym.Env):
    """A ``float32 [2, 3]`` observation (the model reads it flattened, ``[6]``)."""

    observation_space = spaces.Box(-1.0, 1.0, (2, 3), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), float(action), self.t >= 8, False, {}


def test_policy_act_takes_a_float64_observation_of_a_float32_box_as_one(tmp_path):
    overrides = [*FAST, "env.id=test_first_try:Plane", "max_env_steps=512"]
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    policy = load_policy(tmp_path, which="last")
    obs = np.full((2, 3), 0.25, dtype=np.float64)  # as hand-written envs often return
    action = policy.act(obs)  # before: read as a batch of 2 rows of 3, a shape error
    assert np.ndim(action) == 0 and int(action) in (0, 1)
    assert np.shape(policy.act(np.stack([obs, -obs]))) == (2,)  # a batch of two
    assert np.shape(policy.act(np.zeros((3, 6), np.float32))) == (3,)  # the model's form
    with pytest.raises(ValueError, match=r"one observation of Box.*or a batch"):
        policy.act(np.zeros((2, 4)))


# -- 6. a native vector env that resets on the next step ----------------------------------------
class TenSteps(gym.Env):
    """Every episode is 10 steps long."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t / 10, np.float32), 1.0, self.t >= 10, False, {}


def ten_steps() -> gym.Env:
    return TenSteps()


def _gymnasium_vector(num_envs: int) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([TenSteps] * num_envs)  # resets on the next step


ten_steps.make_vector = _gymnasium_vector  # type: ignore[attr-defined]


def test_a_native_vector_env_that_resets_on_the_next_step_records_whole_episodes(tmp_path):
    overrides = [*FAST, "env.id=test_first_try:ten_steps", "max_env_steps=2048"]
    overrides += ["algorithm.epoch_length=2"]
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    lengths = [
        json.loads(line)["episode_length/mean"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "episode_length/mean" in json.loads(line)
    ]
    assert lengths and all(length == 10 for length in lengths)  # before: 10.94
