"""multiprocessing's helper processes (the forkserver, the resource tracker), stopped and
joined where this process runs them: left alone, each exits only after it notices that its
parent is gone, so a process would end with them still there (~2 s for the forkserver)."""

from __future__ import annotations

from contextlib import suppress
from multiprocessing import forkserver, resource_tracker
from typing import Any


def _stop(helper: Any) -> None:
    stop = getattr(helper, "_stop", None)  # private (CPython's tests use it); absent: left be
    if stop is not None:
        stop()  # a no-op where the helper is not running


def stop_forkserver() -> None:
    """Stop and join this process's forkserver, if it runs one (a process that was started
    with the resource tracker of its parent leaves that to the parent)."""
    _stop(forkserver._forkserver)


def stop_helper_processes() -> None:
    """Stop and join the forkserver and the resource tracker, where this process runs them."""
    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        _stop(helper)


def stop_helper_processes_quietly() -> None:
    """:func:`stop_helper_processes` where a failure has nobody to go to (at interpreter exit;
    a further learner, which shares the leader's tracker: not its to stop)."""
    with suppress(Exception):
        stop_helper_processes()
