"""A ``Tuple`` observation holding an image or a text, and a ``Text`` observation alone, reach
the model as a Dict's entries (``env.observation_entries``): the image read by a CNN, the text
as its words; ``false`` (and runs saved before the setting) flattens them as before."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import dict_envs
import impala_rl
from impala_rl.config import config_from_dict, load_config, to_dict
from impala_rl.envs import EnvFactory
from impala_rl.envs.factory import make_keyed_vector_env
from impala_rl.envs.spaces import TextTokens, observation_entries, text_tokens
from impala_rl.envs.vector import NativeVectorEnv
from impala_rl.nn.factory import build_model_for_env

FAST = ["log.console=false", "log.tensorboard=false", "target_return=null"]


def test_which_spaces_become_entries():
    image = spaces.Box(0, 255, (8, 8, 3), np.uint8)
    vector = spaces.Box(-1.0, 1.0, (2,), np.float32)
    text = spaces.Text(10)
    entries = observation_entries(spaces.Tuple([vector] * 10 + [image]))
    assert list(entries) == [str(i) for i in range(11)]  # in position order, 10 after 9
    assert observation_entries(text) == {"text": text}
    assert list(observation_entries(spaces.Tuple((vector, text)))) == ["0", "1"]
    # numbers alone stay one vector (Blackjack's Tuple of Discretes), as before
    assert observation_entries(spaces.Tuple((spaces.Discrete(3), vector))) is None
    assert observation_entries(spaces.Tuple((image, vector)), entries=False) is None
    assert observation_entries(text, entries=False) is None


def test_a_tuple_envs_policy_acts_on_its_tuples_and_on_the_models_vectors():
    """Blackjack's ``Tuple`` of Discretes, as the env returns it (one tuple, or a list of
    them) and as ``policy.env_factory()`` gives it (the model's one-hot vector): the same
    actions. The vector was once taken for a tuple and failed to flatten."""
    from impala_rl.policy import Policy

    cfg = load_config("cartpole", ["env.id=Blackjack-v1"])
    factory = EnvFactory.of(cfg.env)
    env = factory()
    torch.manual_seed(0)
    policy = Policy(build_model_for_env(cfg.model, env, cfg.env.observation_entries), factory, cfg)
    raw_env = gym.make("Blackjack-v1")
    raws, vectors = [], []
    for seed in range(8):
        raws.append(raw_env.reset(seed=seed)[0])
        vectors.append(env.reset(seed=seed)[0])
    assert isinstance(raws[0], tuple) and vectors[0].shape == (45,)
    from_raw = [int(policy.act(o, deterministic=True)) for o in raws]
    assert from_raw == [int(policy.act(v, deterministic=True)) for v in vectors]
    assert policy.act(raws, deterministic=True).tolist() == from_raw
    assert policy.act(np.stack(vectors), deterministic=True).tolist() == from_raw
    with pytest.raises(ValueError, match="Policy.act takes one observation"):
        policy.act((1, 2), deterministic=True)  # two of the three entries
    with pytest.raises(ValueError, match="Policy.act takes one observation"):
        policy.act([], deterministic=True)  # a batch of no hands
    env.close()
    raw_env.close()


def test_a_tuple_with_an_image_is_read_by_a_cnn_and_a_text_as_words():
    env = EnvFactory("dict_envs:make_tuple_image_env")()
    assert env.observation_space["0"] == spaces.Box(0, 255, (3, 8, 8), np.uint8)
    obs, _ = env.reset(seed=0)
    assert obs["0"].shape == (3, 8, 8) and obs["1"].shape == (2,)
    model = build_model_for_env(load_config("cartpole").model, env)
    assert any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    flat = EnvFactory("dict_envs:make_tuple_image_env", entries=False)()
    assert flat.observation_space.shape == (194,)
    text = EnvFactory("dict_envs:make_mission_only_env")()
    assert isinstance(text.observation_space["text"], TextTokens)
    obs, _ = text.reset(seed=0)
    raw, _ = dict_envs.make_mission_only_env().reset(seed=0)
    assert isinstance(raw, str) and np.array_equal(obs["text"], text_tokens(raw))


def test_a_nested_entry_that_holds_an_image_or_a_text_becomes_entries_and_others_stay():
    """``{"robot": {"camera": image, "pos": vector}, ...}``: the camera reaches its CNN as
    ``robot/camera``; a nested Dict of numbers alone stays one flattened entry, as before."""
    image = spaces.Box(0, 255, (12, 12, 3), np.uint8)
    vector = spaces.Box(-1.0, 1.0, (2,), np.float32)
    space = spaces.Dict(
        {
            "robot": spaces.Dict({"camera": image, "pos": vector}),
            "plain": spaces.Dict({"a": vector, "b": spaces.Discrete(3)}),
            "say": spaces.Tuple((spaces.Text(10), spaces.Discrete(3))),
        }
    )
    entries = observation_entries(space)
    assert list(entries) == ["plain", "robot/camera", "robot/pos", "say/0", "say/1"]
    assert entries["plain"] is space["plain"]
    assert list(observation_entries(space, entries=False)) == ["plain", "robot", "say"]
    env = EnvFactory("dict_envs:make_nested_image_env")()
    assert env.observation_space["robot/camera"] == spaces.Box(0, 255, (3, 8, 8), np.uint8)
    obs, _ = env.reset(seed=3)
    raw, _ = dict_envs.make_nested_image_env().reset(seed=3)
    assert np.array_equal(obs["robot/camera"], raw["robot"]["camera"].transpose(2, 0, 1))
    model = build_model_for_env(load_config("cartpole").model, env)
    assert any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def test_a_config_saved_before_the_setting_flattens_as_it_did():
    saved = to_dict(load_config("cartpole"))
    del saved["env"]["observation_entries"]
    assert config_from_dict(saved).env.observation_entries is False


@pytest.mark.parametrize("env_id", ["make_tuple_image_vector_env", "make_masked_tuple_image_env"])
@pytest.mark.parametrize("entries", [True, False])
def test_the_setting_holds_for_native_vector_and_masked_envs(tmp_path, env_id, entries):
    """A callable's native vector env converts rows, and a masked env (the structured one-key
    case) converts per step key: both read a Tuple with an image as the setting says, as the
    model does, and a run trains and its saved policy acts on raw observations."""
    run_dir = tmp_path / "run"
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            f"env.id=dict_envs:{env_id}",
            f"env.observation_entries={str(entries).lower()}",
            "runner.backend=sequential",
            "max_env_steps=2000",
        ],
        run_dir=run_dir,
    )
    assert summary["env_steps"] >= 2000, summary
    policy = impala_rl.load_policy(run_dir)
    convs = [m for m in policy.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert bool(convs) is entries
    factory = EnvFactory(f"dict_envs:{env_id}", entries=entries)
    envs = make_keyed_vector_env(factory, 2)
    try:
        space = envs.single_observation_space
        assert isinstance(space, spaces.Dict) is entries
        if not entries:
            assert space.shape == (194,)
    finally:
        envs.close()
    obs, _ = getattr(dict_envs, env_id)().reset(seed=0)
    assert int(policy.act(obs)) in range(4)


@pytest.mark.parametrize(
    "env_id", ["make_mission_only_env", "make_tuple_image_env", "make_nested_image_env"]
)
def test_a_text_or_an_image_in_a_tuple_or_nested_dict_learns_and_its_policy_acts_on_raw_obs(
    tmp_path, env_id
):
    """The action named by the text (or the lit quadrant of the image, in a Tuple or a nested
    Dict) pays 1 of 8 a step; chance is 2 an episode. 15k env steps reach 7 or more (8.0 on
    seed 0)."""
    run_dir = tmp_path / "run"
    summary = impala_rl.train(
        "cartpole",
        [*FAST, f"env.id=dict_envs:{env_id}", "runner.backend=sequential", "max_env_steps=15000"],
        run_dir=run_dir,
    )
    assert summary["best_eval_return"] >= 7.0, summary
    policy = impala_rl.load_policy(run_dir)
    env = getattr(dict_envs, env_id)()
    right = 0
    for i in range(20):
        obs, _ = env.reset(seed=i)
        answer = (
            dict_envs.COLOURS.index(next(w for w in obs.split() if w in dict_envs.COLOURS))
            if isinstance(obs, str)
            else env.lit
        )
        right += int(policy.act(obs)) == answer
    assert right >= 18


def test_a_native_vector_env_gives_each_row_its_own_tuple_or_text():
    """Gymnasium's vector envs batch a Tuple as a tuple of arrays and texts as a tuple of
    strings: each row is cut out of its entries, a text taken whole."""
    same_step = gym.vector.AutoresetMode.SAME_STEP
    images = gym.vector.SyncVectorEnv(
        [dict_envs.make_tuple_image_env] * 3, autoreset_mode=same_step
    )
    native = NativeVectorEnv(images)
    obs, _ = native.reset(seed=0)
    for row, env in enumerate(images.envs):
        r, c = divmod(env.lit, 2)
        assert obs["0"][row, 0, 4 * r, 4 * c] == 255 and obs["0"][row].sum() == 16 * 3 * 255
    texts = gym.vector.SyncVectorEnv([dict_envs.make_mission_only_env] * 3)
    obs, _ = NativeVectorEnv(texts).reset(seed=0)
    raws = [dict_envs.make_mission_only_env().reset(seed=i)[0] for i in range(3)]
    for row, raw in enumerate(raws):
        assert np.array_equal(obs["text"][row], text_tokens(raw))
