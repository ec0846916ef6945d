"""MinAtar (Young & Tian, 2019): miniature Atari games on a 10x10 grid, fast enough for
learning tests on a laptop.

Use an id such as ``env.id=MinAtar/Breakout-v1`` (the factory registers the MinAtar ids).
MinAtar observes ``bool [10, 10, n_channels]`` (one channel per object kind, channels-last);
:class:`MinAtarObservation` turns that into ``uint8 [n_channels, 10, 10]`` with values 0 and
255, so MinAtar frames take the same image path as Atari frames (the CNN encoders scale
``uint8`` by 1/255). ``model.encoder=minatar_cnn`` is the MinAtar paper's network.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from impala_rl.envs.spaces import EnvError

PREFIX = "MinAtar/"


class MinAtarObservation(gym.ObservationWrapper):
    """``bool [H, W, C]`` -> ``uint8 [C, H, W]`` in {0, 255}."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        if not (isinstance(space, spaces.Box) and len(space.shape) == 3):
            raise EnvError(f"MinAtar observation space {space} is not an [H, W, C] Box")
        h, w, c = space.shape
        self.observation_space = spaces.Box(0, 255, (c, h, w), dtype=np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        frame = np.asarray(observation, dtype=np.uint8).transpose(2, 0, 1)
        return np.ascontiguousarray(frame) * np.uint8(255)


def register_minatar() -> None:
    """Register the ``MinAtar/...`` Gymnasium ids (needs ``pip install 'impala-rl[minatar]'``)."""
    try:
        import minatar.gym
    except ImportError:
        raise EnvError(
            "MinAtar needs the minatar package: pip install 'impala-rl[minatar]'"
        ) from None
    if not any(env_id.startswith(PREFIX) for env_id in gym.registry):
        minatar.gym.register_envs()


def make_minatar_env(env_id: str, **kwargs: Any) -> gym.Env:
    """The MinAtar game ``env_id`` (e.g. ``MinAtar/Breakout-v1``) with channels-first uint8
    observations; ``kwargs`` go to ``gymnasium.make`` (e.g. ``sticky_action_prob``)."""
    register_minatar()
    try:
        env = gym.make(env_id, **kwargs)
    except gym.error.Error as exc:
        raise EnvError(f"env.id {env_id!r}: {exc}") from None
    except TypeError as exc:
        raise EnvError(f"env.kwargs for {env_id!r}: {exc}") from None
    return MinAtarObservation(env)
