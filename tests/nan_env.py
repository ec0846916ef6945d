"""Environments that misbehave on purpose, for the trainer and CLI tests.

Importable as ``nan_env:make_nan_env`` / ``nan_env:make_raising_env`` /
``nan_env:make_env_failing_in_further_learners`` /
``nan_env:make_env_stalling_in_further_learners`` for
:class:`impala_rl.envs.EnvFactory` (pytest puts ``tests/`` on ``sys.path``; subprocesses get it
through ``PYTHONPATH``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import gymnasium as gym
import numpy as np


class NaNAfter(gym.Wrapper):
    """CartPole whose observations become NaN from this env instance's ``nan_after``-th step on.

    Steps are counted per instance across episodes (resets do not count), so a fresh instance
    (the probe env, the evaluator's envs) behaves like plain CartPole for ``nan_after`` steps.
    """

    def __init__(self, env: gym.Env, nan_after: int):
        super().__init__(env)
        self.nan_after = nan_after
        self.steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps >= self.nan_after:
            obs = np.full_like(obs, np.nan)
        return obs, reward, terminated, truncated, info


def make_nan_env(nan_after: int = 100) -> gym.Env:
    return NaNAfter(gym.make("CartPole-v1"), nan_after)


def make_raising_env(**kwargs) -> gym.Env:
    raise RuntimeError("this factory always fails")


def make_env_failing_in_further_learners(**kwargs) -> gym.Env:
    """CartPole in the process the user started, an error in any other (with sequential
    actors: in learners 1..N-1 only)."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("this factory fails outside the first learner")
    return gym.make("CartPole-v1")


class StallOnDemand(gym.Wrapper):
    """CartPole whose ``step`` blocks for good once ``stall_file`` exists (after creating
    ``stalled_file``, so a test knows it happened)."""

    def __init__(self, env: gym.Env, stall_file: str, stalled_file: str):
        super().__init__(env)
        self.stall_file, self.stalled_file = Path(stall_file), Path(stalled_file)

    def step(self, action):
        if self.stall_file.exists():
            self.stalled_file.touch()
            threading.Event().wait()
        return self.env.step(action)


def make_env_stalling_in_further_learners(stall_file: str, stalled_file: str) -> gym.Env:
    """CartPole; in learners 1..N-1 and their actor processes CartPole that stalls on demand:
    learner 0 then waits for the others inside a collective."""
    import multiprocessing

    env = gym.make("CartPole-v1")
    names = [multiprocessing.current_process().name]
    if (parent := multiprocessing.parent_process()) is not None:
        names.append(parent.name)
    if any(name.startswith("impala-learner-") for name in names):
        return StallOnDemand(env, stall_file, stalled_file)
    return env
