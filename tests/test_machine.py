"""How torch's threads wait (impala_rl.machine): a short OpenMP spin set before torch loads,
the user's own setting kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
