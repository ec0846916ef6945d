"""Dict observations keep their structure: an encoder per entry (a CNN for an image, a one-hot
for a Discrete entry, an MLP for a vector and the embedded words of a ``Text``), an entry
that is neither numbers nor text left out with one line that says so, and the slot storing
each entry in its own dtype, on every backend and in ``load_policy``.

The env is ``tests/dict_envs.py`` (MiniGrid's observation in small).
"""

from __future__ import annotations

import logging

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import dict_envs
import impala_rl
from impala_rl.actors import SequentialDistributedActors
from impala_rl.config import ImpalaAlgorithmConfig, steps_per_batch
from impala_rl.envs import EnvFactory, make_env_factory
from impala_rl.envs import spaces as spaces_module
from impala_rl.envs.spaces import (
    ModelObservation,
    TextTokens,
    dict_model_space,
    is_text,
    text_tokens,
)
from impala_rl.learner import Learner
from impala_rl.nn import ActorCritic
from impala_rl.nn.encoders import DictEncoder, MinAtarCNN, MLPEncoder, OneHotEncoder

T, N = 4, 2
FAST = ["log.console=false", "log.tensorboard=false", "target_return=null"]
ENV = ["env.id=dict_envs:make_env", "algorithm.rollout_evaluator.n_episodes=2"]


def test_the_model_space_keeps_each_entry_and_reads_text_as_words():
    space, dropped = dict_model_space(dict_envs.SPACE)
    assert list(space.spaces) == ["direction", "image", "mission", "pos"]
    assert space["image"] == spaces.Box(0, 255, (3, 5, 5), np.uint8)  # channels first
    assert space["direction"] == spaces.Discrete(4)  # an index from 0
    assert space["pos"].shape == (2,) and space["pos"].dtype == np.float32
    assert isinstance(space["mission"], TextTokens) and space["mission"].shape == (32, 2)
    assert dropped == []

    env = ModelObservation(dict_envs.make_env())
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"direction", "image", "mission", "pos"}
    assert obs["image"].shape == (3, 5, 5) and obs["image"].dtype == np.uint8
    assert obs["direction"].dtype == np.int64 and 0 <= int(obs["direction"]) < 4
    assert obs["image"][0, 0, 0] == (int(obs["direction"]) + 1) * 60
    assert np.array_equal(obs["mission"], text_tokens("go right"))  # "go right": two words
    assert obs["mission"].dtype == np.int16 and env.observation_space["mission"].contains(
        obs["mission"]
    )


def test_a_text_is_its_words_in_order_two_ids_each():
    ids = text_tokens("Go to the RED ball, then the red key.")
    words = ["go", "to", "the", "red", "ball", "then", "the", "red", "key"]
    assert (ids[: len(words)] > 0).all() and (ids[len(words) :] == 0).all()
    assert np.array_equal(ids[3], ids[7]) and np.array_equal(ids[2], ids[6])  # same word
    assert np.array_equal(ids[0], text_tokens("go")[0])  # case and punctuation aside
    assert not np.array_equal(ids[3], ids[4])
    words = [f"w{i}" for i in range(300)]  # a vocabulary larger than BabyAI's
    firsts = {text_tokens(w)[0, 0] for w in words}
    both = {tuple(text_tokens(w)[0]) for w in words}
    assert len(firsts) < 300 and len(both) == 300  # one id is shared; the pair is not
    assert not ids.flags.writeable  # cached: nobody may write into it


def test_a_text_longer_than_the_model_reads_is_cut_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(spaces_module, "_cut_text_warned", False)
    with caplog.at_level("WARNING"):
        long = text_tokens(" ".join(["cut"] * 40))  # words no other test caches
        text_tokens(" ".join(["cuts"] * 41))  # another long text: no second line
        text_tokens("a short one")
    assert (long > 0).all() and long.shape == (32, 2)  # the first 32 words
    assert np.array_equal(long, text_tokens(" ".join(["cut"] * 32)))
    lines = [r.getMessage() for r in caplog.records if "words" in r.getMessage()]
    assert lines == [
        "an observation's text has 40 words; the model reads its first 32 (the rest is cut)"
    ]


def test_a_space_that_samples_strings_is_text_and_one_that_is_neither_is_left_out():
    class Mission(spaces.Space):  # as MiniGrid's MissionSpace: strings, not numbers
        def sample(self, *args, **kwargs):
            return "pick up the key"

    class Handle(spaces.Space):  # an opaque object
        def sample(self, *args, **kwargs):
            return object()

    assert is_text(Mission()) and is_text(spaces.Text(5))
    assert not is_text(Handle()) and not is_text(spaces.Discrete(3))
    space, dropped = dict_model_space(
        spaces.Dict({"mission": Mission(), "handle": Handle(), "pos": dict_envs.SPACE["pos"]})
    )
    assert list(space.spaces) == ["mission", "pos"]
    assert dropped == ["'handle' (Handle)"]


def test_building_the_env_says_in_one_line_which_entries_are_left_out(caplog):
    cfg = impala_rl.config.load_config("cartpole", ["env.id=dict_envs:make_handle_env"])
    with caplog.at_level(logging.WARNING):
        factory = make_env_factory(cfg.env)
    lines = [r.getMessage() for r in caplog.records if "handle" in r.getMessage()]
    assert len(lines) == 1 and "neither numbers of a fixed size nor text" in lines[0]
    assert not any("mission" in r.getMessage() for r in caplog.records)
    assert set(factory().observation_space.spaces) == {"direction", "image", "mission", "pos"}


def test_the_policy_reads_the_mission_and_a_model_saved_before_does_not():
    env = EnvFactory("dict_envs:make_env")()
    model = ActorCritic(env.observation_space, env.action_space, hidden_sizes=(8,))
    torso = model.policies["0"].torso
    assert isinstance(torso.entry("mission"), MLPEncoder)  # the joint MLP, after the embedding
    assert torso.out_features == 128 + 4 + 8
    obs = {**_dict_batch(), "mission": torch.as_tensor(np.stack([text_tokens("go left")] * 3))}
    other = {**obs, "mission": torch.as_tensor(np.stack([text_tokens("go right")] * 3))}
    assert not torch.equal(model.policy(0, obs).logits, model.policy(0, other).logits)

    earlier = ActorCritic(env.observation_space, env.action_space, read_text=False)
    assert earlier.policies["0"].torso.names == ["direction", "image", "pos"]
    assert earlier.critics["0"].torso.names == ["direction", "image", "pos"]
    assert torch.equal(earlier.policy(0, obs).logits, earlier.policy(0, other).logits)


def test_an_encoder_per_entry_features_concatenated():
    env = EnvFactory("dict_envs:make_env")()
    model = ActorCritic(env.observation_space, env.action_space, hidden_sizes=(8,))
    torso = model.policies["0"].torso
    assert isinstance(torso, DictEncoder)
    assert isinstance(torso.entry("image"), MinAtarCNN)  # 5x5: the small-image CNN
    assert isinstance(torso.entry("direction"), OneHotEncoder)
    assert isinstance(torso.entry("pos"), MLPEncoder)
    assert torso.out_features == 128 + 4 + 8
    obs = {
        "image": torch.zeros(3, 5, 3, 5, 5, dtype=torch.uint8),
        "direction": torch.zeros(3, 5, dtype=torch.int64),
        "pos": torch.zeros(3, 5, 2),
        "mission": torch.zeros(3, 5, 32, 2, dtype=torch.int16),
    }
    dist, values = model.policy_value(0, obs)
    assert values.shape == (3, 5) and dist.sample().shape == (3, 5)
    with pytest.raises(ValueError, match="'pos'"):
        model.policy_value(0, {**obs, "pos": torch.zeros(3, 5, 3)})


def test_the_slot_stores_each_entry_in_its_own_dtype_and_the_learner_trains_on_it():
    factory = EnvFactory("dict_envs:make_env", {"length": 3})
    probe = factory()
    torch.manual_seed(0)
    model = ActorCritic(probe.observation_space, probe.action_space, hidden_sizes=(8,))
    probe.close()
    cfg = ImpalaAlgorithmConfig(
        n_rollout_steps=T, envs_per_actor=N, num_actors=2, actors_batch_size=2
    )
    learner = Learner(model, cfg)
    with SequentialDistributedActors(factory, model, cfg, seed=0) as actors:
        batch = actors.collect_outputs("cpu").batch
        assert "obs" not in batch
        assert batch["obs.image"].dtype == torch.uint8
        assert batch["obs.image"].shape == (T + 1, 2 * N, 3, 5, 5)
        assert batch["obs.direction"].dtype == torch.int64
        assert batch["obs.direction"].shape == (T + 1, 2 * N)
        assert batch["obs.pos"].dtype == torch.float32
        # the image's pixel and the Discrete entry come from the same observation
        pixel = batch["obs.image"][:, :, 0, 0, 0].long()
        assert torch.equal(pixel, (batch["obs.direction"] + 1) * 60)
        stats = learner.update(batch)
    assert np.isfinite(stats.total_loss)


def test_a_dict_env_trains_with_a_core_evaluates_and_its_policy_acts_on_raw_observations(
    tmp_path,
):
    """Sequential actors, an LSTM core with last inputs, truncation (the final observation's
    value from each entry), evaluation, ``load_policy`` on the env's own observation."""
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        *ENV,
        "runner.backend=sequential",
        "env.max_episode_steps=5",
        "model.core=lstm",
        "model.shared_torso=true",
        "model.lstm_hidden_size=8",
        "model.use_last_action_reward=true",
        "algorithm.n_epochs=1",
        "algorithm.epoch_length=2",
    ]
    summary = impala_rl.train("cartpole", overrides, run_dir=run_dir)
    assert summary["updates"] == 2
    policy = impala_rl.load_policy(run_dir, which="last")
    raw, _ = dict_envs.make_env().reset(seed=1)
    assert 0 <= int(policy.act(raw)) < 4


@pytest.mark.parametrize("read_text, lowest, highest", [(True, 7.0, 8.0), (False, 0.0, 4.0)])
def test_a_policy_learns_what_the_mission_asks_and_one_that_does_not_read_it_cannot(
    tmp_path, read_text, lowest, highest
):
    """Each step's mission names one of 4 colours in one of 2 sentences; the action of that
    colour pays 1 of an episode's 8. Reading the mission, the evaluation reaches 7 or more in
    15k env steps (8.0 on seed 0); without it, chance is 2 (2.5 on seed 0). Then its policy
    acts on a batch of the env's own observations, missions as strings."""
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        "env.id=dict_envs:make_mission_env",
        "runner.backend=sequential",
        "max_env_steps=15000",
        f"model.read_text={str(read_text).lower()}",
    ]
    summary = impala_rl.train("cartpole", overrides, run_dir=run_dir)
    assert lowest <= summary["best_eval_return"] <= highest, summary
    policy = impala_rl.load_policy(run_dir)
    env = dict_envs.make_mission_env()
    rows = [env.reset(seed=i)[0] for i in range(5)]
    batch = {"mission": [r["mission"] for r in rows], "pos": np.stack([r["pos"] for r in rows])}
    actions = policy.act(batch)
    assert actions.shape == (5,)
    if read_text:
        asked = [
            dict_envs.COLOURS.index(w)
            for r in rows
            for w in r["mission"].split()
            if w in dict_envs.COLOURS
        ]
        assert actions.tolist() == asked


@pytest.mark.parametrize("env_id", ["dict_envs:make_env", "dict_envs:make_keys_env"])
def test_a_dict_env_acts_under_central_inference(tmp_path, env_id):
    """A plain env's Dict and a structured env's Dict step keys, through the request buffers."""
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            *ENV,
            f"env.id={env_id}",
            "runner.backend=subprocess",
            "runner.inference=central",
            "max_env_steps=1500",
        ],
        run_dir=tmp_path / "run",
    )
    assert summary["env_steps"] >= 1500


def test_a_user_encoder_reads_the_dict():
    env = EnvFactory("dict_envs:make_env")()
    model = ActorCritic(
        env.observation_space,
        env.action_space,
        encoder="user_nets:DictTorso",
        encoder_kwargs={"width": 6},
    )
    assert model.policies["0"].torso.out_features == 6
    obs = {
        "image": torch.zeros(2, 3, 3, 5, 5, dtype=torch.uint8),
        "direction": torch.zeros(2, 3, dtype=torch.int64),
        "pos": torch.zeros(2, 3, 2),
        "mission": torch.zeros(2, 3, 32, 2, dtype=torch.int16),
    }
    assert model.policy_value(0, obs)[1].shape == (2, 3)


def test_minigrid_builds_and_trains_as_typed(tmp_path):
    pytest.importorskip("minigrid")
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            "env.id=MiniGrid-DoorKey-5x5-v0",
            "runner.backend=sequential",
            "algorithm.n_epochs=1",
            "algorithm.epoch_length=1",
            "algorithm.rollout_evaluator.n_episodes=1",
            "algorithm.rollout_evaluator.max_episode_steps=20",
        ],
        run_dir=tmp_path / "run",
    )
    assert summary["updates"] == 1
    env = EnvFactory("MiniGrid-DoorKey-5x5-v0")()
    assert isinstance(env.observation_space, gym.spaces.Dict)
    assert env.observation_space["image"].shape == (3, 7, 7)


def _dict_batch(image: int = 0) -> dict[str, torch.Tensor]:
    return {
        "image": torch.full((3, 3, 5, 5), image, dtype=torch.uint8),
        "direction": torch.tensor([0, 1, 2]),
        "pos": torch.zeros(3, 2),
        "mission": torch.zeros(3, 32, 2, dtype=torch.int16),
    }


def test_the_policy_and_the_critic_read_the_entries_chosen_for_them():
    """An asymmetric actor-critic (EvoRL's policy_obs_key / value_obs_key): the policy reads
    ``direction`` alone, the critic every entry."""
    env = EnvFactory("dict_envs:make_env")()
    cfg = impala_rl.config.ModelConfig(
        policy_obs_keys=["direction"], value_obs_keys=["direction", "image", "pos"]
    )
    from impala_rl.nn.factory import build_model

    model = build_model(cfg, env.observation_space, env.action_space)
    assert model.policies["0"].torso.names == ["direction"]
    assert model.critics["0"].torso.names == ["direction", "image", "pos"]
    dark, bright = _dict_batch(0), _dict_batch(255)
    dist_dark, value_dark = model.policy_value(0, dark)
    dist_bright, value_bright = model.policy_value(0, bright)
    assert torch.equal(dist_dark.logits, dist_bright.logits)  # the image is not the policy's
    assert not torch.equal(value_dark, value_bright)  # but the critic's


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.policy_obs_keys=[colour]"], r"model\.policy_obs_keys.*'colour'.*direction"),
        (["model.value_obs_keys=[]"], r"model\.value_obs_keys.*non-empty"),
    ],
)
def test_unknown_or_empty_entries_are_refused(overrides, message):
    from impala_rl.config import ConfigError, load_config
    from impala_rl.nn.factory import build_model

    env = EnvFactory("dict_envs:make_env")()
    with pytest.raises(ConfigError, match=message):
        cfg = load_config("cartpole", [*ENV, *overrides])
        build_model(cfg.model, env.observation_space, env.action_space)


def test_entry_selection_needs_a_dict_observation_and_its_own_value_torso():
    from impala_rl.config import ConfigError, load_config
    from impala_rl.nn.factory import build_model

    with pytest.raises(ConfigError, match=r"model\.value_obs_keys.*shared_torso"):
        load_config("cartpole", ["model.shared_torso=true", "model.value_obs_keys=[pos]"])
    env = gym.make("CartPole-v1")
    cfg = load_config("cartpole", ["model.policy_obs_keys=[pos]"])
    with pytest.raises(ConfigError, match=r"model\.policy_obs_keys.*Dict observation"):
        build_model(cfg.model, env.observation_space, env.action_space)


def test_vector_entries_are_normalized_by_their_running_statistics(tmp_path):
    """``normalize_obs`` keeps statistics per vector entry (images and indices pass through),
    updated by the learner and kept with the weights."""
    from impala_rl.nn.normalization import DictObsNorm

    env = EnvFactory("dict_envs:make_env")()
    model = ActorCritic(env.observation_space, env.action_space, normalize_obs=True)
    norm = model.observation_normalizer(0)
    assert isinstance(norm, DictObsNorm) and norm.names == ["pos"]
    batch = _dict_batch(7)
    batch["pos"] = torch.tensor([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0]])
    norm.update(batch)
    out = norm(batch)
    assert torch.allclose(out["pos"][:, 0], torch.tensor([-1.2247, 0.0, 1.2247]), atol=1e-3)
    assert torch.equal(out["image"], batch["image"]) and torch.equal(
        out["direction"], batch["direction"]
    )

    run_dir = tmp_path / "run"
    overrides = [*FAST, *ENV, "runner.backend=sequential", "model.normalize_obs=true"]
    budget = ["algorithm.n_epochs=1", "algorithm.epoch_length=2"]
    summary = impala_rl.train("cartpole", [*overrides, *budget], run_dir=run_dir)
    policy = impala_rl.load_policy(run_dir, which="last")
    a = policy.config.algorithm
    rows = a.n_rollout_steps * a.actors_batch_size * a.envs_per_actor  # rows 0..T-1 a batch
    assert float(policy.model.observation_normalizer(0).norm("pos").count) == (
        summary["updates"] // steps_per_batch(a) * rows
    )
