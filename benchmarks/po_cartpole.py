"""A partially observed CartPole-v1 for the asymmetric-critic experiment
(docs/experiments/asymmetric-critic.md): ``env.id=po_cartpole:make_env`` with ``benchmarks/`` on
``PYTHONPATH``.

The observation is a Dict: ``pos`` holds the cart position and pole angle of this step and the
previous one (``[x, theta, x_prev, theta_prev]``; at a reset the previous equals the current),
``vel`` the velocities ``[x_dot, theta_dot]`` the policy is not meant to see. A policy reading
``pos`` alone can only estimate the velocities from the difference; a critic reading ``vel``
too has the full state (``model.policy_obs_keys=[pos] model.value_obs_keys=[pos,vel]``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class PositionsOnlyCartPole(gym.Wrapper):
    def __init__(self, env: gym.Env):
        super().__init__(env)
        high = np.full(4, np.inf, np.float32)
        self.observation_space = spaces.Dict(
            {
                "pos": spaces.Box(-high, high, (4,), np.float32),
                "vel": spaces.Box(-high[:2], high[:2], (2,), np.float32),
            }
        )
        self._prev = np.zeros(2, np.float32)

    def _obs(self, state: np.ndarray) -> dict[str, np.ndarray]:
        pos = np.array([state[0], state[2]], np.float32)
        out = {
            "pos": np.concatenate([pos, self._prev]).astype(np.float32),
            "vel": np.array([state[1], state[3]], np.float32),
        }
        self._prev = pos
        return out

    def reset(self, **kwargs: Any):
        state, info = self.env.reset(**kwargs)
        self._prev = np.array([state[0], state[2]], np.float32)
        return self._obs(state), info

    def step(self, action: Any):
        state, reward, terminated, truncated, info = self.env.step(action)
        return self._obs(state), reward, terminated, truncated, info


def make_env(**kwargs: Any) -> gym.Env:
    return PositionsOnlyCartPole(gym.make("CartPole-v1", **kwargs))
