"""Where each env in its own process pays: raw stepping of an actor's copies of an env with
``env.vector=async`` (Gymnasium's ``AsyncVectorEnv``) against ``python`` (one after the other),
beside the step time the start-up probe measures, which decides between them
(``impala_rl.env_defaults.SLOW_STEP_S``).

    PYTHONPATH=src python benchmarks/async_envs.py                     # the set below
    PYTHONPATH=src python benchmarks/async_envs.py Ant-v5 --spin-ms 0 0.5 1 --copies 16

``--spin-ms`` adds a busy loop of that many milliseconds to each step of every env given: a
slower env with the same observations and info dicts. The two ways alternate, ``--repeats``
times each; the ratio is async's steps per second over python's, medians of the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import gymnasium as gym

ENVS = ["Hopper-v5", "Ant-v5", "Humanoid-v5", "CarRacing-v3"]
SPIN_MS = [0.0, 0.3, 0.6, 1.1, 1.6]  # for the first MuJoCo env in the set: Ant


class BusyStep(gym.Wrapper):
    """``env`` with a busy loop of ``spin_s`` after each step (CPU time, as a simulator's)."""

    def __init__(self, env: gym.Env, spin_s: float):
        super().__init__(env)
        self.spin_s = spin_s

    def step(self, action):
        out = self.env.step(action)
        end = time.perf_counter() + self.spin_s
        while time.perf_counter() < end:
            pass
        return out


def busy(env_id: str, spin_s: float) -> gym.Env:
    """The env factory for ``env.id=async_envs:busy`` (found on the path of this script)."""
    return BusyStep(gym.make(env_id), float(spin_s))


def measure(overrides: list[str], copies: int, seconds: float, repeats: int) -> dict:
    from impala_rl.config import merge_config
    from impala_rl.env_defaults import step_seconds
    from impala_rl.envs import EnvFactory
    from impala_rl.envs.factory import steps_per_second

    rates: dict[str, list[float]] = {"python": [], "async": []}
    for _ in range(repeats):
        for vector in rates:
            env_cfg = merge_config(overrides=[*overrides, f"env.vector={vector}"]).env
            rates[vector].append(steps_per_second(EnvFactory.of(env_cfg), copies, seconds))
    probe = EnvFactory.of(merge_config(overrides=overrides).env)()
    try:
        probed = step_seconds(probe)
    finally:
        probe.close()
    return {"probe_ms": probed * 1e3, **rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("envs", nargs="*", help=f"env ids (default: {' '.join(ENVS)})")
    parser.add_argument("--spin-ms", type=float, nargs="*", default=None)
    parser.add_argument("--copies", type=int, default=8, help="an actor's envs (any_env: 8)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for async_envs:busy
    # (env id, busy milliseconds added to its step; 0: the env as it is)
    if args.envs:
        cases = [(env_id, spin) for env_id in args.envs for spin in args.spin_ms or [0.0]]
    else:
        cases = [(env_id, 0.0) for env_id in ENVS] + [(ENVS[1], s) for s in SPIN_MS if s]
    print(f"{os.cpu_count()} cores, {args.copies} copies, {args.seconds:g} s x {args.repeats}")
    print("| env | probed step (ms) | python (steps/s) | async (steps/s) | async / python |")
    print("| --- | --- | --- | --- | --- |")
    for env_id, spin in cases:
        if spin:
            name = f"{env_id} + {spin:g} ms busy"
            overrides = [
                "env.id=async_envs:busy",
                f"env.kwargs.env_id={env_id}",
                f"env.kwargs.spin_s={spin / 1e3}",
            ]
        else:
            name, overrides = env_id, [f"env.id={env_id}"]
        r = measure(overrides, args.copies, args.seconds, args.repeats)
        py, asy = statistics.median(r["python"]), statistics.median(r["async"])
        runs = " / ".join
        print(
            f"| {name} | {r['probe_ms']:.2f} | {runs(f'{x:.0f}' for x in r['python'])} | "
            f"{runs(f'{x:.0f}' for x in r['async'])} | **{asy / py:.2f}** |",
            flush=True,
        )


if __name__ == "__main__":
    main()
