"""Images as the model reads them: large ones downscaled, float ones as ``uint8``.

A frame rendered at screen size (Gymnasium's ``AddRenderObservation`` of CartPole: 400x600,
PettingZoo's butterfly games: 280x480 and larger) read whole by the Nature CNN gives a first
dense layer of ~10^8 weights, and every batch of them hundreds of megabytes: a run of a few
steps a second. An image whose longer side exceeds ``max_side`` (``env.max_image_side``) is
averaged down (Pillow's box filter: each pixel the mean of the source pixels whose centres it
covers), keeping its aspect ratio, until that side is ``max_side`` long, in the env's own
layout (:func:`~impala_rl.envs.spaces.image_layout`; a stack of frames frame by frame).

An image of floats (``env.float_images``: a float ``Box`` shaped as an image with finite bounds,
as a camera normalized by the env to ``[0, 1]`` or ``[-1, 1]``) becomes the ``uint8`` image of
the same pixels (``(x - low) / (high - low)`` of 255, rounded), so it is read by a CNN, as an
image is, and stored in a quarter of the memory; flattened, it would be an MLP's 10^4-10^5
inputs. ``env.float_image_bounds=unit`` takes only bounds ``[0, 1]`` and ``[0, 255]``, as runs
saved before other bounds were read did.

Both happen before anything else reads the observation. Every other observation, and every
``uint8`` image within the size, passes unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from PIL import Image

from impala_rl.envs.spaces import MIN_IMAGE_SIDE, image_layout, shape_layout
from impala_rl.envs.structured import ActorID, StructuredEnv

_SIDES = {"hw": (0, 1), "hwc": (0, 1), "chw": (1, 2), "nhwc": (1, 2), "nchw": (2, 3)}
"""Where the height and width of an image of each layout are."""

_CHANNELS = {"hwc": 2, "chw": 0, "nhwc": 3, "nchw": 1}


def downscaled_side(height: int, width: int, max_side: int) -> tuple[int, int]:
    """``(height, width)`` scaled so that the longer side is ``max_side`` (unchanged if it is
    not longer), the shorter rounded, at least 1."""
    longer = max(height, width)
    if longer <= max_side:
        return height, width
    scale = max_side / longer
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass(frozen=True)
class ImageReading:
    """How images reach the model: ``max_side`` (``None``: any size), whether a float
    image becomes a ``uint8`` one (``floats``) and which bounds such an image may have
    (``float_bounds``, :data:`FLOAT_IMAGE_BOUNDS`)."""

    max_side: int | None = None
    floats: bool = False
    float_bounds: str = "finite"

    def converter(self, source: spaces.Space) -> ImageConverter | None:
        """The converter of ``source``'s observations, or ``None`` where nothing changes."""
        converter = ImageConverter(source, self)
        return converter if converter.changes else None


FLOAT_IMAGE_BOUNDS = ("finite", "unit")
"""The bounds a float image may have (``env.float_image_bounds``): any finite ones, low below
high; or ``[0, 1]`` and ``[0, 255]`` throughout only."""

PixelMap = tuple[float | np.ndarray, float | np.ndarray]
"""``(low, scale)``: a float pixel ``x`` is the ``uint8`` pixel ``rint((x - low) * scale)``
(numbers, or arrays of the image's shape where its bounds vary by pixel)."""


def float_image_pixels(space: spaces.Space, bounds: str = "finite") -> PixelMap | None:
    """What turns a float image's pixels into ``uint8`` ones: its bounds stretched over
    0-255 (``(0, 255)`` for ``[0, 1]``, ``(0, 1)`` for ``[0, 255]``, ``(-1, 127.5)`` for
    ``[-1, 1]``); ``None``: not a float image (another dtype, bounds that are not finite with
    low below high, or with ``bounds="unit"`` other than ``[0, 1]`` or ``[0, 255]``
    throughout, or not shaped as an image: at most 4 channels, first or last, and at least
    :data:`~impala_rl.envs.spaces.MIN_IMAGE_SIDE` pixels a side)."""
    if not isinstance(space, spaces.Box) or np.dtype(space.dtype).kind != "f":
        return None
    layout = shape_layout(space.shape)
    if layout is None:
        return None
    h_axis, w_axis = _SIDES[layout]
    if min(space.shape[h_axis], space.shape[w_axis]) < MIN_IMAGE_SIDE:
        return None
    if layout in _CHANNELS and space.shape[_CHANNELS[layout]] > 4:
        return None
    low, high = space.low.astype(np.float64), space.high.astype(np.float64)
    if bounds == "unit":
        if not np.all(low == 0) or not (np.all(high == 1) or np.all(high == 255)):
            return None
    elif not (np.all(np.isfinite(low)) and np.all(np.isfinite(high)) and np.all(low < high)):
        return None
    scale = 255.0 / (high - low)
    if np.all(low == low.flat[0]) and np.all(high == high.flat[0]):
        return float(low.flat[0]), float(scale.flat[0])
    return low.astype(np.float32), scale.astype(np.float32)


class ImageConverter:
    """The images of one observation space, at any depth of a ``Dict`` or ``Tuple``, as an
    :class:`ImageReading` has them (``space``: the space it makes; ``changes``: whether any
    image changes). Called on an observation of ``source``, it returns one of ``space``.

    What each entry needs is worked out once, here: a step converts the images and passes
    every other entry, and every unchanged Dict or Tuple, as it is."""

    def __init__(self, source: spaces.Space, reading: ImageReading):
        self.source = source
        self.reading = reading
        self.space, self._convert = self._compile(source)
        self.changes = self._convert is not None

    def __call__(self, observation: Any) -> Any:
        return observation if self._convert is None else self._convert(observation)

    def _compile(self, space: spaces.Space) -> tuple[spaces.Space, Callable[[Any], Any] | None]:
        """``space`` as converted, and what converts a value of it (``None``: nothing)."""
        if isinstance(space, (spaces.Dict, spaces.Tuple)):
            keys = list(space.spaces) if isinstance(space, spaces.Dict) else range(len(space))
            parts = {k: self._compile(space.spaces[k]) for k in keys}
            steps = {k: step for k, (_, step) in parts.items() if step is not None}
            if not steps:
                return space, None

            def convert(value: Any) -> Any:
                items = ((k, steps[k](value[k]) if k in steps else value[k]) for k in keys)
                return dict(items) if isinstance(space, spaces.Dict) else tuple(v for _, v in items)

            inner = {k: part for k, (part, _) in parts.items()}
            as_space = (
                spaces.Dict(inner)
                if isinstance(space, spaces.Dict)
                else spaces.Tuple(list(inner.values()))
            )
            return as_space, convert
        layout = image_layout(space)
        pixels = None
        if layout is None and self.reading.floats:
            pixels = float_image_pixels(space, self.reading.float_bounds)
            layout = None if pixels is None else shape_layout(space.shape)
        if layout is None:
            return space, None
        shape = list(space.shape)
        max_side = self.reading.max_side
        if max_side is not None:
            h_axis, w_axis = _SIDES[layout]
            shape[h_axis], shape[w_axis] = downscaled_side(shape[h_axis], shape[w_axis], max_side)
        if pixels is None and tuple(shape) == space.shape:
            return space, None
        low, high = (0, 255) if pixels is not None else (np.min(space.low), np.max(space.high))
        converted = spaces.Box(int(low), int(high), tuple(shape), dtype=np.uint8)
        return converted, functools.partial(
            _to_image, layout=layout, pixels=pixels, max_side=max_side
        )


def _to_image(value: Any, layout: str, pixels: PixelMap | None, max_side: int | None) -> np.ndarray:
    """One image leaf's value as a ``uint8`` image of ``layout`` (floats mapped by ``pixels``,
    rounded; one that is ``uint8`` already as it is), downscaled to ``max_side``."""
    value = np.asarray(value)
    if pixels is None or value.dtype == np.uint8:
        image = value.astype(np.uint8, copy=False)
    else:
        low, scale = pixels  # Python floats keep the float32 arrays' dtype
        floats = value.astype(np.float32, copy=False)
        if not isinstance(low, float) or low:
            floats = floats - low
        image = np.clip(np.rint(floats * scale), 0, 255).astype(np.uint8)
    return image if max_side is None else downscale(image, layout, max_side)


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


def conversions(source: spaces.Space, converted: spaces.Space, path: str = "") -> list[str]:
    """What an :class:`ImageConverter` changes, one phrase per image (``"'camera' 400x600x3 ->
    85x128x3"``, ``"the observation float 40x40x3 -> uint8"``), for the start-up log."""
    if converted is source:
        return []
    if isinstance(source, (spaces.Dict, spaces.Tuple)):
        keys = source.spaces.keys() if isinstance(source, spaces.Dict) else range(len(source))
        return [
            phrase
            for k in keys
            for phrase in conversions(
                source.spaces[k], converted.spaces[k], f"{path}/{k}" if path else str(k)
            )
        ]
    where = f"{path!r}" if path else "the observation"
    floats = "float " if source.dtype != np.uint8 else ""
    shape_in = "x".join(map(str, source.shape))
    shape_out = "x".join(map(str, converted.shape))
    change = f"{shape_in} -> {shape_out}" if shape_in != shape_out else shape_in
    return [f"{where} {floats}{change}{' as uint8' if floats else ''}"]


class ConvertedImages(gym.ObservationWrapper):
    """A plain env whose images are converted (:class:`ImageConverter`)."""

    def __init__(self, env: gym.Env, converter: ImageConverter):
        super().__init__(env)
        self.converter = converter
        self.observation_space = converter.space

    def observation(self, observation: Any) -> Any:
        return self.converter(observation)

    def conversions(self) -> list[str]:
        """What the model reads changed, one phrase per image (:func:`conversions`)."""
        return conversions(self.converter.source, self.converter.space)


class ConvertedKeyImages(gym.Wrapper, StructuredEnv):
    """A structured env whose step keys' images are converted (an :class:`ImageConverter`
    per key): who acts decides which key's observation a step returns."""

    def __init__(self, env: StructuredEnv, converters: dict[int, ImageConverter]):
        super().__init__(env)
        self.converters = converters
        self.observation_spaces = {k: c.space for k, c in converters.items()}
        self.action_spaces = dict(env.action_spaces)
        self.observation_space = self.observation_spaces[min(self.observation_spaces)]
        self.n_agents = int(env.n_agents)

    def observation_of(self, step_key: int, observation: Any) -> Any:
        """A raw observation of ``step_key`` with its images converted (an observation
        converted already passes unchanged)."""
        return self.converters[step_key](observation)

    def conversions(self) -> list[str]:
        """What the model reads changed, per step key and image (:func:`conversions`)."""
        return [
            f"step key {k}: {phrase}"
            for k, c in sorted(self.converters.items())
            for phrase in conversions(c.source, c.space)
        ]

    def _next(self, observation: Any) -> Any:
        return self.observation_of(self.env.actor_id().step_key, observation)

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        observation, info = self.env.reset(**kwargs)
        return self._next(observation), info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        """The next actor's observation converted; at an episode's end it is passed as it is
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


def converted_images(env: gym.Env, reading: ImageReading) -> gym.Env:
    """``env`` with its images read as ``reading`` says, wrapped only where one changes."""
    if isinstance(env, StructuredEnv):
        converters = {k: ImageConverter(s, reading) for k, s in env.observation_spaces.items()}
        changes = any(c.changes for c in converters.values())
        return ConvertedKeyImages(env, converters) if changes else env  # type: ignore[arg-type]
    converter = reading.converter(env.observation_space)
    return env if converter is None else ConvertedImages(env, converter)
