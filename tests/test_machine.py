"""What the process may run on and how torch's threads wait (impala_rl.machine): the cores
other processes leave idle; a short OpenMP spin set before torch loads, the user's own setting
kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from impala_rl import machine
from impala_rl.machine import OMP_SPIN_COUNT, OMP_WAIT_SETTINGS, set_omp_spin_count

SPIN_AT_TORCH_IMPORT = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Watch())
{call}
print(seen)
"""


@pytest.mark.parametrize(
    "call",
    [
        "from impala_rl.cli import main\ntry:\n    main(['eval', '/nonexistent/run'])\n"
        "except SystemExit:\n    pass",
        "import impala_rl\ntry:\n    impala_rl.train('cartpole', ['no_such.key=1'])\n"
        "except Exception:\n    pass",
    ],
    ids=["cli", "train"],
)
def test_torch_is_loaded_with_a_short_openmp_spin(call):
    """The CLI and ``train()`` set libgomp's spin count before torch is loaded (it is read
    then): a learner's idle threads stop holding cores other processes want."""
    code = SPIN_AT_TORCH_IMPORT.format(call=call)
    env = {k: v for k, v in os.environ.items() if k not in OMP_WAIT_SETTINGS}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.stdout.strip().splitlines()[-1] == f"[{str(OMP_SPIN_COUNT)!r}]", out.stderr


def test_a_users_openmp_wait_setting_is_kept(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as if torch were not loaded yet
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    set_omp_spin_count()
    assert os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    set_omp_spin_count()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_idle_cores_are_the_ticks_no_process_spent(monkeypatch):
    """Each core's idle share of the ticks between two readings, summed: one core idle all the
    time, one a quarter of it."""
    readings = iter([{0: (100, 1000), 1: (50, 1000)}, {0: (200, 1100), 1: (75, 1100)}])
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(machine, "_cpu_times", lambda cpus: next(readings))
    assert machine.idle_cores(0.0) == pytest.approx(1.25)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_a_core_another_process_keeps_busy_is_not_idle():
    cores = machine.available_cores()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spinner.pid, {min(os.sched_getaffinity(0))})
        idle = machine.idle_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.0 <= idle <= cores - 0.5
