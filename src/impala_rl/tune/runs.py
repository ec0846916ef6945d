"""One training run of a study, as its own ``impala train`` process, watched from outside.

Each trial (and each PBT member's stretch) is an ordinary run directory, trained by ``python
-m impala_rl.cli train ... --run-dir DIR`` (or ``--resume DIR``): ``impala eval``, ``impala
plot`` and ``--resume`` understand it, and a run that fails cannot take the tuner with it. The
tuner reads the run's ``metrics.jsonl`` as epochs end. The process is started so that it ends
with the tuner, however the tuner ends: on Linux it gets SIGTERM when its parent dies (a
SIGKILL of the tuner included), and it stops as on Ctrl-C (a final checkpoint, its summary,
its own actors joined).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from impala_rl.events import ActorEvents, ImpalaEvents, RunEvents, event_specs

STOP_TIMEOUT_S = 120.0


class TrainingRunFailed(RuntimeError):
    """A run of a study ended in error (its log says why)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the tuner's own handlers stop its runs
        pass


def statistic_names() -> list[str]:
    """The statistics a run can report (``metrics.jsonl``'s names; ``<key>`` for a step or
    critic key), from the events' declarations."""
    names = []
    for interface in (ImpalaEvents, ActorEvents, RunEvents):
        for name, spec in event_specs(interface).items():
            for out in spec.outputs:
                base = "/".join(p for p in (name, out.name) if p)
                names.append(f"{base}/<key>" if spec.group_by else base)
    return sorted(names)


def is_statistic(name: str) -> bool:
    """Whether runs report ``name`` (a keyed statistic with any key)."""
    for known in statistic_names():
        if known == name:
            return True
        if known.endswith("/<key>") and name.startswith(known[: -len("<key>")]):
            return name[len(known) - len("<key>") :].isdigit()
    return False


class TrainingRun:
    """``impala train`` as a child process in ``run_dir``; :meth:`epochs` yields each epoch's
    statistics as it is written."""

    def __init__(
        self,
        run_dir: Path,
        preset: str | None,
        overrides: list[str],
        resume: bool = False,
        log_path: Path | None = None,
    ):
        self.run_dir = Path(run_dir)
        if resume:
            args = ["--resume", str(self.run_dir), *overrides]
        else:
            args = [*([preset] if preset else []), *overrides, "--run-dir", str(self.run_dir)]
        self.command = [sys.executable, "-m", "impala_rl.cli", "train", *args, "log.console=false"]
        self.log_path = log_path or self.run_dir.with_suffix(".log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the tuner alone
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._read = 0  # metrics.jsonl lines already seen

    def epochs(self, poll_s: float = 0.5) -> Iterator[dict[str, Any]]:
        """Each new epoch's statistics until the process ends (then the ones left)."""
        while True:
            running = self.process.poll() is None
            yield from self._new_rows()
            if not running:
                return
            time.sleep(poll_s)

    def _new_rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text().splitlines()
        complete = lines if path.read_text().endswith("\n") else lines[:-1]
        rows = [json.loads(line) for line in complete[self._read :]]
        self._read = len(complete)
        return rows

    def stop(self) -> None:
        """Stop as Ctrl-C does (a final checkpoint and the summary), then wait for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        self.wait()

    def wait(self) -> dict[str, Any] | None:
        """Wait for the process; the run's summary (``None`` if it wrote none)."""
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        summary = self.run_dir / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else None

    def failure(self) -> str:
        """The last lines of the run's log, for an error message."""
        text = self.log_path.read_text() if self.log_path.is_file() else ""
        return " ".join(text.strip().splitlines()[-3:])


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
