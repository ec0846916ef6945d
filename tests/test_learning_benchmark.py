"""``benchmarks/learning.py``: budget runs over seeds, per-seed JSON, PNG, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "learning.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _epochs(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _commands(out: Path) -> list[str]:
    """The training commands the benchmark started for seed 0, in order."""
    log = (out / "seed0" / "train.log").read_text().splitlines()
    return [line for line in log if line.startswith("$ ")]


@pytest.mark.slow
def test_a_killed_benchmark_resumes_its_seeds_and_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    steps = 12_000
    args = [
        sys.executable,
        str(SCRIPT),
        "cartpole",
        "--steps",
        str(steps),
        "--seeds",
        "0",
        "--thresholds",
        "20",
        "1000",
        "--out",
        str(out),
        "log.tensorboard=false",
        "algorithm.epoch_length=4",
    ]
    run_dir = out / "seed0" / "run"
    proc = subprocess.Popen(args, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_epochs(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (run_dir / "checkpoints" / "last.pt").is_file(), "no checkpoint before the kill"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark and its trainer, mid-run
        proc.wait()
    killed_at = _epochs(run_dir)[-1]["env_steps"]
    assert 0 < killed_at < steps and not (out / "seed0.json").exists()

    subprocess.run(args, env=_env(), check=True, timeout=300)

    commands = _commands(out)
    assert len(commands) == 2 and "--resume" in commands[1] and "--resume" not in commands[0]
    rows = _epochs(run_dir)
    by_epoch = {row["epoch"]: row for row in rows}  # a resume may repeat uncheckpointed epochs
    steps_seen = [by_epoch[e]["env_steps"] for e in sorted(by_epoch)]
    assert steps_seen == sorted(steps_seen) and steps_seen[0] < killed_at
    assert len(by_epoch) == max(by_epoch)  # the resume continued the epoch count, no restart
    record = json.loads((out / "seed0.json").read_text())
    assert record["env_steps"] >= steps and record["seed"] == 0
    assert record["steps_per_second"] == pytest.approx(record["env_steps"] / record["wall_time_s"])
    assert (
        record["final_return"]
        == json.loads((run_dir / "summary.json").read_text())["train_return_recent"]
    )
    reached = record["thresholds"]["20.0"]
    first = next(row for row in rows if row.get("train_return_recent", -1) >= 20)
    assert reached == {"env_steps": first["env_steps"], "wall_time_s": first["wall_time_s"]}
    assert record["thresholds"]["1000.0"] is None  # CartPole's returns stop at 500
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [record] and summary["steps"] == steps
    assert (out / "learning.png").read_bytes()[:8] == PNG_MAGIC
    # a spent budget is only re-read: no third training command
    subprocess.run(args, env=_env(), check=True, timeout=120)
    assert _commands(out) == commands


def test_overrides_that_would_change_an_existing_run_are_refused(tmp_path):
    """A resume trains with the run's saved config: changed overrides would be ignored, and
    the summary's command would claim settings the run did not have."""
    out = tmp_path / "bench"
    base = [sys.executable, str(SCRIPT), "cartpole", "--steps", "1000", "--out", str(out)]
    quiet = ["log.tensorboard=false", "algorithm.epoch_length=4"]
    subprocess.run([*base, *quiet, "algorithm.lr=0.001"], env=_env(), check=True, timeout=120)
    commands = _commands(out)
    # the same settings, written differently, only re-read the finished run
    subprocess.run([*base, *quiet, "algorithm.lr=1e-3"], env=_env(), check=True, timeout=120)
    other = subprocess.run(
        [*base, *quiet, "algorithm.lr=0.002", "algorithm.gamma=0.9"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 2
    assert "Traceback" not in other.stderr
    (line,) = other.stderr.strip().splitlines()
    assert "algorithm.lr=0.002 (the run has 0.001)" in line
    assert "algorithm.gamma=0.9 (the run has 0.99)" in line
    assert "--out" in line
    typo = subprocess.run(
        [*base, *quiet, "algorithm.lrr=0.001"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert "algorithm.lrr" in typo.stderr
    assert _commands(out) == commands  # nothing trained


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's `command &` starts it


@pytest.mark.parametrize(
    "signum, to_group, started_with_sigint_ignored",
    [
        (signal.SIGTERM, False, False),  # `kill PID`, what the docstring tells users
        (signal.SIGINT, True, False),  # Ctrl-C in a terminal: the whole foreground group
        (signal.SIGINT, False, True),  # `kill -INT PID` of a `nohup ... &` run
    ],
    ids=["kill", "ctrl-c", "kill-int-background"],
)
def test_a_stopped_benchmark_stops_its_trainer_with_a_checkpoint(
    tmp_path, signum, to_group, started_with_sigint_ignored
):
    """None must leave the trainer running on its own, nor end in a traceback."""
    out = tmp_path / "bench"
    args = [sys.executable, str(SCRIPT), "cartpole", "--steps", "10000000", "--out", str(out)]
    run_dir = out / "seed0" / "run"
    proc = subprocess.Popen(
        [*args, "log.tensorboard=false", "algorithm.epoch_length=4"],
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if started_with_sigint_ignored else None,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_epochs(run_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and _epochs(run_dir), "the benchmark did not start training"
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum
        assert "Traceback" not in stderr
        assert "the same command resumes" in stderr
        left = subprocess.run(
            ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert left == [], f"processes left in the benchmark's group: {left}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_because"] == "interrupted"
    assert (run_dir / "checkpoints" / "last.pt").is_file()
