"""Small envs of the kinds users bring, for ``impala train env.id=...`` without a preset.

No preset was tuned on them; ``benchmarks/any_env.py`` runs them against SB3's PPO and tests
train on them in bounded runs:

- ``impala_rl.envs.samples:GridWorld``: a 5x5 grid, a ``Dict`` of int coordinates;
- ``impala_rl.envs.samples:Catch``: a pixel game, channels-last RGB frames ``[40, 40, 3]``;
- ``impala_rl.envs.samples:PointGoal``: a point mass steered to a goal, a ``Dict`` of float
  vectors and continuous actions.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class GridWorld(gym.Env):
    """Walk to the goal on a ``size`` x ``size`` grid; both cells are drawn at each reset.

    Observation: ``{"agent": Box(0, size-1, (2,), int64), "goal": the same}``; actions: up,
    down, left, right. Reaching the goal ends the episode with ``1 - 0.9 * t / max_steps``
    (MiniGrid's reward: the sooner the better); ``max_steps`` (100) truncates it with 0.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]])

    def __init__(self, size: int = 5, max_steps: int = 100):
        self.size, self.max_steps = int(size), int(max_steps)
        cell = spaces.Box(0, self.size - 1, (2,), np.int64)
        self.observation_space = spaces.Dict({"agent": cell, "goal": cell})
        self.action_space = spaces.Discrete(4)

    def _obs(self) -> dict[str, np.ndarray]:
        return {"agent": self.agent.copy(), "goal": self.goal.copy()}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        cells = self.np_random.choice(self.size * self.size, 2, replace=False)
        self.agent = np.array(divmod(int(cells[0]), self.size), dtype=np.int64)
        self.goal = np.array(divmod(int(cells[1]), self.size), dtype=np.int64)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        self.agent = np.clip(self.agent + self.MOVES[int(action)], 0, self.size - 1)
        self.t += 1
        reached = bool((self.agent == self.goal).all())
        reward = 1.0 - 0.9 * self.t / self.max_steps if reached else 0.0
        return self._obs(), reward, reached, self.t >= self.max_steps and not reached, {}


class Catch(gym.Env):
    """Catch a falling ball with a paddle: RGB frames ``[40, 40, 3]`` (a 10 x 10 board drawn
    in 4 x 4 pixel cells: the ball red, the paddle, 3 cells wide, blue).

    Actions: left, stay, right. The ball falls one row per step from a random column and
    drifts one column left or right each step (bouncing off the walls); when it reaches the
    paddle's row the episode ends with +1 if the paddle is under it, else -1.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}
    BOARD, CELL = 10, 4

    def __init__(self, render_mode: str | None = None):
        side = self.BOARD * self.CELL
        self.observation_space = spaces.Box(0, 255, (side, side, 3), np.uint8)
        self.action_space = spaces.Discrete(3)
        self.render_mode = render_mode

    def _frame(self) -> np.ndarray:
        frame = np.zeros(self.observation_space.shape, np.uint8)
        c = self.CELL
        row, col = self.ball
        frame[row * c : (row + 1) * c, col * c : (col + 1) * c, 0] = 255
        bottom = self.BOARD - 1
        left = (self.paddle - 1) * c
        frame[bottom * c :, max(0, left) : (self.paddle + 2) * c, 2] = 255
        return frame

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.ball = [0, int(self.np_random.integers(self.BOARD))]
        self.drift = int(self.np_random.choice([-1, 1]))
        self.paddle = self.BOARD // 2
        return self._frame(), {}

    def step(self, action: Any):
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 1, self.BOARD - 2))
        row, col = self.ball
        col += self.drift
        if not 0 <= col < self.BOARD:
            self.drift = -self.drift
            col += 2 * self.drift
        self.ball = [row + 1, col]
        if self.ball[0] < self.BOARD - 1:
            return self._frame(), 0.0, False, False, {}
        caught = abs(self.ball[1] - self.paddle) <= 1
        return self._frame(), 1.0 if caught else -1.0, True, False, {}

    def render(self) -> np.ndarray:
        return self._frame()


class PointGoal(gym.Env):
    """Steer a point mass to a goal in the unit square: continuous accelerations.

    Observation: ``{"position", "velocity", "goal"}``, each ``Box(-1, 1, (2,), float32)``;
    action: an acceleration ``Box(-1, 1, (2,))``. Each step pays minus the distance to the goal
    (and a small cost for the action); ``max_steps`` (100) steps make an episode.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    DT = 0.1

    def __init__(self, max_steps: int = 100):
        self.max_steps = int(max_steps)
        box = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.observation_space = spaces.Dict({"position": box, "velocity": box, "goal": box})
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "position": self.position.astype(np.float32),
            "velocity": self.velocity.astype(np.float32),
            "goal": self.goal.astype(np.float32),
        }

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-0.9, 0.9, 2)
        self.goal = self.np_random.uniform(-0.9, 0.9, 2)
        self.velocity = np.zeros(2)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        a = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        self.velocity = np.clip(self.velocity + self.DT * a, -1.0, 1.0)
        self.position = np.clip(self.position + self.DT * self.velocity, -1.0, 1.0)
        self.t += 1
        distance = float(np.linalg.norm(self.position - self.goal))
        reward = -distance - 0.01 * float(np.square(a).sum())
        return self._obs(), reward, False, self.t >= self.max_steps, {}
