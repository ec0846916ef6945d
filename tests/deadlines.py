"""Test helpers shared by the actor-backend tests: per-test deadlines and polling waits."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class DeadlineExceeded(Exception):
    pass


def time_limit(seconds: float) -> Callable:
    """Give one test a deadline other than its module's default."""

    def decorate(fn: Callable) -> Callable:
        fn.time_limit_s = seconds  # type: ignore[attr-defined]
        return fn

    return decorate


@contextmanager
def alarm_deadline(request, default_s: float) -> Iterator[None]:
    """Fail (rather than hang) the test of ``request`` when it runs past its deadline."""
    seconds = getattr(request.function, "time_limit_s", default_s)

    def on_alarm(signum, frame):
        raise DeadlineExceeded(f"{request.node.name} ran past its {seconds:.0f} s deadline")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval=0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
