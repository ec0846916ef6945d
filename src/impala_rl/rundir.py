"""The run directory's error and lock, low enough that ``plot`` and ``eval`` need nothing
above it."""

from __future__ import annotations

from pathlib import Path
from typing import IO


class RunDirError(RuntimeError):
    """A run directory that is missing or not a run directory."""


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold ``run_dir/.lock`` while the returned file stays open: a second process training
    into the same directory (a resume started while the run still goes) would interleave its
    metrics and overwrite the checkpoints; it is refused instead. The lock goes with the
    process."""
    import fcntl

    lock = open(run_dir / ".lock", "w")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise RunDirError(
            f"{str(run_dir)!r} is in use by another training process; wait for it to end or "
            "train into another directory"
        ) from None
    return lock
