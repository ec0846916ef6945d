"""Envs whose image observations are larger than ``env.max_image_side`` (128) a side."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from impala_rl.envs.structured import ActorID, StructuredEnv

HEIGHT, WIDTH = 192, 288  # downscaled: 85 x 128


class SideEnv(gym.Env):
    """A red square on a gray screen, in its left or right half; the action names the half
    (0 left, 1 right) and a right guess pays 1. Episodes of 8 steps: the optimum is 8, a
    random policy 4. ``layout``: ``hwc`` (channels last), ``chw`` or ``hw`` (grayscale, the
    square bright); ``entry``: the screen as entry ``"screen"`` of a Dict beside a vector;
    ``floats``: float32 pixels in [0, 1] (``255``: in [0, 255]); ``height``, ``width``: the
    screen's size (the square is a third of the height)."""

    metadata: dict = {"render_modes": []}

    def __init__(
        self,
        layout: str = "hwc",
        entry: bool = False,
        length: int = 8,
        floats: int | None = None,
        height: int = HEIGHT,
        width: int = WIDTH,
    ):
        h, w = height, width
        shape = {"hwc": (h, w, 3), "chw": (3, h, w), "hw": (h, w)}
        if floats is None:
            screen = spaces.Box(0, 255, shape[layout], np.uint8)
        else:
            screen = spaces.Box(0.0, float(floats), shape[layout], np.float32)
        self.layout, self.entry, self.length, self.floats = layout, entry, length, floats
        self.height, self.width, self.square = h, w, max(2, h // 3)
        self.observation_space = (
            spaces.Dict({"screen": screen, "step": spaces.Box(0.0, 1.0, (1,), np.float32)})
            if entry
            else screen
        )
        self.action_space = spaces.Discrete(2)
        self.t = 0
        self.side = 0

    def _obs(self) -> Any:
        self.side = int(self.np_random.integers(2))
        h, w, square = self.height, self.width, self.square
        image = np.full((h, w, 3), 96, np.uint8)
        top = int(self.np_random.integers(0, h - square))
        left = int(self.np_random.integers(0, w // 2 - square)) + self.side * w // 2
        image[top : top + square, left : left + square] = (255, 0, 0)
        if self.layout == "chw":
            image = np.ascontiguousarray(np.moveaxis(image, -1, 0))
        elif self.layout == "hw":
            image = np.ascontiguousarray(image[..., 0])
        if self.floats is not None:
            image = image.astype(np.float32) * (self.floats / 255.0)
        if not self.entry:
            return image
        return {"screen": image, "step": np.array([self.t / self.length], np.float32)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        reward = float(int(action) == self.side)
        self.t += 1
        return self._obs(), reward, False, self.t >= self.length, {"side": self.side}


def make_env(**kwargs: Any) -> SideEnv:
    return SideEnv(**kwargs)


class TwoSeatSideEnv(StructuredEnv):
    """Two agents take turns guessing the side on their own screen (step key 0: a Dict with
    the screen and an ``action_mask`` that allows both halves; step key 1: a small screen
    that needs no downscaling). Truncated after ``length`` turns, with final observations."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8):
        self.big = SideEnv()
        self.observation_spaces = {
            0: spaces.Dict(
                {"screen": self.big.observation_space, "action_mask": spaces.MultiBinary(2)}
            ),
            1: spaces.Box(0, 255, (40, 40, 3), np.uint8),
        }
        self.action_spaces = {0: spaces.Discrete(2), 1: spaces.Discrete(2)}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        self.n_agents = 2
        self.length = length
        self.t = 0

    def _obs(self) -> Any:
        if self.t % 2 == 0:
            return {"screen": self.big._obs(), "action_mask": np.ones(2, np.int8)}
        return np.zeros((40, 40, 3), np.uint8)

    def actor_id(self) -> ActorID:
        return ActorID(self.t % 2, self.t % 2)

    def final_observation(self, agent_id: int) -> tuple[int, Any]:
        return agent_id, self._obs() if agent_id == self.t % 2 else self._final(agent_id)

    def _final(self, agent_id: int) -> Any:
        if agent_id == 0:
            return {"screen": self.big._obs(), "action_mask": np.ones(2, np.int8)}
        return np.zeros((40, 40, 3), np.uint8)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.big.reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        reward = np.zeros(2)
        if self.t % 2 == 0:
            reward[0] = float(int(action) == self.big.side)
        self.t += 1
        return self._obs(), reward, False, self.t >= self.length, {}


def make_float_catch(low: float = 0.0) -> gym.Env:
    """The sample Catch with its frames as float32 pixels in [0, 1] (a camera an env
    normalized), ``[40, 40, 3]``; ``low=-1``: in [-1, 1]."""
    from impala_rl.envs.samples import Catch

    env = Catch()
    space = spaces.Box(low, 1.0, env.observation_space.shape, np.float32)

    def floats(obs: np.ndarray) -> np.ndarray:
        return (low + obs.astype(np.float32) * ((1.0 - low) / 255.0)).astype(np.float32)

    return gym.wrappers.TransformObservation(env, floats, space)
