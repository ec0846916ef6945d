"""A small env with a Dict observation as MiniGrid's: an image (channels last, uint8), a
``Discrete`` entry, a vector and a ``Text`` mission. Importable as ``dict_envs:make_env`` for
``env.id`` (pytest puts ``tests/`` on ``sys.path``).

The reward is 1 when the action equals the ``direction`` entry (minus its start), so a policy
that reads the Discrete entry can learn it; the image's top-left pixel repeats it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

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
