"""Tests for the ``impala`` command, run as a real subprocess."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import torch

import impala_rl
from impala_rl import checkpoint

TESTS_DIR = Path(__file__).resolve().parent
QUIET = ["log.console=false", "log.tensorboard=false"]
TINY = ["algorithm.n_epochs=1", "algorithm.epoch_length=2"]


def _env() -> dict[str, str]:
    """The subprocess environment: ``tests/`` importable (for ``nan_env:...`` env ids)."""
    paths = [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "impala_rl.cli", *args]


@contextmanager
def _in_own_group(*args: str, cwd: Path, **popen: Any) -> Iterator[subprocess.Popen]:
    """``impala ARGS`` in a process group of its own (which finds anything it started), its
    output piped unless ``popen`` says otherwise; killed with its group if it or anything it
    started is still running at the end."""
    proc = subprocess.Popen(
        _cmd(*args),
        cwd=cwd,
        env=_env(),
        start_new_session=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None or _process_group(proc.pid):
            with suppress(ProcessLookupError):  # the group ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _impala(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(*args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _tiny_run(run_dir: Path) -> dict:
    """A finished one-epoch run, trained in-process (faster than a subprocess)."""
    return impala_rl.train("cartpole", [*QUIET, *TINY], run_dir=run_dir)


def test_version_prints_the_installed_version(capsys):
    from impala_rl import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"impala-rl {impala_rl.__version__}"


# -- train ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["before", "after"])
def test_train_prints_the_summary_json(tmp_path, placement):
    run_dir = tmp_path / "run"
    overrides = [*TINY, "log.console=false"]
    if placement == "before":
        args = ["train", "cartpole", *overrides, "--run-dir", str(run_dir)]
    else:
        args = ["train", "cartpole", "--run-dir", str(run_dir), *overrides]
    script = Path(sys.executable).parent / "impala"
    # The installed console script and ``python -m impala_rl.cli`` are the same command.
    cmd = [str(script), *args] if script.is_file() else _cmd(*args)
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_because"] == "n_epochs"
    assert summary["epochs"] == 1
    assert summary["updates"] == 2
    assert summary["run_dir"] == str(run_dir)
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert not (tmp_path / "runs").exists()  # --run-dir was honoured


USER_ENV_FILE = """
import gymnasium as gym
import numpy as np


class Guess(gym.Env):
    observation_space = gym.spaces.Box(0.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        self.k = int(self.np_random.integers(3))
        return np.eye(3, dtype=np.float32)[self.k]

    def step(self, action):
        reward = float(action == self.k)
        self.t += 1
        return self._obs(), reward, False, self.t >= 5, {}
"""


def test_an_env_in_a_file_of_the_working_directory_trains_in_actor_processes(tmp_path):
    """``impala train env.id=my_guess_env:Guess`` run where ``my_guess_env.py`` lies, by the
    installed console script (whose ``sys.path`` starts at its ``bin`` directory, not the
    working directory): the module imports in the trainer and in each actor process."""
    script = Path(sys.executable).parent / "impala"
    if not script.is_file():
        pytest.skip("no installed console script")
    (tmp_path / "my_guess_env.py").write_text(USER_ENV_FILE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["env.id=my_guess_env:Guess", "runner.backend=subprocess", "max_env_steps=2048"]
    proc = subprocess.run(
        [str(script), "train", *args, *QUIET, "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stopped_because"] == "max_env_steps" and summary["env_steps"] >= 2048

    # the run keeps where the module lay: its evaluation and its resume from another directory
    # import it from there, with no PYTHONPATH
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = str(tmp_path / "run")

    def impala_elsewhere(*args: str) -> subprocess.CompletedProcess:
        command = [str(script), *args]
        return subprocess.run(
            command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )

    proc = impala_elsewhere("eval", run, "--episodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["episodes"] == 2
    proc = impala_elsewhere("train", "--resume", run, "max_env_steps=4096", *QUIET)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["env_steps"] >= 4096

    # moved away: the error names the module and where it must lie
    (tmp_path / "my_guess_env.py").rename(elsewhere / "kept.py")
    proc = impala_elsewhere("eval", run, "--episodes", "1")
    assert proc.returncode == 2
    assert "cannot import module 'my_guess_env'" in proc.stderr
    assert "working directory or on PYTHONPATH" in proc.stderr


def test_a_run_keeps_the_directories_of_the_users_modules_only(tmp_path, monkeypatch):
    """A checkpoint keeps the directory a user's env module was imported from, not that of an
    installed package (gymnasium) nor of a string that names no imported module."""
    from impala_rl.envs.factory import user_module_dirs

    (tmp_path / "my_guess_env.py").write_text(USER_ENV_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("my_guess_env")
    try:
        tree = {
            "env": {"id": "my_guess_env:Guess"},
            "model": {"encoder": "gymnasium.envs.classic_control:CartPoleEnv", "x": ["no:x"]},
        }
        assert user_module_dirs(tree) == [str(tmp_path.resolve())]
        registered = {"env": {"id": "my_guess_env:Guess-v0"}}  # the package:EnvId form
        assert user_module_dirs(registered) == [str(tmp_path.resolve())]
        assert user_module_dirs({"env": {"id": "gymnasium.envs:CartPole-v1"}}) == []
    finally:
        sys.modules.pop("my_guess_env")


def test_train_without_a_terminal_prints_only_the_summary_json_on_stdout(tmp_path):
    """``impala train cartpole > summary.json``: stdout is a pipe, and it holds the summary
    JSON alone; the console's epoch lines are logs, on stderr, each row once, and a background
    evaluation that finishes after the last row adds a short line there."""
    run_dir = tmp_path / "run"
    args = [
        "train",
        "cartpole",
        "max_env_steps=2000",
        "runner.backend=sequential",
        "log.console=true",
        "log.tensorboard=false",
        "algorithm.rollout_evaluator.background=true",
        "--run-dir",
        str(run_dir),
    ]
    env = {k: v for k, v in _env().items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.run(
        _cmd(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)  # one JSON document and nothing else
    assert summary == json.loads((run_dir / "summary.json").read_text())
    lines = [line for line in proc.stderr.splitlines() if line.startswith("epoch=")]
    rows = [line for line in lines if " env_steps=" in line]
    epochs = [int(line.split(" ")[0].removeprefix("epoch=")) for line in rows]
    assert epochs == list(range(1, summary["epochs"] + 1))  # every epoch's row, once
    late = lines[len(rows) :]
    assert late and lines[: len(rows)] == rows  # after the last row
    for line in late:
        names = [pair.split("=", 1)[0] for pair in line.split(" ")]
        assert names[0] == "epoch" and all(name.startswith("eval_") for name in names[1:])
        assert line.startswith(f"epoch={summary['epochs']} ") and "eval_return/mean" in names


def test_train_resume_continues_a_finished_run(tmp_path):
    first = _tiny_run(tmp_path)
    assert (first["epochs"], first["updates"]) == (1, 2)
    proc = _impala("train", "--resume", str(tmp_path), "algorithm.n_epochs=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stopped_because"] == "n_epochs"
    assert summary["epochs"] == 3
    assert summary["updates"] == 3 * 2
    assert summary["env_steps"] == 3 * first["env_steps"]
    assert summary["run_dir"] == str(tmp_path)
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["epoch"] for row in rows] == [1, 2, 3]


# -- user errors ---------------------------------------------------------------------------------

ERROR_CASES = {
    "unknown preset": (["train", "nosuchpreset"], "unknown preset 'nosuchpreset'"),
    "unknown key": (["train", "cartpole", "algorithm.nosuchkey=1"], "algorithm.nosuchkey"),
    "bad value": (["train", "cartpole", "algorithm.lr=fast"], "algorithm.lr"),
    "out of range": (["train", "cartpole", "algorithm.epoch_length=0"], "algorithm.epoch_length"),
    "unknown env id": (["train", "cartpole", "env.id=NoSuchEnv-v0"], "NoSuchEnv"),
    "env module not found": (
        ["train", "cartpole", "env.id=no_such_module_here:make_env"],
        "'no_such_module_here' (No module named 'no_such_module_here'); its directory must be "
        "the working directory or on PYTHONPATH",
    ),
    "factory raises": (
        ["train", "cartpole", "env.id=nan_env:make_raising_env"],
        "this factory always fails",
    ),
    "a further learner fails": (
        [
            "train",
            "cartpole",
            "env.id=nan_env:make_env_failing_in_further_learners",
            "algorithm.num_learners=2",
        ],
        "fails outside the first learner",
    ),
    # issue 41.3: a device this machine lacks, refused before anything starts
    "no such GPU": (["train", "cartpole", "algorithm.device=cuda:99"], "'algorithm.device'"),
    "no such GPU, 2 learners": (
        ["train", "cartpole", "algorithm.device=cuda:99", "algorithm.num_learners=2"],
        "'algorithm.device'",
    ),
    **(
        {}
        if torch.cuda.is_available()
        else {
            "cuda without CUDA": (["train", "cartpole", "algorithm.device=cuda"], "cpu"),
            "cuda without CUDA, 2 learners": (
                ["train", "cartpole", "algorithm.device=cuda", "algorithm.num_learners=2"],
                "'algorithm.device'",
            ),
        }
    ),
    "eval missing run dir": (["eval", "{missing}"], "best.pt"),
    "resume not a run dir": (["train", "--resume", "{not_a_run}"], "not a run directory"),
    "resume with a preset": (["train", "--resume", "{not_a_run}", "cartpole"], "--resume"),
}


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory):
    """Every error case, run concurrently (each is mostly interpreter start-up)."""
    base = tmp_path_factory.mktemp("errors")
    (base / "not_a_run").mkdir()
    paths = {"missing": str(base / "missing"), "not_a_run": str(base / "not_a_run")}
    procs = {}
    for name, (args, _) in ERROR_CASES.items():
        args = [a.format(**paths) for a in args]
        if args[0] == "train" and "--resume" not in args:
            args += ["--run-dir", str(base / name.replace(" ", "_")), *QUIET]
        procs[name] = subprocess.Popen(
            _cmd(*args),
            cwd=base,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


RUN_FAILURES = {"a further learner fails"}  # refused after the run started: exit 1, a summary


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_are_one_line_and_exit_2(error_runs, case):
    """Refused before anything ran: exit status 2, nothing on stdout. A run that started and
    then failed: exit status 1, its summary on stdout."""
    returncode, out, err = error_runs[case]
    lines = err.strip().splitlines()
    if case in RUN_FAILURES:
        assert returncode == 1, (out, err)
        assert json.loads(out)["stopped_because"] == "error"
    else:
        assert returncode == 2, (out, err)
        assert not out.strip()
    assert "Traceback" not in err + out
    assert len(lines) == 1, err
    assert lines[0].startswith("impala: error: ")
    assert ERROR_CASES[case][1] in lines[0]


# -- eval ----------------------------------------------------------------------------------------


def test_eval_prints_mean_return(tmp_path):
    _tiny_run(tmp_path / "run")
    proc = _impala("eval", str(tmp_path / "run"), "--episodes", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["episodes"] == 3
    assert isinstance(result["mean_return"], float)
    assert 1.0 <= result["min_return"] <= result["mean_return"] <= result["max_return"] <= 500.0


# -- Ctrl-C and SIGTERM --------------------------------------------------------------------------


def _process_group(pgid: int) -> list[int]:
    """Live pids (zombies excluded) whose process group is ``pgid``, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, _ppid, pgrp = text.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _cartpole(run_dir: Path, *settings: str) -> list[str]:
    """``impala train`` of CartPole into ``run_dir`` that does not stop at a solved return."""
    return ["train", "cartpole", "--run-dir", str(run_dir), "target_return=null", *settings]


def _until_stopped(run_dir: Path) -> list[str]:
    """CartPole trained until it is stopped, a checkpoint every two updates."""
    return _cartpole(run_dir, "max_env_steps=1000000000", "algorithm.epoch_length=2")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("signum", "learners", "backend", "to_group"),
    [
        (signal.SIGINT, 1, "sequential", False),
        (signal.SIGTERM, 1, "sequential", False),
        (signal.SIGINT, 2, "sequential", False),
        (signal.SIGTERM, 2, "sequential", True),
        (signal.SIGTERM, 1, "ray", False),
    ],
    ids=[
        "SIGINT",
        "SIGTERM",
        "SIGINT-2-learners",
        "SIGTERM-to-the-group-2-learners",
        "SIGTERM-ray",
    ],
)
def test_signal_stops_cleanly_with_a_checkpoint(tmp_path, signum, learners, backend, to_group):
    """The signal reaches the process started (learner 0), or every process of its group (a
    ``kill`` of the group, Slurm's scancel, systemd's stop), where the further learner leaves
    it to the leader; with two learners it stops both at the same update, and nothing either
    of them started outlives the run. With Ray, ``ray.init`` must not have
    replaced the run's SIGTERM handler with its own exit."""
    if backend == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    last = run_dir / "checkpoints" / "last.pt"
    with _in_own_group(
        *_until_stopped(run_dir),
        f"algorithm.num_learners={learners}",
        f"runner.backend={backend}",
        *QUIET,
        cwd=tmp_path,
    ) as proc:
        deadline = time.monotonic() + 120  # a busy machine: a learner process starts slowly
        while not last.is_file():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.1)
        assert proc.pid in _process_group(proc.pid)
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)

    assert proc.returncode == 130, err
    assert "Traceback" not in err
    summary = json.loads(out)
    assert summary["stopped_because"] == "interrupted"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    data = checkpoint.load(last)
    assert data["counters"]["updates"] == summary["updates"]
    assert data["counters"]["env_steps"] == summary["env_steps"]
    assert summary["updates"] >= 2  # at least the epoch that wrote the first checkpoint
    # Nothing it started outlives it.
    assert _process_group(proc.pid) == []


def _wait_for(path: Path, proc: subprocess.Popen, read_fd: int | None = None) -> None:
    """Wait until ``path`` exists (a busy machine: a learner process starts slowly), reading
    what the run writes to ``read_fd`` meanwhile (a terminal's buffer that fills up would
    stop it)."""
    deadline = time.monotonic() + 120
    while not path.is_file():
        assert proc.poll() is None, f"the run ended with code {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} within 120 s"
        if read_fd is None:
            time.sleep(0.1)
        elif select.select([read_fd], [], [], 0.1)[0]:
            with suppress(OSError):
                os.read(read_fd, 1 << 16)


def _on_a_terminal_that_closes(*args: str, cwd: Path, hangup: Any, once: Path) -> subprocess.Popen:
    """``impala ARGS`` on a pseudo-terminal, started with SIGHUP's disposition ``hangup``;
    once ``once`` exists the terminal closes (writes to it fail from then on) and its shell's
    SIGHUP reaches the run's group. The run's process, after it ended."""
    import pty

    master, terminal = pty.openpty()
    try:
        with _in_own_group(
            *args,
            cwd=cwd,
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
        ) as proc:
            os.close(terminal)
            terminal = -1
            _wait_for(once, proc, read_fd=master)
            os.close(master)  # the terminal is gone
            master = -1
            os.killpg(proc.pid, signal.SIGHUP)
            assert proc.poll() is None, "the run ended before its terminal closed"
            proc.wait(timeout=120)
    finally:
        for fd in (master, terminal):
            if fd >= 0:
                os.close(fd)
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("learners", "backend"),
    [(1, "subprocess"), (2, "sequential")],
    ids=["subprocess", "2-learners"],
)
def test_a_closed_terminal_stops_a_run_cleanly_with_a_checkpoint(tmp_path, learners, backend):
    """The terminal a run writes its live progress to closes (a dropped ssh session, a closed
    window): writes to it fail from then on, and its shell sends SIGHUP to the run's whole
    group. The run stops as on Ctrl-C (a final checkpoint and its summary, exit code 130), its
    actors, forkserver and further learner leave the stop to it, and nothing it started
    outlives it. Before, the run died of the signal with its last epoch's work lost."""
    run_dir = tmp_path / "run"
    last = run_dir / "checkpoints" / "last.pt"
    proc = _on_a_terminal_that_closes(
        *_until_stopped(run_dir),
        f"algorithm.num_learners={learners}",
        f"runner.backend={backend}",
        "log.tensorboard=false",
        cwd=tmp_path,
        # as from a shell, even where this test runs under nohup (SIGHUP ignored, inherited)
        hangup=signal.SIG_DFL,
        once=last,
    )

    assert proc.returncode == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_because"] == "interrupted"
    data = checkpoint.load(last)
    assert data["counters"]["updates"] == summary["updates"] >= 2
    assert _process_group(proc.pid) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_run_started_under_nohup_trains_on_through_a_hangup(tmp_path):
    """``nohup`` ignores SIGHUP before the run starts: the run keeps it ignored and trains on
    through a hangup of its group (more epochs written after it), and stops at Ctrl-C, its
    output in the files it was sent to."""
    run_dir = tmp_path / "run"
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with (
        out_path.open("w") as out,
        err_path.open("w") as err,
        _in_own_group(
            *_until_stopped(run_dir),
            *QUIET,
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
        ) as proc,
    ):
        metrics = run_dir / "metrics.jsonl"
        _wait_for(metrics, proc)
        os.killpg(proc.pid, signal.SIGHUP)
        epochs_then = len(metrics.read_text().splitlines())
        deadline = time.monotonic() + 120
        while len(metrics.read_text().splitlines()) < epochs_then + 3:
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "no further epoch within 120 s"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)

    assert proc.returncode == 130, err_path.read_text()
    assert "Traceback" not in err_path.read_text()
    assert json.loads(out_path.read_text())["stopped_because"] == "interrupted"
    assert _process_group(proc.pid) == []


def _read_to_the_first_epoch(log: Any) -> None:
    """Read a run's log up to its first epoch's line (start-up notes may come before it)."""
    for line in log:
        if line.startswith("epoch="):
            return
    raise AssertionError("the log ended before its first epoch")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_hangup_sent_on_purpose_leaves_a_piped_output_to_its_reader(tmp_path):
    """``kill -HUP`` to a run whose output is piped to a reader that lives on (not a closed
    terminal): the run stops as on Ctrl-C, and its stop's messages and summary still reach
    the reader. Before, the hangup sent both streams to /dev/null at once."""
    run_dir = tmp_path / "run"
    with _in_own_group(
        *_until_stopped(run_dir),
        "log.tensorboard=false",
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    ) as proc:
        _read_to_the_first_epoch(proc.stderr)
        os.killpg(proc.pid, signal.SIGHUP)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert json.loads(out)["stopped_because"] == "interrupted"
    assert "stopping after this update" in err
    assert _process_group(proc.pid) == []


def _to_the_end(run_dir: Path) -> list[str]:
    """CartPole trained to a fixed budget of many epochs, printed line by line."""
    return _cartpole(run_dir, "max_env_steps=30000", "log.tensorboard=false")


def _trained_to_the_end(run_dir: Path, proc: subprocess.Popen) -> None:
    assert proc.returncode == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["env_steps"] >= 30000
    assert _process_group(proc.pid) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("backend", ["sequential", "subprocess"])
def test_a_run_whose_output_pipe_loses_its_reader_trains_to_its_end(tmp_path, backend):
    """``impala train ... 2>&1 | head``: the reader of the run's output ends after a line,
    and every later write fails (EPIPE). The run trains on to its budget, its summary written
    and exit code 0; before, the first failed write ended it with code 1 mid-run."""
    run_dir = tmp_path / "run"
    with _in_own_group(
        *_to_the_end(run_dir), f"runner.backend={backend}", cwd=tmp_path, stderr=subprocess.STDOUT
    ) as proc:
        _read_to_the_first_epoch(proc.stdout)
        proc.stdout.close()  # the reader is gone
        assert proc.poll() is None, "the run ended before its output lost its reader"
        proc.wait(timeout=120)
    _trained_to_the_end(run_dir, proc)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_run_that_ignores_hangups_trains_on_when_its_terminal_closes(tmp_path):
    """A run started with SIGHUP ignored (``trap '' HUP``) and its live progress on a
    terminal: the terminal closes, and every later write fails (EIO). The run trains on to its
    budget, exit code 0; before, its next write ended it with code 1."""
    run_dir = tmp_path / "run"
    proc = _on_a_terminal_that_closes(
        *_to_the_end(run_dir), cwd=tmp_path, hangup=signal.SIG_IGN, once=run_dir / "metrics.jsonl"
    )
    _trained_to_the_end(run_dir, proc)


def test_eval_writes_its_result_as_json_next_to_the_run(tmp_path, capsys):
    from impala_rl import cli

    run_dir = tmp_path / "run"
    _tiny_run(run_dir)
    assert not (run_dir / "eval.json").exists()
    assert cli.main(["eval", str(run_dir), "--episodes", "3", "--seed", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved == {**printed, "which": "best", "stochastic": False, "seed": 4}
    assert saved["episodes"] == 3 and 1.0 <= saved["mean_return"] <= 500.0
    assert not list(run_dir.glob("*.tmp"))


def test_eval_video_without_an_encoder_says_what_to_install(tmp_path, capsys, monkeypatch):
    from impala_rl import cli

    run_dir = tmp_path / "run"
    _tiny_run(run_dir)
    monkeypatch.setitem(sys.modules, "moviepy", None)  # import moviepy -> ImportError
    code = cli.main(["eval", str(run_dir), "--video", str(tmp_path / "cp.mp4")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("impala: error: --video needs an MP4 encoder")
    assert "pip install 'impala-rl[video]'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "cp.mp4").exists() and not (run_dir / "eval.json").exists()


def test_eval_video_records_the_first_episode_to_the_file(tmp_path, capsys):
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")  # classic control renders with pygame
    import imageio_ffmpeg

    from impala_rl import cli

    run_dir = tmp_path / "run"
    _tiny_run(run_dir)
    video = tmp_path / "cp.mp4"
    assert cli.main(["eval", str(run_dir), "--episodes", "2", "--video", str(video)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert video.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    n_frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert n_frames >= 9  # the reset frame and one per step; CartPole lasts 8+ steps
    assert report["episodes"] == 2
    assert json.loads((run_dir / "eval.json").read_text())["video"] == str(video.resolve())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".video")] == []
