"""How the processes a run starts (actors, inference servers, the evaluation, env workers) take
a signal meant for the run: their stop is the process's that started them.

A terminal's Ctrl-C (SIGINT) reaches the whole process group, so does its hangup (SIGHUP, the
terminal closed), and a SIGTERM may too (a ``kill`` of the group, Slurm's ``scancel``,
systemd's stop of a unit). The run stops after its update in flight and then stops what it
started; a child that had died at once would fail that stop (a rollout half stepped, a pipe
broken under a close) or be restarted by it. So a child ignores SIGINT and SIGHUP and takes a
first SIGTERM as notice: it goes on until its parent stops it, or ends itself
:data:`PARENT_STOP_GRACE_S` later, or at a second SIGTERM. A parent that will not wait for
such a child kills it (:func:`kill_children_left`): a SIGTERM from the parent looks like the
group's to the child. A process is started with SIGHUP blocked
(:func:`impala_rl.group_signals.hangup_blocked`), so that a hangup cannot end it before it
ignores SIGHUP.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit function is registered before ours
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from contextlib import suppress
from typing import Any

from impala_rl.group_signals import hangup_blocked, ignore_group_signals

# After a first SIGTERM, how long a child goes on for its parent to stop it.
PARENT_STOP_GRACE_S = 20.0

_children: weakref.WeakSet[Any] = weakref.WeakSet()
_learners: weakref.WeakSet[Any] = weakref.WeakSet()  # end at a second SIGTERM


def leave_stopping_to_parent() -> None:
    """In a child's main thread, at its start: SIGINT and SIGHUP ignored, a first SIGTERM taken
    as notice (from then on the child prints nothing more: its pipes may close under it), a
    second one ending it at once."""
    ignore_group_signals()
    signal.signal(signal.SIGTERM, _first_sigterm)


def _first_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, _end_now)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
    timer = threading.Timer(PARENT_STOP_GRACE_S, os._exit, (128 + signal.SIGTERM,))
    timer.daemon = True
    timer.start()


def _end_now(signum: int, frame: Any) -> None:
    os._exit(128 + signal.SIGTERM)


def preload_forkserver(*modules: str) -> None:
    """What a forkserver started from now on imports before it forks: ``modules``, after the
    one that keeps the forkserver through a SIGTERM to the whole group
    (:mod:`impala_rl.forkserver_preload`, which only the forkserver may import)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["impala_rl.forkserver_preload", *modules]
    )


def stopped_by_parent(process: Any) -> Any:
    """Note ``process`` (a started ``multiprocessing`` process that called
    :func:`leave_stopping_to_parent`) as one to kill, not SIGTERM, where this process will not
    wait for it; returns it."""
    _children.add(process)
    return process


def start_child(process: Any) -> Any:
    """Start ``process`` (a ``multiprocessing`` process that calls
    :func:`leave_stopping_to_parent`) with SIGHUP blocked (:func:`hangup_blocked`), noted as
    one to kill where this process will not wait for it (:func:`stopped_by_parent`); returns
    it."""
    with hangup_blocked():
        stopped_by_parent(process).start()
    return process


def ended_by_second_sigterm(process: Any) -> Any:
    """Note ``process`` (a started further learner, which takes a first SIGTERM as notice and
    at a second stops its own processes and ends) as one to send two, where this process will
    not wait for it; returns it."""
    _learners.add(process)
    return process


def kill_children_left(timeout: float = 5.0) -> None:
    """Kill and join the noted children still running, and send the noted further learners
    two SIGTERMs (this process is ending without stopping them: one SIGTERM would be taken as
    notice, and a learner killed would leave its own processes behind). At exit it runs
    before ``multiprocessing``'s, which would SIGTERM its daemonic children and join them, and
    join the others (a further learner) however long they take."""
    left = []
    for process in list(_children):
        with suppress(Exception):
            if process.is_alive():
                process.kill()
                left.append(process)
    for process in left:
        with suppress(Exception):
            process.join(timeout)
    end_learners([p for p in list(_learners) if _alive(p)], timeout)


def end_learners(processes: list[Any], timeout: float = 5.0) -> None:
    """End further learners still running: two SIGTERMs (:func:`sigterm_twice`), ``timeout``
    for them to stop their own processes and exit, then a kill for any left."""
    if not processes:
        return
    sigterm_twice(processes)
    deadline = time.monotonic() + timeout
    for process in processes:
        with suppress(Exception):
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        with suppress(Exception):
            if process.is_alive():
                process.kill()
                process.join()


def _alive(process: Any) -> bool:
    try:
        return bool(process.is_alive())
    except Exception:  # not this process's child (a copy that crossed a fork)
        return False


def sigterm_twice(processes: Iterable[Any], gap_s: float = 0.2) -> None:
    """SIGTERM to each of ``processes``, then again ``gap_s`` later: one that takes a first
    SIGTERM as notice and ends at a second (a further learner, which stops its own processes
    first) ends now."""
    processes = list(processes)
    for attempt in range(2):
        if attempt:
            time.sleep(gap_s)  # two signals pending at once would be taken as one
        for process in processes:
            with suppress(Exception):
                process.terminate()


atexit.register(kill_children_left)
