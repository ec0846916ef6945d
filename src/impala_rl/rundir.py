"""The run directory's error, low enough that ``plot`` and ``eval`` need nothing above it."""

from __future__ import annotations


class RunDirError(RuntimeError):
    """A run directory that is missing or not a run directory."""
