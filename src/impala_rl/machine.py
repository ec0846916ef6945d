"""What this process may run on: the cores its affinity allows (``taskset``, a container's
cpuset), not every core of the machine; and how torch's idle threads wait for work."""

from __future__ import annotations

import os
import sys
import time


def available_cores() -> int:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def idle_cores(seconds: float = 0.2) -> float:
    """The cores this process may run on that other processes leave idle, measured over
    ``seconds`` while this one sleeps (Linux's ``/proc/stat``; elsewhere all of them). A
    learner thread on a core another process keeps busy makes every op of its team wait."""
    try:
        cpus = os.sched_getaffinity(0)
        before = _cpu_times(cpus)
        time.sleep(seconds)
        after = _cpu_times(cpus)
    except (AttributeError, OSError, ValueError):  # not Linux, or no /proc
        return float(available_cores())
    idle = 0.0
    for cpu, (idle_1, total_1) in after.items():
        idle_0, total_0 = before.get(cpu, (idle_1, total_1))
        elapsed = total_1 - total_0
        idle += (idle_1 - idle_0) / elapsed if elapsed > 0 else 1.0
    return min(float(len(cpus)), idle) if after else float(len(cpus))


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """Each of ``cpus``' idle and total time so far (``/proc/stat``'s ticks)."""
    times = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return times


OMP_WAIT_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
"""The environment variables that tell libgomp how its idle threads wait."""
OMP_SPIN_COUNT = 30_000
"""Rounds an idle OpenMP thread of torch's spins before it sleeps (libgomp's default: 300,000).
Where other processes want the cores (the actors, a second run) a spinning learner thread holds
one they wait for: pong_appo's learner batch beside 2 busy processes on 2 cores took 0.78 of
the default's time, 1.02x it on a quiet machine (``benchmarks/omp_wait.py``)."""


def set_omp_spin_count() -> None:
    """Give torch's OpenMP threads :data:`OMP_SPIN_COUNT` unless the user set how they wait.
    libgomp reads it once, when torch is loaded: a process that imported torch already keeps
    what it had."""
    if "torch" in sys.modules or any(key in os.environ for key in OMP_WAIT_SETTINGS):
        return
    os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
