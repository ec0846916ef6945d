"""Imported by the forkserver that starts a run's processes, before the rest of its preload
(:func:`impala_rl.child_processes.preload_forkserver`; nothing else may import it): a signal
sent to the whole group (a terminal's Ctrl-C; a ``kill`` of the group, Slurm's ``scancel``,
systemd's stop) is the run's to handle.

- SIGTERM: a forkserver that died of it would look to the run as if every process it started
  had died (their exit codes come through it). The run stops the forkserver when it ends
  (:mod:`impala_rl.helper_processes`); a process forked from it takes SIGTERM as it would have,
  until it says otherwise (:mod:`impala_rl.child_processes`). SIGTERM is blocked across each
  fork: Python clears the signals that reach a child before its interpreter's after-fork, so
  one sent then was lost; blocked, it stays pending and ends the child once it is unblocked.
- SIGINT: the forkserver ignores it anyway, and gives its children the handler it found when
  it started, this one: so they ignore a Ctrl-C from their first instruction, not only from
  the moment they ignore it themselves (a Ctrl-C in between killed an actor as it started).
- SIGHUP (the terminal closed): ignored by the forkserver and its children alike, as the run's
  processes ignore it (:func:`impala_rl.group_signals.ignore_group_signals`)."""

from __future__ import annotations

import os
import signal
from typing import Any

from impala_rl.group_signals import ignore_group_signals

_FORKSERVER = os.getpid()


def _on_sigterm(signum: int, frame: Any) -> None:
    if os.getpid() == _FORKSERVER:
        return  # the run stops it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a process forked from it: as by default
    os.kill(os.getpid(), signal.SIGTERM)


def _block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _unblock_sigterm() -> None:  # the forkserver never blocks it otherwise
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


signal.signal(signal.SIGTERM, _on_sigterm)
os.register_at_fork(
    before=_block_sigterm, after_in_parent=_unblock_sigterm, after_in_child=_unblock_sigterm
)
ignore_group_signals()
