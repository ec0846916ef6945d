"""How a learner's OpenMP threads wait, quiet and on a busy machine: ms per batch by wait setting.

    PYTHONPATH=src python benchmarks/omp_wait.py
    PYTHONPATH=src python benchmarks/omp_wait.py --workload env.id=impala_rl.envs.samples:Catch
    PYTHONPATH=src python benchmarks/omp_wait.py --settings default GOMP_SPINCOUNT=10000

PyTorch's CPU build runs its intra-op threads on libgomp, whose idle threads spin (300,000
rounds by default) before they sleep. On a machine the run has to itself that saves a wake-up
per op; when other processes want the cores (a second run, the actors, a test suite) a spinning
thread holds a core the others wait for, and a learner with 2 threads can take several times as
long as with one. libgomp reads its settings when it is loaded, so each setting is timed in a
new process: ``benchmarks/batch_update.py WORKLOAD`` (the preset's learner batch, its own
thread count) with the setting in its environment, the settings alternating over ``--rounds``,
once quiet and once beside ``--load`` processes that each keep a core busy. Prints each
setting's median ms per batch and spread (min-max over the rounds' medians) and its ratio to
the first setting under the same load.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from impala_rl.machine import OMP_WAIT_SETTINGS, available_cores

HERE = Path(__file__).resolve().parent
PER_BATCH = re.compile(r": ([0-9.]+) ms per batch")


def spinner() -> subprocess.Popen:
    """A process that keeps one core busy (another run's work, as far as a learner can tell)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def batch_ms(workload: str, setting: str, repeats: int) -> float:
    """The median ms per batch of ``batch_update.py workload`` in a new process whose
    environment has ``setting`` (``KEY=VALUE``; ``default``: none)."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_WAIT_SETTINGS}
    if setting != "default":
        key, value = setting.split("=", 1)
        env[key] = value
    out = subprocess.run(
        [sys.executable, str(HERE / "batch_update.py"), workload, "--repeats", str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    found = PER_BATCH.search(out)
    if found is None:
        raise RuntimeError(f"no 'ms per batch' in batch_update.py's output:\n{out}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="pong_appo", help="batch_update.py's preset")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["default", "OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=30000"],
        help="libgomp environment settings (KEY=VALUE or default); the first is the baseline",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8, help="batches timed per process")
    parser.add_argument(
        "--load", type=int, default=available_cores(), help="busy processes of the busy case"
    )
    args = parser.parse_args()
    for load in (0, args.load):
        spinners = [spinner() for _ in range(load)]
        try:
            times: dict[str, list[float]] = {s: [] for s in args.settings}
            for i in range(args.rounds):
                order = args.settings if i % 2 == 0 else args.settings[::-1]
                for setting in order:
                    times[setting].append(batch_ms(args.workload, setting, args.repeats))
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        base = statistics.median(times[args.settings[0]])
        print(f"{args.workload}, {load} busy processes beside it:")
        for setting, ts in times.items():
            median = statistics.median(ts)
            print(
                f"  {setting:28s} {median:8.1f} ms per batch ({min(ts):.1f}-{max(ts):.1f}), "
                f"{median / base:.2f} of {args.settings[0]}"
            )


if __name__ == "__main__":
    main()
