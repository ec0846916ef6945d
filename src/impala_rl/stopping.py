"""How a run stops: a signal watched from a thread of its own, and a process that ends itself.

Ctrl-C (SIGINT), SIGTERM or the terminal's hangup (SIGHUP, unless ``nohup`` ignores it) asks
the run to stop after the update in flight; a second one aborts (a checkpoint of the last
update, if the run can write one within :data:`SECOND_SIGNAL_GRACE_S`); then, or at a third,
the process ends itself (:func:`end_process`), whatever its main thread is waiting on (a
collective, an env step in C code): Python runs signal handlers only in the main thread,
between bytecodes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, NoReturn

from impala_rl.actors import DistributedActors
from impala_rl.child_processes import kill_children_left, sigterm_twice
from impala_rl.group_signals import detach_output_on_hangup
from impala_rl.helper_processes import stop_helper_processes_quietly

log = logging.getLogger(__name__)

# After a second Ctrl-C the run has this long to end by itself (its step finished, the final
# checkpoint written, every process it started stopped); then the process ends itself.
SECOND_SIGNAL_GRACE_S = 5.0
# How long the processes it started get to exit after SIGTERM when a process ends itself.
CHILDREN_GRACE_S = 5.0


class SignalWatch:
    """``signums`` handled by ``handler`` in the main thread, and seen by a thread of their own.

    Python runs a signal handler in the main thread between bytecodes only: while that thread
    waits in native code (a collective for a learner that stalled, an env step in C) no
    handler runs, and no handler alone can promise that a second Ctrl-C ends the run. The
    C-level handler still writes each signal's number to the wakeup fd
    (:func:`signal.set_wakeup_fd`), which the watch's thread reads: ``grace_s`` after the
    ``end_after``-th signal, or at one more, it calls ``end`` unless the main thread has left
    the watch by then. Outside the main thread (a Ray actor) the watch does nothing.
    """

    def __init__(
        self,
        handler: Callable[[int, Any], None],
        signums: tuple[int, ...],
        end_after: int,
        grace_s: float,
        end: Callable[[], NoReturn],
        notice: Callable[[int], None] | None = None,
    ):
        self._handler, self._signums = handler, frozenset(int(s) for s in signums)
        self._end_after, self._grace_s, self._end, self._notice = end_after, grace_s, end, notice
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done = False

    def __enter__(self) -> SignalWatch:
        try:
            for signum in self._signums:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread
            return self
        self._sockets = socket.socketpair()
        self._sockets[1].setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(
            self._sockets[1].fileno(), warn_on_full_buffer=False
        )
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        detach_output_on_hangup(signum)
        self._handler(signum, frame)

    def arm(self) -> None:
        """Start the thread, once this process has forked what it forks (a thread makes
        forking unsafe); signals that came before count."""
        if self._sockets is not None and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="impala-signals", daemon=True)
            self._thread.start()

    def __exit__(self, *exc: object) -> None:
        if self._sockets is None:
            return
        with self._lock:  # waits while the thread ends the process
            self._done = True
        signal.set_wakeup_fd(self._previous_fd)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        reader, writer = self._sockets
        writer.close()  # the thread reads the end of the stream and returns
        if self._thread is not None:
            self._thread.join()
        reader.close()

    def _watch(self) -> None:
        reader = self._sockets[0]  # type: ignore[index]
        count, deadline = 0, None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if select.select([reader], [], [], timeout)[0]:
                data = reader.recv(256)
                if not data:
                    return
                for signum in (b for b in data if b in self._signums):
                    detach_output_on_hangup(signum)  # before the main thread gets to it
                    count += 1
                    if self._notice is not None:
                        self._notice(count)
                if count > self._end_after:
                    deadline = time.monotonic()
                elif count == self._end_after and deadline is None:
                    deadline = time.monotonic() + self._grace_s
            if deadline is not None and time.monotonic() >= deadline:
                with self._lock:  # held to the end: the main thread cannot leave meanwhile
                    if self._done:
                        return
                    self._end()


def _live_children() -> list[Any]:
    for _ in range(3):  # another thread may start a process meanwhile
        with suppress(RuntimeError):
            return mp.active_children()
    return []


def end_process(
    code: int, actors: DistributedActors, saving: threading.Lock | None = None
) -> NoReturn:
    """End this process from any thread, as cleanly as a main thread that does not return
    allows: a checkpoint being written is finished first (``saving``), ``actors`` restart no
    actor, those of the processes this one started that take a SIGTERM as notice (actors,
    inference servers, the evaluation, env workers: :mod:`impala_rl.child_processes`) are
    killed, the others (other learners) get SIGTERM twice (the first is notice) and are joined
    (killed after :data:`CHILDREN_GRACE_S`), then ``os._exit(code)``,
    which waits for no thread. Written checkpoints stay as they are: each was renamed into
    place whole."""
    if saving is not None:
        saving.acquire(timeout=60.0)  # held to the end: nothing starts another write
    actors.abandon()
    kill_children_left(CHILDREN_GRACE_S)
    deadline = time.monotonic() + CHILDREN_GRACE_S
    while children := _live_children():
        if time.monotonic() >= deadline:
            for child in children:
                with suppress(Exception):
                    child.kill()
                    child.join(CHILDREN_GRACE_S)
            break
        sigterm_twice(children)
        for child in children:
            with suppress(Exception):
                child.join(max(0.0, deadline - time.monotonic()))
    # The resource tracker exits once every holder of its pipe has: a process killed above
    # may have left one behind, so its stop is not waited for long.
    helpers = threading.Thread(target=stop_helper_processes_quietly, daemon=True)
    helpers.start()
    helpers.join(CHILDREN_GRACE_S)
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)


def notice_stop(count: int) -> None:
    if count == 1:
        log.warning("stopping after this update (press Ctrl-C again to abort)")
    elif count == 2:
        log.warning(
            "aborting: the run ends within %g s, with a checkpoint of its last update if it "
            "can write one (press Ctrl-C again to end it now)",
            SECOND_SIGNAL_GRACE_S,
        )
