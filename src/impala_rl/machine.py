"""What this process may run on: the cores its affinity allows (``taskset``, a container's
cpuset), not every core of the machine."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
