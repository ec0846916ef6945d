"""``benchmarks/id_smoke.py``: a short run per id, each outcome recorded, resumable."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "id_smoke.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_the_smoke_records_runs_and_refusals_and_skips_what_is_done(tmp_path):
    listed = _run("--list").stdout.split()
    assert "CartPole-v1" in listed and "Pendulum-v1" in listed
    assert not any(i.startswith("CartPole-v0") for i in listed)  # the newest version only
    out = tmp_path / "smoke"
    first = _run("--only", "CartPole-", "phys2d/CartPole", "--steps", "256", "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["CartPole-v1"]["outcome"] == "ran"
    if importlib.util.find_spec("jax") is None:  # phys2d's ids need jax: a one-line refusal
        phys = results["phys2d/CartPole-v1"]
        assert phys["outcome"] == "refused" and "jax" in phys["error"]
    again = _run("--only", "CartPole-", "--steps", "256", "--out", str(out))
    lines = again.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("1 ran")  # done before: nothing run again
    assert json.loads((out / "results.json").read_text()) == results
