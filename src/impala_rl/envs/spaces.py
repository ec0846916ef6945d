"""The bottom of :mod:`impala_rl.envs`: its error type and the model's view of a space.

An observation reaches the model as one ``Box`` (an image stays ``uint8``, anything
else becomes a float32 vector), or, for a ``Dict`` observation, as a ``Dict`` that keeps its
structure (:func:`dict_model_space`): an image entry stays a ``uint8`` image (channels first),
a ``Discrete`` entry an index, every other entry a float32 vector; ``Text`` entries are left
out.

Every env module imports from here and from nothing above it, so the package has no cycle.
"""

from __future__ import annotations

import logging
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class EnvError(RuntimeError):
    """An environment that cannot be built or used; the message says which and why."""


def _is_image(space: spaces.Space) -> bool:
    return isinstance(space, spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def _unflattenable(space: spaces.Space) -> str:
    """Which entries of a Dict or Tuple space cannot be flattened to numbers (e.g. ``Text``)."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        items = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space)
        bad = []
        for key, sub in items:
            try:
                spaces.flatten_space(sub)
            except NotImplementedError:
                bad.append(f"{key!r} ({type(sub).__name__})")
        if bad:
            return f"entries {', '.join(bad)} cannot be flattened to numbers"
    return f"{type(space).__name__} cannot be flattened to numbers"


def model_observation_space(space: spaces.Space) -> spaces.Box:
    """The ``Box`` the model receives for an env's observation space."""
    if _is_image(space):
        return space  # type: ignore[return-value]
    if isinstance(space, spaces.Box) and len(space.shape) == 1 and space.dtype == np.float32:
        return space
    try:
        flat = spaces.flatten_space(space)
    except NotImplementedError as exc:
        raise EnvError(
            f"observation space {space} is not supported: {str(exc) or _unflattenable(space)}"
        ) from None
    if not isinstance(flat, spaces.Box):
        raise EnvError(f"observation space {space} does not flatten to a Box")
    return spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32), dtype=np.float32)


def _channels_last(space: spaces.Space) -> bool:
    """An ``[H, W, C]`` image (C at most 4, smaller than H and W), as MiniGrid's."""
    if not _is_image(space):
        return False
    h, w, c = space.shape
    return c <= 4 and c < min(h, w)


def _entry_space(space: spaces.Space) -> spaces.Space:
    """The model's view of one Dict entry (see :func:`dict_model_space`)."""
    if isinstance(space, spaces.Discrete):
        return spaces.Discrete(int(space.n))
    if _channels_last(space):
        low, high = (np.moveaxis(b, -1, 0) for b in (space.low, space.high))
        return spaces.Box(low, high, dtype=np.uint8)
    return model_observation_space(space)


def dict_model_space(space: spaces.Dict) -> tuple[spaces.Dict, list[str]]:
    """The model's ``Dict`` for a Dict observation space and the entries it leaves out.

    An image entry (``uint8 [C, H, W]``; ``[H, W, C]`` is moved channels first) stays a
    ``uint8`` image, a ``Discrete`` entry is its index (``Discrete(n)`` from 0), any other
    entry a float32 vector (flattened); entries that are not numbers (``Text``) are left out.
    """
    kept: dict[str, spaces.Space] = {}
    dropped: list[str] = []
    for name, sub in space.spaces.items():
        try:
            if isinstance(sub, spaces.Text):  # Gymnasium flattens it to character indices
                raise NotImplementedError
            spaces.flatten_space(sub)
        except NotImplementedError:
            dropped.append(f"{name!r} ({type(sub).__name__})")
            continue
        kept[str(name)] = _entry_space(sub)
    if not kept:
        raise EnvError(
            f"observation space {space} is not supported: no entry can be given to the model "
            f"({', '.join(dropped)} are not numbers)"
        )
    return spaces.Dict(kept), dropped


def keeps_structure(space: spaces.Space) -> bool:
    """Whether an observation space reaches the model as a ``Dict``."""
    return isinstance(space, spaces.Dict)


class ObservationConverter:
    """One observation space as the model takes it (``space``): the ``Box`` of
    :func:`model_observation_space`, or for a Dict the ``Dict`` of :func:`dict_model_space`
    (``dropped``: the entries it leaves out). Called on an observation, it returns the model's
    form: an array, or a dict of arrays."""

    def __init__(self, source: spaces.Space):
        self.source = source
        self.dropped: list[str] = []
        self._entries: dict[str, spaces.Space] = {}
        self.space: spaces.Space
        if keeps_structure(source):
            self.space, self.dropped = dict_model_space(source)  # type: ignore[arg-type]
            self._entries = dict(source.spaces)  # type: ignore[attr-defined]
        else:
            self.space = model_observation_space(source)
        self.identity = self.space is source

    def __call__(self, observation: Any) -> Any:
        if self.identity:
            return observation
        if self._entries:
            return {
                name: self._entry(self._entries[name], sub, observation[name])
                for name, sub in self.space.spaces.items()  # type: ignore[attr-defined]
            }
        if isinstance(self.source, spaces.Box):
            return np.asarray(observation, dtype=np.float32).reshape(-1)
        return spaces.flatten(self.source, observation).astype(np.float32)

    @staticmethod
    def _entry(source: spaces.Space, target: spaces.Space, value: Any) -> np.ndarray:
        if isinstance(target, spaces.Discrete):
            return np.asarray(int(value) - int(source.start), dtype=np.int64)
        if _channels_last(source):
            return np.ascontiguousarray(np.moveaxis(np.asarray(value, dtype=np.uint8), -1, 0))
        if target is source:
            return np.asarray(value, dtype=target.dtype)
        if isinstance(source, spaces.Box):
            return np.asarray(value, dtype=np.float32).reshape(-1)
        return spaces.flatten(source, value).astype(np.float32)


class ModelObservation(gym.ObservationWrapper):
    """Presents a plain env's observations as the model takes them
    (:class:`ObservationConverter`)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._convert = ObservationConverter(env.observation_space)
        self.observation_space = self._convert.space
        self.dropped = self._convert.dropped

    def observation(self, observation: Any) -> Any:
        return self._convert(observation)


def log_dropped_entries(env_id: str, dropped: list[str], step_key: int | None = None) -> None:
    """One line naming the Dict entries the model does not read (``Text``), if any (of step
    key ``step_key`` in a structured env)."""
    if dropped:
        where = env_id if step_key is None else f"{env_id}, step key {step_key}"
        logging.getLogger(__name__).warning(
            "env.id=%s: the observation entries %s are not numbers; the model does not read them",
            where,
            ", ".join(dropped),
        )
