"""A console that goes away: writes that outlive their reader (impala_rl.console_output)."""

from __future__ import annotations

import errno
import io
import os
import sys

import pytest

from impala_rl.console_output import LossTolerantStream, console_loss_tolerated


class _Failing(io.StringIO):
    def __init__(self, code: int):
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))


def test_a_write_after_the_reader_left_goes_to_devnull():
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w", buffering=1)
    try:
        tolerant = LossTolerantStream(stream)
        tolerant.write("read\n")
        assert os.read(read_end, 100) == b"read\n"
        os.close(read_end)
        assert tolerant.write("nobody reads this\n") == len("nobody reads this\n")
        assert tolerant.lost
        null = os.stat(os.devnull)
        assert os.fstat(stream.fileno()).st_rdev == null.st_rdev  # the fd is /dev/null's now
        tolerant.write("nor this\n")
        tolerant.flush()
    finally:
        stream.close()


def test_a_terminals_eio_counts_as_a_lost_console():
    import pty

    master, terminal = pty.openpty()
    failing = _Failing(errno.EIO)
    failing.fileno = lambda: terminal  # type: ignore[method-assign]
    try:
        tolerant = LossTolerantStream(failing)
        tolerant.write("x")
        assert tolerant.lost
    finally:
        os.close(master)
        os.close(terminal)


def test_an_eio_on_a_file_is_the_disks_and_raised(tmp_path):
    with open(tmp_path / "train.log", "w") as log:
        failing = _Failing(errno.EIO)
        failing.fileno = log.fileno  # type: ignore[method-assign]
        with pytest.raises(OSError, match="Input/output"):
            LossTolerantStream(failing).write("x")


def test_another_write_error_is_raised():
    tolerant = LossTolerantStream(_Failing(errno.ENOSPC))
    with pytest.raises(OSError, match="space"):
        tolerant.write("x")
    assert not tolerant.lost


def test_the_streams_are_wrapped_for_the_block_only():
    saved = sys.stdout, sys.stderr
    with console_loss_tolerated():
        assert isinstance(sys.stdout, LossTolerantStream)
        assert isinstance(sys.stderr, LossTolerantStream)
        assert sys.stderr.isatty() == saved[1].isatty()  # the stream's own attributes
    assert (sys.stdout, sys.stderr) == saved


def test_what_a_buffer_holds_at_the_end_meets_a_lost_console_there(monkeypatch):
    """A block-buffered stdout (a pipe) holds the summary until the exit: flushed at the end
    of the block, through the tolerant stream, not by the interpreter's exit, which would
    fail on it (exit code 120)."""
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")  # block-buffered
    monkeypatch.setattr(sys, "stdout", stream)
    try:
        with console_loss_tolerated():
            print("the summary")
            os.close(read_end)  # the reader leaves before the buffer is written
        assert sys.stdout is stream
        assert os.fstat(stream.fileno()).st_rdev == os.stat(os.devnull).st_rdev
        stream.flush()  # nothing left to fail
    finally:
        stream.close()
