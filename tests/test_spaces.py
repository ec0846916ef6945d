"""End-to-end (learning-free) runs over structured observation and action spaces.

Each case runs ``SequentialDistributedActors`` + two ``Learner.update`` calls on a small env
that checks every action it gets against its action space.
"""

from __future__ import annotations

import functools
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from impala_rl.actors import SequentialDistributedActors
from impala_rl.config import ImpalaAlgorithmConfig
from impala_rl.envs.factory import ModelObservation
from impala_rl.evaluation import evaluate
from impala_rl.learner import Learner
from impala_rl.nn import ActorCritic

T, N = 4, 2


class SpaceEnv(gym.Env):
    """Random observations from ``observation_space``; episodes of ``length`` steps.

    Every action is checked with ``action_space.contains`` and recorded (the instance's
    ``actions`` list), so the test can look at what the env really got.
    """

    metadata: dict = {"render_modes": []}
    instances: list[SpaceEnv] = []

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space, length: int):
        self.observation_space = observation_space
        self.action_space = action_space
        self.length = length
        self.t = 0
        self.actions: list = []
        SpaceEnv.instances.append(self)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        composite = isinstance(action, (tuple, dict))
        self.actions.append(action if composite else np.array(action, copy=True))
        self.t += 1
        reward = float(self.t)
        terminated = self.t >= self.length
        return self.observation_space.sample(), reward, terminated, False, {}


def make_env(observation_space, action_space, length=3) -> gym.Env:
    return ModelObservation(SpaceEnv(observation_space, action_space, length))


BOX_OBS = spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
OBS_SPACES = {
    "dict": spaces.Dict(
        {
            "pos": spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32),
            "mode": spaces.Discrete(3),
            "flags": spaces.MultiBinary(2),
        }
    ),
    "tuple": spaces.Tuple((spaces.Discrete(4), spaces.Box(0.0, 1.0, shape=(2,)))),
    "discrete": spaces.Discrete(5),
    "box2d": spaces.Box(-1.0, 1.0, shape=(3, 4), dtype=np.float32),
    "image_uint8": spaces.Box(0, 255, shape=(4, 4, 3), dtype=np.uint8),
    "multidiscrete": spaces.MultiDiscrete([2, 3]),
}
# flattened sizes the model must see
OBS_DIMS = {
    "dict": 2 + 3 + 2,
    "tuple": 4 + 2,
    "discrete": 5,
    "box2d": 12,
    "image_uint8": 48,
    "multidiscrete": 5,
}
ACTION_SPACES = {
    "discrete": spaces.Discrete(3, start=-1),
    "box": spaces.Box(
        np.array([-0.5, 0.0], dtype=np.float32),
        np.array([0.5, 2.0], dtype=np.float32),
        dtype=np.float32,
    ),
    "multidiscrete": spaces.MultiDiscrete([3, 2, 4], start=[1, -1, 0]),
    "multibinary": spaces.MultiBinary(3),
}


def run(observation_space, action_space, updates: int = 2):
    SpaceEnv.instances.clear()
    factory = functools.partial(make_env, observation_space, action_space)
    probe = factory()
    torch.manual_seed(0)
    model = ActorCritic(probe.observation_space, probe.action_space, hidden_sizes=(8,))
    probe.close()
    cfg = ImpalaAlgorithmConfig(
        n_rollout_steps=T, envs_per_actor=N, num_actors=2, actors_batch_size=2, max_grad_norm=1.0
    )
    learner = Learner(model, cfg)
    all_stats, batches = [], []
    with SequentialDistributedActors(factory, model, cfg, seed=0) as actors:
        for _ in range(updates):
            batch = actors.collect_outputs("cpu").batch
            batches.append({k: v.clone() for k, v in batch.items()})
            all_stats.append(learner.update(batch))
            actors.broadcast_updated_policy(learner.model.state_dict())
    return model, all_stats, batches


def check_stats(all_stats) -> None:
    assert len(all_stats) == 2
    for stats in all_stats:
        assert math.isfinite(stats.total_loss)
        assert math.isfinite(stats.grad_norm)
        assert math.isfinite(stats.policy_loss[0]) and math.isfinite(stats.critic_value_loss[0])
    assert all_stats[1].policy_lag == [0] * (2 * N)


def env_actions() -> list[np.ndarray]:
    return [a for env in SpaceEnv.instances for a in env.actions]


@pytest.mark.parametrize("name", list(OBS_SPACES))
def test_observation_spaces(name):
    space = OBS_SPACES[name]
    model, all_stats, batches = run(space, spaces.Discrete(2))
    check_stats(all_stats)
    if name == "dict":  # keeps its structure: an entry each, in its own dtype
        dtypes = {"pos": torch.float32, "mode": torch.int64, "flags": torch.float32}
        for entry, dtype in dtypes.items():
            assert batches[0][f"obs.{entry}"].dtype == dtype
            assert batches[0][f"obs.{entry}"].shape[:2] == (T + 1, 2 * N)
        assert not torch.equal(batches[0]["obs.pos"][0], batches[0]["obs.pos"][1])
        assert len(env_actions()) == 2 * 2 * T * N
        return
    if name == "image_uint8":
        assert model.observation_spaces[0].shape == (3, 4, 4)  # channels first
        assert batches[0]["obs"].dtype == torch.uint8
    else:
        assert model.observation_spaces[0].shape == (OBS_DIMS[name],)
        assert batches[0]["obs"].dtype == torch.float32
    assert batches[0]["obs"].shape == (T + 1, 2 * N, *model.observation_spaces[0].shape)
    # observations vary (the flattening kept the content)
    assert not torch.equal(batches[0]["obs"][0], batches[0]["obs"][1])
    assert len(env_actions()) == 2 * 2 * T * N


@pytest.mark.parametrize("name", list(ACTION_SPACES))
def test_action_spaces(name):
    space = ACTION_SPACES[name]
    _, all_stats, batches = run(BOX_OBS, space)
    check_stats(all_stats)
    actions = env_actions()
    assert len(actions) == 2 * 2 * T * N
    # SpaceEnv.step already refused anything outside the space; check the bounds explicitly too
    stacked = np.stack(actions)
    assert stacked.shape[1:] == space.shape
    if name == "box":
        assert (stacked >= space.low).all() and (stacked <= space.high).all()
        # the stored (unclipped) samples do leave the bounds sometimes: clipping happened
        stored = torch.cat([b["action"][:-1] for b in batches]).reshape(-1, 2).numpy()
        assert ((stored < space.low) | (stored > space.high)).any()
    elif name == "discrete":
        assert set(np.unique(stacked)) <= {-1, 0, 1}
        assert len(np.unique(stacked)) > 1
    elif name == "multidiscrete":
        assert (stacked >= space.start).all() and (stacked < space.start + space.nvec).all()
        assert (stacked[:, 0] >= 1).all() and (stacked[:, 1] < 1).all()
    elif name == "multibinary":
        assert set(np.unique(stacked)) <= {0, 1}


def test_evaluate_returns_one_return_per_episode():
    factory = functools.partial(make_env, OBS_SPACES["dict"], ACTION_SPACES["multidiscrete"], 4)
    probe = factory()
    model = ActorCritic(probe.observation_space, probe.action_space, hidden_sizes=(8,))
    probe.close()
    for deterministic in (True, False):
        result = evaluate(model, factory, n_episodes=3, deterministic=deterministic, seed=1)
        assert result.returns == [10.0, 10.0, 10.0]  # rewards 1 + 2 + 3 + 4
        assert result.lengths == [4, 4, 4]
        assert result.mean_return == 10.0
    result = evaluate(model, factory, n_episodes=2, max_episode_steps=2)
    assert result.returns == [3.0, 3.0] and result.lengths == [2, 2]


@pytest.mark.parametrize(
    "space",
    [
        spaces.Tuple((spaces.Discrete(3, start=1), spaces.Box(-1.0, 1.0, (2,), np.float32))),
        spaces.Dict({"keys": spaces.MultiBinary(2), "dial": spaces.MultiDiscrete([2, 5])}),
    ],
    ids=["tuple", "dict"],
)
def test_tuple_and_dict_action_spaces(space):
    """The rollout stores a composite action as one float32 row of its parts' columns; the
    env gets one tuple or dict per step, inside its space (SpaceEnv checks)."""
    _, all_stats, batches = run(BOX_OBS, space)
    check_stats(all_stats)
    actions = env_actions()
    assert len(actions) == 2 * 2 * T * N
    assert batches[0]["action"].dtype == torch.float32
    assert batches[0]["action"].shape == (T + 1, 2 * N, 3 if "Tuple" in str(space) else 4)
    leaves = [a.item() if a.ndim == 0 else tuple(a.tolist()) for a in _first_leaves(actions)]
    assert len(set(leaves)) > 1  # sampled, not one fixed action


def _first_leaves(actions: list) -> list[np.ndarray]:
    """The first part of each recorded action (a tuple's first entry, a dict's first key)."""
    return [np.asarray(a[0] if isinstance(a, tuple) else a[sorted(a)[0]]) for a in actions]


class _SpacesEnv(gym.Env):
    """An env of the given spaces (observations sampled), to see what the factory says."""

    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


@pytest.mark.parametrize(
    ("action_space", "named"),
    [
        (spaces.OneOf([spaces.Discrete(3), spaces.Box(0, 1, (2,))]), "action space OneOf"),
        (spaces.Text(5), "action space Text"),
        (spaces.Tuple([spaces.Discrete(2), spaces.Text(3)]), "action space entry 1 Text"),
        (spaces.Dict({"move": spaces.Discrete(2), "say": spaces.Text(3)}), "entry 'say' Text"),
    ],
)
def test_an_action_space_no_head_samples_is_named_before_anything_is_built(action_space, named):
    from impala_rl.envs import EnvFactory
    from impala_rl.envs.spaces import EnvError, check_action_space

    with pytest.raises(EnvError, match=rf"{named}.*not supported; valid: Discrete"):
        check_action_space(action_space)
    with pytest.raises(EnvError, match=named):  # the factory checks what it builds
        EnvFactory(
            "test_spaces:make_spaces_env",
            {"observation_space": spaces.Box(0, 1, (3,), np.float32), "action_space": action_space},
        )()


def make_spaces_env(observation_space, action_space):
    return _SpacesEnv(observation_space, action_space)


def test_supported_action_spaces_pass_the_check():
    from impala_rl.envs.spaces import check_action_space

    for space in (
        spaces.Discrete(3, start=1),
        spaces.MultiDiscrete([2, 3]),
        spaces.MultiBinary(4),
        spaces.Box(-1, 1, (2,)),
        spaces.Tuple([spaces.Discrete(2), spaces.Dict({"x": spaces.Box(0, 1, (1,))})]),
    ):
        check_action_space(space)


def test_observations_of_no_fixed_size_are_refused_alone_and_left_out_of_a_dict():
    from impala_rl.envs.spaces import EnvError, dict_model_space, model_observation_space

    sequence = spaces.Sequence(spaces.Box(0, 1, (3,), np.float32))
    with pytest.raises(EnvError, match="a Sequence has no fixed size .*pad it to a Box"):
        model_observation_space(sequence)
    graph = spaces.Graph(spaces.Box(0, 1, (3,)), spaces.Discrete(2))
    with pytest.raises(EnvError, match="a Graph has no fixed size"):
        model_observation_space(graph)
    kept, dropped = dict_model_space(
        spaces.Dict({"position": spaces.Box(0, 1, (3,), np.float32), "trail": sequence})
    )
    assert list(kept.spaces) == ["position"]
    assert dropped == ["'trail' (Sequence, no fixed size)"]
