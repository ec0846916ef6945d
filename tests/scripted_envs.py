"""Tiny deterministic environments for the rollout tests.

``ScriptedEnv`` ignores its actions: observation ``[step counter, episode id]`` (float32), reward
``reward`` per step. Episode ``e`` (counted from 0 per env instance) lasts
``episode_lengths[e % len(episode_lengths)]`` steps and then terminates; with ``terminate=False``
it never ends by itself (use a ``TimeLimit`` to truncate it). ``step_sleep_s`` makes each
step take at least that long (an env that is slow to simulate).

Importable as ``scripted_envs:make_env`` for :class:`impala_rl.envs.EnvFactory` (pytest puts
``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class ScriptedEnv(gym.Env):
    metadata: dict = {"render_modes": []}

    def __init__(
        self,
        episode_lengths: Sequence[int] = (3,),
        terminate: bool = True,
        reward: float = 1.0,
        step_sleep_s: float = 0.0,
    ):
        self.step_sleep_s = float(step_sleep_s)
        self.episode_lengths = tuple(int(n) for n in episode_lengths)
        self.terminate = terminate
        self.reward = float(reward)
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.episode = -1
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.episode], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"invalid action {action!r}")
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        self.t += 1
        length = self.episode_lengths[self.episode % len(self.episode_lengths)]
        terminated = self.terminate and self.t >= length
        return self._obs(), self.reward, terminated, False, {}


def make_env(**kwargs) -> gym.Env:
    return ScriptedEnv(**kwargs)
