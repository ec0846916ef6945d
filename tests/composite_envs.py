"""An env whose action is a Dict of a choice and an amount: only a policy that learns both
parts of one action earns the most."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

TARGETS = 3


class PickAndSetEnv(gym.Env):
    """Each step shows a target (one-hot of 3) and a goal in [-0.8, 0.8]; the action is
    ``{"pick": Discrete(3), "amount": Box(-1, 1, (1,))}`` and pays ``1`` for the target's pick
    plus ``1 - |amount - goal|``. The optimum is 2 a step, 16 an episode of 8; random actions
    earn ~5 an episode, a fixed pick with the amount at 0 (an untrained policy's mode) ~7.5.
    ``nested=True`` puts the amount in a Tuple with a MultiBinary switch
    that pays nothing (the space nests; the reward is the same)."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8, nested: bool = False):
        self.observation_space = spaces.Box(-1.0, 1.0, (TARGETS + 1,), np.float32)
        amount = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.nested = nested
        self.action_space = spaces.Dict(
            {
                "pick": spaces.Discrete(TARGETS),
                "amount": spaces.Tuple((amount, spaces.MultiBinary(2))) if nested else amount,
            }
        )
        self.length = length
        self.t = 0
        self.target, self.goal = 0, 0.0

    def _obs(self) -> np.ndarray:
        self.target = int(self.np_random.integers(TARGETS))
        self.goal = float(self.np_random.uniform(-0.8, 0.8))
        obs = np.zeros(TARGETS + 1, np.float32)
        obs[self.target], obs[-1] = 1.0, self.goal
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        amount = action["amount"][0] if self.nested else action["amount"]
        reward = float(int(action["pick"]) == self.target) + 1.0 - abs(float(amount[0]) - self.goal)
        self.t += 1
        return self._obs(), reward, self.t >= self.length, False, {}


def make_env(length: int = 8, nested: bool = False) -> gym.Env:
    return PickAndSetEnv(length, nested)
