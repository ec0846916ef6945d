"""envpool (a C++ vector env) behind the same-step vector-env contract of the actor loop.

``env.vector=envpool`` (or ``auto``, where it times faster on the machine: see
:meth:`~impala_rl.envs.factory.EnvFactory.resolve_vector`) steps an actor's envs in envpool
instead of Python. envpool resets an env on the step *after* its episode ends (ignoring that
step's action); :class:`EnvpoolVectorEnv` resets it on the same step instead, as
:class:`~impala_rl.envs.vector.SameStepVectorEnv` does: the step that ends an episode returns
the next episode's first observation and keeps the final one in ``info["final_obs"]``
(truncation bootstraps from its value). envpool seeds its envs when it is built, so a reset
with a new seed rebuilds the pool (env ``i`` gets ``seed + i``). Needs the ``envpool`` extra:
``pip install 'impala-rl[envpool]'``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from impala_rl.envs.spaces import EnvError


def _cartpole(obs: np.ndarray) -> np.ndarray:
    return (np.abs(obs[:, 0]) > 2.4) | (np.abs(obs[:, 2]) > 12 * 2 * math.pi / 360)


def _acrobot(obs: np.ndarray) -> np.ndarray:
    cos1, sin1, cos2, sin2 = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
    return -cos1 - (cos1 * cos2 - sin1 * sin2) > 1.0


def _never(obs: np.ndarray) -> np.ndarray:
    return np.zeros(len(obs), dtype=bool)


# Gymnasium ids envpool steps with the same dynamics, rewards and time limits, each with the
# Gymnasium env's termination test on an observation: envpool reports a termination on the
# time limit's last step as a truncation, which would bootstrap where Gymnasium does not.
TERMINAL: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "CartPole-v0": _cartpole,
    "CartPole-v1": _cartpole,
    "Acrobot-v1": _acrobot,
    "MountainCar-v0": lambda obs: (obs[:, 0] >= 0.5) & (obs[:, 1] >= 0),
    "MountainCarContinuous-v0": lambda obs: (obs[:, 0] >= 0.45) & (obs[:, 1] >= 0),
    "Pendulum-v1": _never,
}
SUPPORTED_IDS = tuple(TERMINAL)
INSTALL = "pip install 'impala-rl[envpool]'"


def envpool_installed() -> bool:
    try:
        import envpool  # noqa: F401
    except ImportError:
        return False
    return True


class EnvpoolVectorEnv:
    """``num_envs`` copies of ``env_id`` in one envpool, with same-step autoreset.

    Observations ``[num_envs, *obs_shape]``; ``step`` takes actions ``[num_envs, ...]`` and
    returns fresh arrays (nothing is reused between calls).
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        kwargs: dict[str, Any] | None = None,
        max_episode_steps: int | None = None,
        num_threads: int = 1,
    ):
        if env_id not in SUPPORTED_IDS:
            raise EnvError(
                f"env.vector=envpool does not support env.id {env_id!r}; "
                f"valid ids: {', '.join(SUPPORTED_IDS)} (or env.vector=python)"
            )
        try:
            import envpool
        except ImportError:
            raise EnvError(f"env.vector=envpool needs envpool: {INSTALL}") from None
        self._envpool = envpool
        self.env_id = env_id
        self.num_envs = num_envs
        self._options = dict(kwargs or {})
        if max_episode_steps is not None:
            self._options["max_episode_steps"] = max_episode_steps
        self._threads = num_threads
        self._terminal = TERMINAL[env_id]
        self._seed: int | None = None
        self._pool: Any = None
        self._build(0)
        self.single_observation_space = self._pool.observation_space
        self.single_action_space = self._pool.action_space

    def _build(self, seed: int) -> None:
        if self._pool is not None:
            self._pool.close()
        seed %= 2**31 - 1 - self.num_envs  # envpool's seeds are C ints
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._pool = self._envpool.make_gymnasium(
                    self.env_id,
                    num_envs=self.num_envs,
                    batch_size=self.num_envs,
                    num_threads=self._threads,
                    seed=seed,
                    **self._options,
                )
                # built lazily; their Box bounds are float64, cast to float32 with a warning
                self._pool.observation_space, self._pool.action_space  # noqa: B018
        except (TypeError, ValueError, RuntimeError) as exc:
            raise EnvError(
                f"env.kwargs for {self.env_id!r} with env.vector=envpool: {exc}"
            ) from None
        self._seed = seed

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None and seed != self._seed:
            self._build(seed)
        obs, _ = self._pool.reset()
        return obs, {}

    def step(
        self, actions: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self._pool.step(np.asarray(actions))
        order = info["env_id"]
        if not np.array_equal(order, np.arange(self.num_envs)):  # sync mode keeps the order
            raise EnvError(f"envpool returned envs in the order {order.tolist()}")
        out: dict[str, Any] = {}
        done = np.logical_or(terminated, truncated)
        if truncated.any():
            ended = truncated & ~terminated & self._terminal(obs)
            terminated = terminated | ended
        if done.any():
            idx = np.flatnonzero(done)
            final = obs.copy()  # rows of envs still running are masked out by _final_obs
            first, reset_info = self._pool.reset(idx.astype(np.int32))
            if not np.array_equal(reset_info["env_id"], idx):
                raise EnvError(f"envpool reset envs {reset_info['env_id'].tolist()}, not {idx}")
            obs[idx] = first
            out["final_obs"], out["_final_obs"] = final, done
        return obs, reward.astype(np.float64), terminated, truncated, out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
