"""Stops the local Ray a trainer started when that trainer dies without stopping it.

``ray.init()`` without an address starts Ray's daemons (GCS, raylet, dashboard, agents, the
workers) as the trainer's descendants. A trainer that exits or is interrupted stops them with
``ray.shutdown()``; a SIGKILLed one cannot, and some of them (the dashboard and runtime-env
agents) then live on. This watchdog is run as a script (standard library only, no torch) by
the Ray backend right after ``ray.init``, with the trainer's pid as its argument and a pipe as
its stdin. Every second it notes the trainer's Ray descendants (pid and start time, so a
reused pid is never touched). When its stdin closes it exits: after a ``stop`` line it leaves
everything alone (a clean ``ray.shutdown()``); without one the trainer died, and it sends the
noted processes SIGTERM, then SIGKILL to those still running after a grace period.

Linux only (``/proc``); elsewhere it exits at once and does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

GRACE_S = 3.0
POLL_S = 1.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a running process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _is_ray(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return cmd.startswith("ray::") or "/ray/" in cmd


def ray_descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of the Ray processes below ``root``."""
    parent: dict[int, int] = {}
    start: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parent[int(entry.name)], start[int(entry.name)] = st
    below, frontier = set(), [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in below:
                below.add(child)
                frontier.append(child)
    below.discard(os.getpid())
    return {pid: start[pid] for pid in below if _is_ray(pid)}


def _alive(noted: dict[int, int]) -> list[int]:
    return [pid for pid, t in noted.items() if (st := _stat(pid)) is not None and st[1] == t]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop(noted: dict[int, int]) -> None:
    """SIGTERM the noted processes that still run, then SIGKILL those left after the grace."""
    _signal(_alive(noted), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _alive(noted) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(_alive(noted), signal.SIGKILL)


def main(trainer: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle
    if not Path("/proc").is_dir():
        return
    noted: dict[int, int] = {}
    received = b""
    while True:
        noted.update(ray_descendants(trainer))
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 64)
            if chunk:
                received += chunk
                continue
            break  # stdin closed: a clean stop, or the trainer is gone
    if b"stop" not in received:
        stop(noted)


if __name__ == "__main__":
    main(int(sys.argv[1]))
