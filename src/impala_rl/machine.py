"""What this process may run on: the cores its affinity allows (``taskset``, a container's
cpuset), not every core of the machine; and how torch's idle threads wait for work."""

from __future__ import annotations

import os
import sys


def available_cores() -> int:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
