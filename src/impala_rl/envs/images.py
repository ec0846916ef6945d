"""Large images downscaled before they reach the model (``env.max_image_side``).

A frame rendered at screen size (Gymnasium's ``AddRenderObservation`` of CartPole: 400x600,
PettingZoo's butterfly games: 280x480 and larger) read whole by the Nature CNN gives a first
dense layer of ~10^8 weights, and every batch of them hundreds of megabytes: a run of a few
steps a second. An image whose longer side exceeds ``max_side`` is averaged down (Pillow's box
filter: each pixel the mean of the source pixels whose centres it covers), keeping its aspect
ratio, until that side is ``max_side`` long, in the env's own layout
(:func:`~impala_rl.envs.spaces.image_layout`; a stack of frames frame by frame), before
anything else reads it. Every other observation, and every smaller image, passes unchanged.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from PIL import Image

from impala_rl.envs.spaces import image_layout
from impala_rl.envs.structured import ActorID, StructuredEnv

_SIDES = {"hw": (0, 1), "hwc": (0, 1), "chw": (1, 2), "nhwc": (1, 2), "nchw": (2, 3)}
"""Where the height and width of an image of each layout are."""


def downscaled_side(height: int, width: int, max_side: int) -> tuple[int, int]:
    """``(height, width)`` scaled so that the longer side is ``max_side`` (unchanged if it is
    not longer), the shorter rounded, at least 1."""
    longer = max(height, width)
    if longer <= max_side:
        return height, width
    scale = max_side / longer
    return max(1, round(height * scale)), max(1, round(width * scale))


class ImageResizer:
    """Downscales the images of one observation space, at any depth of a ``Dict`` or ``Tuple``
    (``space``: the space it makes; ``changes``: whether any image is downscaled). Called on
    an observation of ``source``, it returns one of ``space``."""

    def __init__(self, source: spaces.Space, max_side: int):
        self.source = source
        self.max_side = int(max_side)
        self.space = self._space(source)
        self.changes = self.space is not source

    def _space(self, space: spaces.Space) -> spaces.Space:
        if isinstance(space, spaces.Dict):
            inner = {k: self._space(s) for k, s in space.spaces.items()}
            same = all(inner[k] is s for k, s in space.spaces.items())
            return space if same else spaces.Dict(inner)
        if isinstance(space, spaces.Tuple):
            parts = [self._space(s) for s in space.spaces]
            same = all(p is s for p, s in zip(parts, space.spaces, strict=True))
            return space if same else spaces.Tuple(parts)
        layout = image_layout(space)
        if layout is None:
            return space
        h_axis, w_axis = _SIDES[layout]
        shape = list(space.shape)
        size = downscaled_side(shape[h_axis], shape[w_axis], self.max_side)
        if size == (shape[h_axis], shape[w_axis]):
            return space
        shape[h_axis], shape[w_axis] = size
        low, high = int(np.min(space.low)), int(np.max(space.high))
        return spaces.Box(low, high, tuple(shape), dtype=np.uint8)

    def __call__(self, observation: Any) -> Any:
        return observation if not self.changes else self._resize(self.source, observation)

    def _resize(self, space: spaces.Space, value: Any) -> Any:
        if isinstance(space, spaces.Dict):
            return {k: self._resize(s, value[k]) for k, s in space.spaces.items()}
        if isinstance(space, spaces.Tuple):
            return tuple(self._resize(s, v) for s, v in zip(space.spaces, value, strict=True))
        layout = image_layout(space)
        if layout is None:
            return value
        return downscale(np.asarray(value, dtype=np.uint8), layout, self.max_side)


def downscale(image: np.ndarray, layout: str, max_side: int) -> np.ndarray:
    """One image of ``layout`` with its longer side at most ``max_side``: in each plane (one
    channel of one frame) a pixel is the mean of the source pixels whose centres it covers."""
    h_axis, w_axis = _SIDES[layout]
    height, width = image.shape[h_axis], image.shape[w_axis]
    size = downscaled_side(height, width, max_side)
    if size == (height, width):
        return image
    planes = np.moveaxis(image, (h_axis, w_axis), (-2, -1))
    lead = planes.shape[:-2]
    flat = np.ascontiguousarray(planes).reshape(-1, height, width)
    out = np.empty((flat.shape[0], *size), dtype=np.uint8)
    for i, plane in enumerate(flat):
        out[i] = np.asarray(Image.fromarray(plane).resize(size[::-1], Image.Resampling.BOX))
    return np.ascontiguousarray(np.moveaxis(out.reshape(*lead, *size), (-2, -1), (h_axis, w_axis)))


class DownscaledImages(gym.ObservationWrapper):
    """A plain env whose observation holds an image larger than ``max_side`` a side, with it
    downscaled (:class:`ImageResizer`)."""

    def __init__(self, env: gym.Env, max_side: int):
        super().__init__(env)
        self.resizer = ImageResizer(env.observation_space, max_side)
        self.observation_space = self.resizer.space

    def observation(self, observation: Any) -> Any:
        return self.resizer(observation)


class DownscaledKeyImages(gym.Wrapper, StructuredEnv):
    """A structured env with each step key's large images downscaled (:class:`ImageResizer`
    per key): who acts decides which key's observation a step returns."""

    def __init__(self, env: StructuredEnv, max_side: int):
        super().__init__(env)
        self.resizers = {k: ImageResizer(s, max_side) for k, s in env.observation_spaces.items()}
        self.observation_spaces = {k: r.space for k, r in self.resizers.items()}
        self.action_spaces = dict(env.action_spaces)
        self.observation_space = self.observation_spaces[min(self.observation_spaces)]
        self.n_agents = int(env.n_agents)

    def observation_of(self, step_key: int, observation: Any) -> Any:
        """A raw observation of ``step_key`` with its images downscaled."""
        return self.resizers[step_key](observation)

    def _next(self, observation: Any) -> Any:
        return self.observation_of(self.env.actor_id().step_key, observation)

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        observation, info = self.env.reset(**kwargs)
        return self._next(observation), info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        """The next actor's observation downscaled; at an episode's end it is passed as it is
        (nobody acts next: a final observation comes from :meth:`final_observation`)."""
        observation, reward, terminated, truncated, info = self.env.step(action)
        if not (terminated or truncated):
            observation = self._next(observation)
        return observation, reward, terminated, truncated, info

    def actor_id(self) -> ActorID:
        return self.env.actor_id()

    def is_actor_done(self) -> bool:
        return self.env.is_actor_done()

    def final_observation(self, agent_id: int) -> tuple[int, Any] | None:
        final = self.env.final_observation(agent_id)
        if final is None:
            return None
        step_key, observation = final
        return step_key, self.observation_of(step_key, observation)


def downscaled(env: gym.Env, max_side: int | None) -> gym.Env:
    """``env`` with its images downscaled to ``max_side`` a side at most, wrapped only where
    one is larger (``None``: as it is)."""
    if max_side is None:
        return env
    if isinstance(env, StructuredEnv):
        wrapped = DownscaledKeyImages(env, max_side)  # type: ignore[arg-type]
        changes = any(r.changes for r in wrapped.resizers.values())
        return wrapped if changes else env
    if not ImageResizer(env.observation_space, max_side).changes:
        return env
    return DownscaledImages(env, max_side)
