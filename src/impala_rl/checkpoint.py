"""Checkpoints: atomic writes, and loading that never unpickles arbitrary objects.

A checkpoint is a dict of tensors and plain Python values (numbers, strings, lists, dicts),
saved with ``torch.save`` and read with ``torch.load(weights_only=True)``, which refuses any
other object: a crafted file cannot run code. Writes go to a temporary file in the same
directory, are flushed to disk, then renamed over the old file, so a crash leaves the last
good checkpoint.
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_FORMAT = 1
TEMP_SUFFIX = ".tmp"  # a write in progress: .<name>.<pid>.<random>.tmp beside <name>


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or of an unknown format."""


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """Write ``obj`` to ``path`` atomically (temp file, fsync, rename).

    The temp file's name is chosen before the file exists, so an interruption anywhere (a
    Ctrl-C landing just after the file is created) removes it; a hard kill can leave one,
    which :func:`remove_temporaries` clears when the run starts again.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_temporaries(directory: str | Path) -> list[str]:
    """Remove the temp files that a killed write left in ``directory``; returns their names.
    Only for a directory that nothing writes to meanwhile (a run's, under its lock)."""
    removed = []
    for stale in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)
        removed.append(stale.name)
    return sorted(removed)


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` (tensors and plain values only)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt file can raise anything (IndexError, KeyError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be loaded safely: {first}"
        ) from None
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not an impala-rl checkpoint of format {CHECKPOINT_FORMAT}"
        )
    return data


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as plain values and tensors."""
    np_state = np.random.get_state()
    return {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_gauss": [int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    has_gauss, gauss = state["numpy_gauss"]
    np.random.set_state(("MT19937", keys, state["numpy_pos"], has_gauss, gauss))
    torch.set_rng_state(state["torch"])
