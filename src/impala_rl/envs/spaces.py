"""The bottom of :mod:`impala_rl.envs`: its error type and the model's view of a space.

Every env module imports from here and from nothing above it, so the package has no cycle.
"""

from __future__ import annotations

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


class ModelObservation(gym.ObservationWrapper):
    """Presents any observation as the ``Box`` of :func:`model_observation_space`."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._source = env.observation_space
        self.observation_space = model_observation_space(env.observation_space)
        self._identity = self.observation_space is self._source

    def observation(self, observation: Any) -> Any:
        if self._identity:
            return observation
        if isinstance(self._source, spaces.Box):
            return np.asarray(observation, dtype=np.float32).reshape(-1)
        return spaces.flatten(self._source, observation).astype(np.float32)
