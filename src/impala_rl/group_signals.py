"""The signals a terminal or a job sends to a run's whole process group: Ctrl-C (SIGINT), the
terminal's hangup (SIGHUP, when it closes) and SIGTERM (a ``kill`` of the group, Slurm's
``scancel``, systemd's stop). Which of them ask a run or a study to stop, what a hangup takes
away (the terminal the output went to), and how the processes a run starts leave the first two
to the process that started it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from impala_rl.console_output import LossTolerantStream, is_regular_file, to_devnull


def stop_signals() -> tuple[int, ...]:
    """The signals that ask a run (or a study) to stop: Ctrl-C, SIGTERM, and the terminal's
    hangup (SIGHUP) unless this process ignores it (started under ``nohup``)."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None or signal.getsignal(hangup) == signal.SIG_IGN:
        return (signal.SIGINT, signal.SIGTERM)
    return (signal.SIGINT, signal.SIGTERM, hangup)


def detach_output_on_hangup(signum: int) -> None:
    """After a hangup (the terminal closed) stdout and stderr go to ``/dev/null``, unless they
    are files: a write to a closed terminal fails (EIO), so does one to a pipe whose reader
    the hangup ended (``| tee``), and the stop's messages must not fail the stop. Not where
    both streams take the loss of their reader themselves (the ``impala`` command's): they
    go to ``/dev/null`` only if a write fails, so a hangup sent on purpose (``kill -HUP``) to
    a run whose reader lives on leaves its output, the stop's messages and summary, to it."""
    if signum != getattr(signal, "SIGHUP", None):
        return
    streams = (sys.stdout, sys.stderr)  # rich's live display puts a proxy in front of each
    if all(isinstance(getattr(s, "rich_proxied_file", s), LossTolerantStream) for s in streams):
        return
    to_devnull(fd for fd in (1, 2) if not is_regular_file(fd))


def ignore_group_signals() -> None:
    """Ignore the terminal's signals to the whole group, Ctrl-C (SIGINT) and its hangup
    (SIGHUP): the run's first process handles them and stops this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


@contextmanager
def hangup_blocked() -> Iterator[None]:
    """SIGHUP blocked in this thread while it starts processes. A process started meanwhile
    (a spawned child, the forkserver, the resource tracker, Ray's) inherits the block, across
    ``exec`` too, so a hangup sent to the whole group cannot end it while it starts, before
    it ignores SIGHUP (:func:`ignore_group_signals`); the resource tracker, which ignores
    SIGINT and SIGTERM itself, keeps it blocked. This process still takes a SIGHUP meanwhile:
    another thread receives it, or it waits for the block's end."""
    if not hasattr(signal, "pthread_sigmask") or not hasattr(signal, "SIGHUP"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
