"""The console a command writes to can go away while it runs: the reader of a pipe ends
(``| head``, a ``| tee`` that was killed), or the terminal closes under a run that ignores
the hangup (``trap '' HUP``). A write then fails (EPIPE, EIO). The console is only a view of
the run, whose record is in its directory, so the command goes on without it: the stream that
failed is sent to ``/dev/null`` and the write is dropped, instead of an exception that would
end a run in the middle of an epoch, without its final checkpoint or summary.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

LOST_CONSOLE_ERRNOS = frozenset({errno.EPIPE, errno.EIO, errno.ENXIO})
"""A write's errors that mean the reader went away: a pipe without a reader, a closed
terminal."""


def to_devnull(fds: Iterable[int]) -> None:
    """Each file descriptor of ``fds`` made a copy of ``/dev/null``'s, so that every writer
    still holding it (this process's streams, a child's) writes into nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            with suppress(OSError):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def is_regular_file(fd: int) -> bool:
    """Whether ``fd`` is a file on disk (``> train.log``), not a terminal or a pipe."""
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


def _lost(exc: OSError, stream: TextIO) -> bool:
    """Whether ``exc`` says the console went away; on a file, an EIO is the disk's."""
    if not (isinstance(exc, BrokenPipeError) or exc.errno in LOST_CONSOLE_ERRNOS):
        return False
    try:
        return not is_regular_file(stream.fileno())
    except (OSError, ValueError):
        return True


class LossTolerantStream:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose writes outlive its reader: the
    first write or flush that finds the console gone sends the stream's file descriptor to
    ``/dev/null`` and drops what it held; every other attribute is the stream's own."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self.lost = False

    @contextmanager
    def _unless_lost(self) -> Iterator[None]:
        """The block's write or flush, or, if it finds the console gone, the stream's file
        descriptor sent to ``/dev/null`` and what the buffer still held flushed there."""
        try:
            yield
        except OSError as exc:
            if not _lost(exc, self._stream):
                raise
            self.lost = True
            with suppress(OSError, ValueError):
                to_devnull([self._stream.fileno()])
            with suppress(OSError, ValueError):
                self._stream.flush()

    def write(self, text: str) -> int:
        with self._unless_lost():
            return self._stream.write(text)
        return len(text)  # dropped with the console

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._unless_lost():
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def console_loss_tolerated() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` made :class:`LossTolerantStream` for the block (the
    command's run), and flushed through them at its end, so that the interpreter's exit finds
    nothing to write to a console that is gone; the streams themselves again after it."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (
        s if s is None or isinstance(s, LossTolerantStream) else LossTolerantStream(s)
        for s in saved
    )
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):  # what a buffer holds, not left to the exit
            if isinstance(stream, LossTolerantStream):
                with suppress(ValueError):  # closed meanwhile
                    stream.flush()
        sys.stdout, sys.stderr = saved
