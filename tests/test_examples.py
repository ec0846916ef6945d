"""The example scripts in ``docs/examples`` run as written (on a tiny budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_minigrid_custom_torso_example_trains_and_writes_a_run_directory(tmp_path):
    """``python docs/examples/minigrid_custom_torso.py`` builds a RunConfig in code with its own
    torso by import path and trains MiniGrid-DoorKey-5x5-v0 on its Dict observations."""
    pytest.importorskip("minigrid")
    run_dir = tmp_path / "run"
    script = EXAMPLES / "minigrid_custom_torso.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "1024", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # the example needs no working directory of ours
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 1024
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["encoder"] == "minigrid_custom_torso:OneHotTorso"
    assert config["env"]["id"] == "MiniGrid-DoorKey-5x5-v0"
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["total_updates"] >= 1  # it trained, not only stepped
    assert "trained" in done.stdout
