"""A process the run starts takes a first SIGTERM as notice: its parent stops it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from impala_rl.child_processes import (
    ended_by_second_sigterm,
    kill_children_left,
    leave_stopping_to_parent,
    sigterm_twice,
    stopped_by_parent,
)


def _child(ready: Any, noticed: Any) -> None:
    leave_stopping_to_parent()
    ready.set()
    while True:
        time.sleep(0.05)
        # a first SIGTERM's handler puts the one that ends the process at once in its place
        if getattr(signal.getsignal(signal.SIGTERM), "__name__", "") == "_end_now":
            noticed.set()


def _start() -> tuple[mp.Process, Any]:
    """A spawned child that called :func:`leave_stopping_to_parent`, and the event it sets once
    it has taken a SIGTERM as notice."""
    ctx = mp.get_context("spawn")
    ready, noticed = ctx.Event(), ctx.Event()
    process = ctx.Process(target=_child, args=(ready, noticed), daemon=True)
    process.start()
    assert ready.wait(60), "the child did not start within 60 s"
    return process, noticed


def _wait_exit(process: mp.Process, timeout: float = 30.0) -> None:
    process.join(timeout)
    assert process.exitcode is not None, f"still running {timeout:g} s later"


def test_a_first_sigterm_is_notice_and_a_second_ends_the_process():
    process, noticed = _start()
    try:
        os.kill(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: ignored
        os.kill(process.pid, signal.SIGTERM)
        assert noticed.wait(30), "the first SIGTERM was not taken as notice within 30 s"
        assert process.is_alive()
        os.kill(process.pid, signal.SIGTERM)
        _wait_exit(process)
        assert process.exitcode == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.join()


def test_a_parent_that_will_not_wait_ends_its_children_at_once():
    noted, _ = _start()
    stopped_by_parent(noted)
    other, _ = _start()
    try:
        kill_children_left()  # what a learner ending itself, or at its exit, does
        _wait_exit(noted, 10.0)
        assert noted.exitcode == -signal.SIGKILL
        assert other.is_alive()  # not noted: left to sigterm_twice
        sigterm_twice([other])
        _wait_exit(other)
        assert other.exitcode == 128 + signal.SIGTERM
    finally:
        for process in (noted, other):
            process.kill()
            process.join()


def test_a_parent_that_exits_sends_a_further_learner_two_sigterms():
    """A further learner left running where its parent exits (an error that skipped its
    stop) takes a first SIGTERM as notice: it gets two, the second ending it as a learner's
    stop does (its own processes stopped first), not a kill; and nothing waits for its
    notice's grace."""
    process, _ = _start()
    ended_by_second_sigterm(process)
    started = time.monotonic()
    kill_children_left(timeout=30.0)
    assert process.exitcode == 128 + signal.SIGTERM  # the second SIGTERM's own end
    assert time.monotonic() - started < 15.0  # not the notice's 20 s grace


def _answer_then_sleep(answer: Any) -> None:
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)
    answer.send((*handlers, signal.getsignal(signal.SIGTERM).__name__))
    time.sleep(600)


def _blocked_signals(pid: int) -> int:
    """The mask of signals process ``pid`` blocks (its main thread's)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_process_of_the_runs_forkserver_ignores_ctrl_c_and_hangup_from_its_start():
    """What the forkserver preloads: its children ignore SIGINT and SIGHUP before they run a
    line of their own, and a SIGTERM still ends one that has not said how to take it; the
    forkserver itself, started with SIGHUP blocked as the run starts it, outlives a SIGTERM
    and a hangup (the run stops it)."""
    from multiprocessing import forkserver

    from impala_rl.child_processes import preload_forkserver
    from impala_rl.group_signals import hangup_blocked
    from impala_rl.helper_processes import stop_forkserver

    stop_forkserver()  # one started by an earlier test, without this preload
    ctx = mp.get_context("forkserver")
    preload_forkserver()
    with hangup_blocked():
        forkserver.ensure_running()
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGHUP}  # here: restored
    server = forkserver._forkserver._forkserver_pid
    assert _blocked_signals(server) & 1 << (signal.SIGHUP - 1)
    children = []
    try:
        for _ in range(2):  # the second after a SIGTERM to the forkserver
            mine, theirs = ctx.Pipe()
            children.append(ctx.Process(target=_answer_then_sleep, args=(theirs,)))
            children[-1].start()
            assert mine.poll(60), "no answer from the child within 60 s"
            assert mine.recv() == (signal.SIG_IGN, signal.SIG_IGN, "_on_sigterm")
            if len(children) == 1:
                os.kill(server, signal.SIGTERM)
                os.kill(server, signal.SIGHUP)
        assert forkserver._forkserver._forkserver_pid == server  # not started again
        for child in children:
            os.kill(child.pid, signal.SIGTERM)
            _wait_exit(child)
            assert child.exitcode == -signal.SIGTERM
    finally:
        for child in children:
            child.kill()
            child.join()
        ctx.set_forkserver_preload([])
        stop_forkserver()


_SIGTERM_AT_FORK = """
import os, signal, time
r, w = os.pipe()

def probe():  # a child's after-fork, before the preload's own (hooks run in their order)
    blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.write(w, b"blocked" if blocked else b"open")
    os.kill(os.getpid(), signal.SIGTERM)

os.register_at_fork(after_in_child=probe)
import impala_rl.forkserver_preload  # as the forkserver imports it

pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
_, status = os.waitpid(pid, 0)
blocked_here = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
ended_by = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
print(os.read(r, 16).decode(), ended_by, blocked_here)
"""


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs signal masks")
def test_a_sigterm_that_reaches_a_forkserver_child_as_it_is_forked_still_ends_it():
    """The forkserver blocks SIGTERM across each fork: a SIGTERM that reaches the child before
    its interpreter's after-fork (where Python clears the signals it has received, so one sent
    then was lost) stays pending and ends the child once it is unblocked; the forkserver's own
    mask is as it was. Run in an interpreter of its own: the preload's fork hooks stay for good
    in the process that imports it."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_AT_FORK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["blocked", str(int(signal.SIGTERM)), "False"], done.stdout
