"""Environments for the subprocess-actor tests that crash on purpose.

Importable as ``fault_envs:make_crashing_env`` for :class:`impala_rl.envs.EnvFactory`.
pytest puts ``tests/`` on ``sys.path`` (rootdir-relative "prepend" import mode: ``tests/`` has
no ``__init__.py``); actor processes started with ``forkserver`` or ``spawn`` inherit the
parent's ``sys.path``, so they can import this module too. Subprocesses started with
``subprocess.Popen`` need ``PYTHONPATH=tests``.

The factory is a module-level function, so :class:`impala_rl.envs.EnvFactory` (and the
function itself) pickle by reference.
"""

from __future__ import annotations

import gymnasium as gym

# Env instances built by this module in the current process, in creation order. Inside an
# actor process the vector env builds its envs in index order 0..N-1, so the k-th instance
# created there is ``env k`` (the factory probe envs are built in the learner process).
_instances_created = 0


class CrashAfter(gym.Wrapper):
    """CartPole whose ``step`` raises ``RuntimeError`` on this instance's ``crash_after``-th step.

    Steps are counted per instance across episodes (resets do not count).
    """

    def __init__(self, env: gym.Env, crash_after: int, message: str):
        super().__init__(env)
        self.crash_after = crash_after
        self.message = message
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps >= self.crash_after:
            raise RuntimeError(f"{self.message} (after {self.steps} steps)")
        return self.env.step(action)


def make_crashing_env(
    crash_after: int = 50,
    crash_instance: int | None = None,
    message: str = "deliberate test crash",
) -> gym.Env:
    """CartPole that raises after ``crash_after`` steps.

    ``crash_instance``: only the instance with this creation index in the current process
    crashes (``None``: every instance does).
    """
    global _instances_created
    index = _instances_created
    _instances_created += 1
    env = gym.make("CartPole-v1")
    if crash_instance is None or index == crash_instance:
        return CrashAfter(env, crash_after, message)
    return env


def make_env_dying_at_start(parent_pid: int) -> gym.Env:
    """CartPole, but a process other than ``parent_pid`` (an actor) exits as it builds it: an
    actor that dies before it comes up, at every restart."""
    import os

    if os.getpid() != parent_pid:
        os._exit(3)
    return gym.make("CartPole-v1")
