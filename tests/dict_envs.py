"""A small env with a Dict observation as MiniGrid's: an image (channels last, uint8), a
``Discrete`` entry, a vector and a ``Text`` mission. Importable as ``dict_envs:make_env`` for
``env.id`` (pytest puts ``tests/`` on ``sys.path``).

The reward is 1 when the action equals the ``direction`` entry (minus its start), so a policy
that reads the Discrete entry can learn it; the image's top-left pixel repeats it.
``dict_envs:make_keys_env`` is a structured env whose step keys observe Dicts.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from impala_rl.envs.structured import ActorID, StructuredEnv

SPACE = spaces.Dict(
    {
        "image": spaces.Box(0, 255, (5, 5, 3), np.uint8),
        "direction": spaces.Discrete(4, start=1),
        "pos": spaces.Box(-1.0, 1.0, (2,), np.float32),
        "mission": spaces.Text(20, charset="abcdefghijklmnopqrstuvwxyz "),
    }
)


class DictObsEnv(gym.Env):
    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8):
        self.observation_space = SPACE
        self.action_space = spaces.Discrete(4)
        self.length = length
        self.t = 0
        self.direction = 1

    def _obs(self) -> dict:
        self.direction = int(self.np_random.integers(1, 5))
        image = np.zeros((5, 5, 3), np.uint8)
        image[0, 0, :] = self.direction * 60
        pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return {"image": image, "direction": self.direction, "pos": pos, "mission": "go right"}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.direction - 1)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


def make_env(length: int = 8) -> gym.Env:
    return DictObsEnv(length)


class Handle(spaces.Space):
    """An entry that is neither numbers nor text: the model leaves it out."""

    def sample(self, mask=None, probability=None):
        return object()

    def contains(self, x) -> bool:
        return True


class HandleEnv(gym.Wrapper):
    """:class:`DictObsEnv` with an opaque ``handle`` entry besides."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = spaces.Dict({**env.observation_space.spaces, "handle": Handle()})

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return {**obs, "handle": object()}, info

    def step(self, action):
        obs, *rest = self.env.step(action)
        return {**obs, "handle": object()}, *rest


def make_handle_env() -> gym.Env:
    return HandleEnv(DictObsEnv())


KEY_SPACES = {
    0: SPACE,  # MiniGrid's observation in small: image, direction, pos, mission
    1: spaces.Dict(
        {
            "mode": spaces.Discrete(3),
            "pos": spaces.Box(-1.0, 1.0, (2,), np.float32),
            "action_mask": spaces.MultiBinary(3),
        }
    ),
}


class DictKeysEnv(StructuredEnv):
    """A structured env whose two step keys observe Dicts, taking turns: key 0 is paid 1 for
    the action equal to its ``direction`` entry (minus its start), key 1 for the action equal
    to its ``mode`` entry, which its ``action_mask`` always allows together with one other.
    Random actions earn ~0.375 a sub-step, a policy that reads the Discrete entries 1."""

    def __init__(self, length: int = 8):
        self.observation_spaces = dict(KEY_SPACES)
        self.action_spaces = {0: spaces.Discrete(4), 1: spaces.Discrete(3)}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        self.length = length
        self.t = 0
        self.target = 0

    def actor_id(self) -> ActorID:
        return ActorID(self.t % 2, 0)

    def _obs(self) -> dict:
        if self.t % 2 == 0:
            direction = int(self.np_random.integers(1, 5))
            self.target = direction - 1
            image = np.zeros((5, 5, 3), np.uint8)
            image[0, 0, :] = direction * 60
            pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
            return {"image": image, "direction": direction, "pos": pos, "mission": "go"}
        self.target = int(self.np_random.integers(0, 3))
        mask = np.zeros(3, np.int8)
        mask[[self.target, (self.target + 1) % 3]] = 1
        pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return {"mode": self.target, "pos": pos, "action_mask": mask}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.target)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


def make_keys_env(length: int = 8) -> StructuredEnv:
    return DictKeysEnv(length)


COLOURS = ("red", "green", "blue", "yellow")


class MissionEnv(gym.Env):
    """Each step asks for one of four colours in words ("go to the blue door") and pays 1 for
    the action of that colour: only a policy that reads the mission does better than 1 in 4.
    The mission also says where in the sentence the colour is (two templates)."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8):
        self.observation_space = spaces.Dict(
            {
                "mission": spaces.Text(40, charset="abcdefghijklmnopqrstuvwxyz "),
                "pos": spaces.Box(-1.0, 1.0, (2,), np.float32),
            }
        )
        self.action_space = spaces.Discrete(len(COLOURS))
        self.length = length
        self.t = 0
        self.colour = 0

    def _obs(self) -> dict:
        self.colour = int(self.np_random.integers(len(COLOURS)))
        words = COLOURS[self.colour]
        if self.np_random.random() < 0.5:
            mission = f"go to the {words} door"
        else:
            mission = f"the door is {words} go there"
        return {"mission": mission, "pos": np.zeros(2, np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.colour)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


def make_mission_env(length: int = 8) -> gym.Env:
    return MissionEnv(length)


class MissionOnlyEnv(MissionEnv):
    """:class:`MissionEnv` whose observation is the mission alone: a ``Text`` space."""

    def __init__(self, length: int = 8):
        super().__init__(length)
        self.observation_space = spaces.Text(40, charset="abcdefghijklmnopqrstuvwxyz ")

    def _obs(self) -> str:  # type: ignore[override]
        return super()._obs()["mission"]


def make_mission_only_env(length: int = 8) -> gym.Env:
    return MissionOnlyEnv(length)


class TupleImageEnv(gym.Env):
    """A ``Tuple`` of a channels-last RGB image (one of 4 quadrants lit) and a 2-vector;
    the action naming the lit quadrant pays 1, of an episode's 8 steps."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8):
        self.observation_space = spaces.Tuple(
            (
                spaces.Box(0, 255, (8, 8, 3), np.uint8),
                spaces.Box(-1.0, 1.0, (2,), np.float32),
            )
        )
        self.action_space = spaces.Discrete(4)
        self.length = length
        self.t = 0
        self.lit = 0

    def _obs(self) -> tuple:
        self.lit = int(self.np_random.integers(4))
        image = np.zeros((8, 8, 3), np.uint8)
        row, col = divmod(self.lit, 2)
        image[4 * row : 4 * row + 4, 4 * col : 4 * col + 4, :] = 255
        return image, np.zeros(2, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.lit)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


def make_tuple_image_env(length: int = 8) -> gym.Env:
    return TupleImageEnv(length)


class MaskedTupleImageEnv(TupleImageEnv):
    """:class:`TupleImageEnv` with its legal actions from ``action_masks()`` (every action;
    the structured one-key case)."""

    def action_masks(self) -> np.ndarray:
        return np.ones(4, dtype=bool)


def make_masked_tuple_image_env(length: int = 8) -> gym.Env:
    return MaskedTupleImageEnv(length)


def make_tuple_image_vector_env(length: int = 8) -> gym.Env:
    """:func:`make_tuple_image_env` whose callable also offers a native vector env."""
    return TupleImageEnv(length)


def _tuple_image_vector(num_envs: int, length: int = 8) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: TupleImageEnv(length)] * num_envs,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


make_tuple_image_vector_env.make_vector = _tuple_image_vector  # type: ignore[attr-defined]


class NestedImageEnv(TupleImageEnv):
    """:class:`TupleImageEnv` with the image inside a nested Dict:
    ``{"robot": {"camera": image, "pos": vector}, "goal": vector}``."""

    def __init__(self, length: int = 8):
        super().__init__(length)
        image, vector = self.observation_space.spaces
        self.observation_space = spaces.Dict(
            {"robot": spaces.Dict({"camera": image, "pos": vector}), "goal": vector}
        )

    def _obs(self) -> dict:  # type: ignore[override]
        image, vector = super()._obs()
        return {"robot": {"camera": image, "pos": vector}, "goal": vector.copy()}


def make_nested_image_env(length: int = 8) -> gym.Env:
    return NestedImageEnv(length)
