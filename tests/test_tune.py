"""``impala tune``: the search space refused by name, a study that survives a SIGKILL, PBT's
exploit, the best config, and a study on a local Ray cluster."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from impala_rl import checkpoint
from impala_rl.config import ConfigError
from impala_rl.tune.pbt import Population, PopulationSettings, copy_checkpoints
from impala_rl.tune.space import parse_param, parse_space
from impala_rl.tune.study import STUDY_NAME, StudySettings, check_settings
from test_cli import _env, _in_own_group

optuna = pytest.importorskip("optuna")

# a trial: cartpole on the sequential backend, an evaluation every epoch of 640 env steps
TRIAL = ["runner.backend=sequential", "target_return=null", "log.tensorboard=false"]
SPACE = ["algorithm.lr=loguniform(1e-4, 3e-3)", "algorithm.entropy_coef=uniform(0, 0.03)"]


# -- the space ---------------------------------------------------------------------------------
def test_each_kind_of_distribution_parses():
    assert parse_param("algorithm.lr", "loguniform(1e-5, 1e-2)").log
    p = parse_param("algorithm.num_passes", "int(1, 8)")
    assert (p.kind, p.low, p.high) == ("int", 1, 8)
    c = parse_param("model.hidden_sizes", "choice([64, 64], [256, 256])")
    assert c.choices == ([64, 64], [256, 256])
    assert parse_param("model.activation", "choice(tanh, relu)").choices == ("tanh", "relu")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            "algorithm.lrr=uniform(0, 1)",
            r"algorithm\.lrr: not a config key \(did you mean 'algorithm\.lr'",
        ),
        ("algorithm.lr=uniform(0.1, 0.01)", r"algorithm\.lr: an empty range"),
        ("algorithm.lr=uniform(0.1, 0.1)", r"algorithm\.lr: an empty range"),
        ("algorithm.lr=loguniform(0, 0.1)", r"algorithm\.lr: loguniform needs low > 0"),
        (
            "algorithm.num_passes=loguniform(1, 8)",
            r"num_passes: loguniform draws floats.*int or intlog",
        ),
        ("algorithm.lr=int(1, 3)", r"algorithm\.lr: int draws integers.*use uniform"),
        ("model.hidden_sizes=uniform(1, 3)", r"hidden_sizes: uniform draws numbers.*choice"),
        ("model.activation=choice(tanh)", r"activation: choice needs two values"),
        ("algorithm.lr=normal(0, 1)", r"algorithm\.lr: 'normal\(0, 1\)' is not a distribution"),
        (
            "algorithm.gamma=uniform(0.9, 1.5)",
            r"algorithm\.gamma: 1\.5 does not fit the key.*\[0, 1\]",
        ),
        (
            "model.activation=choice(tanh, sigmoid)",
            r"model\.activation: sigmoid does not fit the key",
        ),
        ("algorithm.lr", r"'algorithm\.lr' is not key=distribution"),
    ],
)
def test_bad_input_is_refused_naming_the_parameter(item, message):
    with pytest.raises(ConfigError, match=message):
        parse_space([item], "cartpole", [])


def test_a_key_twice_or_no_key_is_refused():
    with pytest.raises(ConfigError, match="algorithm.lr given more than once"):
        parse_space(
            ["algorithm.lr=uniform(0.1, 0.2)", "algorithm.lr=uniform(0.2, 0.3)"], "cartpole", []
        )
    with pytest.raises(ConfigError, match="no parameter to search"):
        parse_space([], "cartpole", [])


def test_an_objective_no_run_reports_is_refused():
    settings = StudySettings("cartpole", TRIAL, SPACE, objective="eval_reward/mean")
    with pytest.raises(ConfigError, match=r"tune\.objective: no run reports 'eval_reward/mean'"):
        check_settings(settings)
    check_settings(StudySettings("cartpole", TRIAL, SPACE, objective="policy_entropy/0"))


# -- the storage -------------------------------------------------------------------------------
def test_study_db_appears_with_its_tables_and_study_so_a_reader_never_builds_them(
    tmp_path, monkeypatch
):
    import os
    import sqlite3

    from impala_rl.tune.study import Study

    study = Study(StudySettings("cartpole", TRIAL, SPACE, study_dir=str(tmp_path / "s")))
    study.dir.mkdir()
    (study.dir / "study.db.new").write_text("what a killed tuner left")
    tables: list[set[str]] = []
    studies: list[set[str]] = []
    real_replace = os.replace

    def replace(src, dst):  # the moment study.db appears
        db = sqlite3.connect(src)
        tables.append({row[0] for row in db.execute("SELECT name FROM sqlite_master")})
        studies.append({row[0] for row in db.execute("SELECT study_name FROM studies")})
        db.close()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    study.load()
    monkeypatch.undo()
    assert len(tables) == 1 and {"alembic_version", "studies", "trials"} <= tables[0]
    assert studies == [{STUDY_NAME}]  # a reader loads the study at once
    assert not (study.dir / "study.db.new").exists()
    version = sqlite3.connect(study.dir / "study.db").execute("SELECT * FROM alembic_version")
    assert len(version.fetchall()) == 1
    study.load()  # and it loads again as it is
    assert len(_finished_trials(study.dir)) == 0


# -- a study -----------------------------------------------------------------------------------
def _tune(study_dir: Path, trials: int, *extra: str) -> list[str]:
    space = [f"--space={item}" for item in SPACE]
    return [
        sys.executable, "-m", "impala_rl.cli", "tune", "cartpole", *TRIAL, *space,
        "--trials", str(trials), "--steps", "1920", "--study-dir", str(study_dir), *extra,
    ]  # fmt: skip


def _processes_under(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (a run of the study)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(path) in cmdline and "impala_rl.cli" in cmdline:
                pids.append(int(entry.name))
    return pids


def _wait_for(condition, timeout: float = 300.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _finished_trials(study_dir: Path) -> dict[int, tuple[float, dict]]:
    study = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{study_dir / 'study.db'}")
    return {
        t.number: (t.value, t.params)
        for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    }


def test_a_study_killed_with_sigkill_resumes_with_its_finished_trials(tmp_path):
    study_dir = tmp_path / "study"
    tuner = subprocess.Popen(
        _tune(study_dir, 3), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_for(
            lambda: (study_dir / "study.db").is_file() and len(_finished_trials(study_dir)) >= 1,
            what="a finished trial",
        )
        _wait_for(lambda: _processes_under(study_dir / "trials"), what="the next trial's run")
    finally:
        tuner.send_signal(signal.SIGKILL)
        tuner.wait()
    before = _finished_trials(study_dir)
    # the runs end with the tuner
    _wait_for(lambda: not _processes_under(study_dir), timeout=120, what="no run left behind")
    proc = subprocess.run(
        _tune(study_dir, 3), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = _finished_trials(study_dir)
    assert all(after[n] == before[n] for n in before)  # finished trials intact
    report = json.loads(proc.stdout)
    assert report["trials"] == 3 and report["best_value"] is not None
    # the trial that was killed ran again from its checkpoint, with its values
    interrupted = json.loads((study_dir / "interrupted.json").read_text())
    assert interrupted
    assert not _processes_under(study_dir)
    # the report
    assert (study_dir / "study.png").is_file() and (study_dir / "trials.csv").is_file()
    best = study_dir / "best.yaml"
    assert "algorithm:" in best.read_text()
    # the best config runs with impala train --config
    run = subprocess.run(
        [sys.executable, "-m", "impala_rl.cli", "train", "--config", str(best), "max_env_steps=640",
         "log.console=false", "--run-dir", str(tmp_path / "best-run")],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lr = float(report["best_params"]["algorithm.lr"])
    saved = checkpoint.load(tmp_path / "best-run" / "checkpoints" / "last.pt")["config"]
    assert saved["algorithm"]["lr"] == pytest.approx(lr)
    # each trial is an ordinary run directory
    trial_dir = next((study_dir / "trials").glob("*/seed0"))
    assert (trial_dir / "checkpoints" / "last.pt").is_file()


def test_a_study_stopped_with_ctrl_c_says_so_and_continues_its_stopped_trial(tmp_path):
    """Ctrl-C (to the tuner's whole group, as a terminal sends it) stops the running trial's
    run at a checkpoint: the table says ``stopped``, not ``fail``, with no traceback of
    Optuna's; the same command again runs that trial on from its checkpoint, with its values."""
    study_dir = tmp_path / "study"
    command = _tune(study_dir, 2, "--steps=12000", "algorithm.epoch_length=1")
    with _in_own_group(*command[command.index("tune") :], cwd=tmp_path) as tuner:
        _wait_for(
            lambda: (
                tuner.poll() is not None
                or list(study_dir.glob("trials/*/seed0/checkpoints/last.pt"))
            ),
            what="a checkpoint of the first trial's run",
        )
        assert tuner.poll() is None, tuner.communicate()
        os.killpg(tuner.pid, signal.SIGINT)
        out, err = tuner.communicate(timeout=120)
    assert tuner.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "failed" not in err, err[-3000:]
    with (study_dir / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    stopped = [r for r in rows if r["state"] == "stopped"]
    assert len(stopped) == 1 and not stopped[0]["error"], rows
    waiting = [r for r in rows if r["state"] == "waiting"]  # the same values, the same run
    assert [(r["algorithm.lr"], r["run_dir"]) for r in waiting] == [
        (stopped[0]["algorithm.lr"], stopped[0]["run_dir"])
    ], rows
    run_dir = study_dir / "trials" / stopped[0]["run_dir"] / "seed0"
    steps_at_stop = json.loads((run_dir / "summary.json").read_text())["env_steps"]
    assert steps_at_stop < 12000

    proc = subprocess.run(
        _tune(study_dir, 2, "--steps=12000", "algorithm.epoch_length=1"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished = _finished_trials(study_dir)
    assert len(finished) == 2
    lr = float(stopped[0]["algorithm.lr"])
    assert any(params["algorithm.lr"] == pytest.approx(lr) for _, params in finished.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] >= 12000  # went on from the checkpoint, in the same directory


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    (study_dir / "study.json").write_text(json.dumps({"preset": "other"}))
    proc = subprocess.run(
        _tune(study_dir, 1), env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "holds a study with other settings" in proc.stderr


def test_a_failed_trial_says_why_and_the_study_goes_on(tmp_path):
    """A value the config's own rules take but a run refuses at start (a minibatch count that
    does not divide the batch's columns) fails its trial with the run's error, on the console
    and in trials.csv; the other trials run."""
    study_dir = tmp_path / "study"
    command = [
        sys.executable, "-m", "impala_rl.cli", "tune", "cartpole", *TRIAL,
        "algorithm.num_actors=1", "algorithm.envs_per_actor=4", "algorithm.actors_batch_size=1",
        "--space=algorithm.num_minibatches=choice(3, 4)", "--no-prune",
        "--trials", "4", "--steps", "1920", "--study-dir", str(study_dir),
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (study_dir / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    failed = [r for r in rows if r["state"] == "fail"]
    assert failed and all(r["algorithm.num_minibatches"] == "3" for r in failed), rows
    assert all("algorithm.num_minibatches" in r["error"] for r in failed)
    assert any(r["state"] == "complete" and not r["error"] for r in rows)
    assert "a divisor of the batch's 4 columns" in proc.stderr


# -- population-based training ------------------------------------------------------------------
def test_an_exploit_gives_the_member_the_sources_weights_and_optimizer_state(tmp_path):
    settings = PopulationSettings(
        "cartpole",
        TRIAL,
        ["algorithm.lr=loguniform(1e-4, 3e-3)"],
        population=2,
        steps=1280,
        interval=640,
        quantile=0.5,
        study_dir=str(tmp_path / "pbt"),
    )
    population = Population(settings)
    state = population._load_state()
    population._train_round(state, 640)
    scores = [population._score(population.member_dir(i)) for i in range(2)]
    state["rounds"].append({"round": 0, "env_steps": 640, "members": [
        {"values": m["values"], "score": scores[i], "parent": None}
        for i, m in enumerate(state["members"])
    ]})  # fmt: skip
    population._exploit(state, 0)
    loser = 0 if scores[0] < scores[1] or (scores[0] == scores[1]) else 1
    source = 1 - loser
    assert state["members"][loser]["parent"] == source
    mine = checkpoint.load(population.member_dir(loser) / "checkpoints" / "last.pt")
    theirs = checkpoint.load(population.member_dir(source) / "checkpoints" / "last.pt")
    for name, tensor in theirs["model"].items():
        assert torch.equal(mine["model"][name], tensor), name
    for i, param_state in theirs["optimizer"]["state"].items():
        for k, v in param_state.items():
            assert torch.equal(
                torch.as_tensor(mine["optimizer"]["state"][i][k]), torch.as_tensor(v)
            )
    new_lr = state["members"][loser]["values"]["algorithm.lr"]
    old_lr = state["members"][source]["values"]["algorithm.lr"]
    assert new_lr in (pytest.approx(old_lr * 0.8), pytest.approx(old_lr * 1.2)) or new_lr in (
        1e-4,
        3e-3,
    )


def test_a_population_trains_its_rounds_and_records_its_lineage(tmp_path):
    study_dir = tmp_path / "pbt"
    command = [
        sys.executable, "-m", "impala_rl.cli", "tune", "cartpole", *TRIAL, "--pbt",
        "--space", "algorithm.lr=loguniform(1e-4, 3e-3)", "--population", "2", "--steps", "1920",
        "--interval", "640", "--quantile", "0.5", "--study-dir", str(study_dir),
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((study_dir / "population.json").read_text())
    assert state["round"] == 3 and len(state["rounds"]) == 3
    assert sum(m["parent"] is not None for r in state["rounds"][1:] for m in r["members"]) == 2
    assert (study_dir / "population.png").is_file()
    for i in range(2):
        summary = json.loads((study_dir / "members" / str(i) / "summary.json").read_text())
        assert summary["env_steps"] >= 1920
    # the same command again: nothing left to train
    again = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and json.loads(again.stdout)["rounds"] == 3


def test_copying_checkpoints_replaces_the_targets_files(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / "last.pt").write_bytes(name.encode())
    copy_checkpoints(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "checkpoints" / "last.pt").read_bytes() == b"a"


# -- Ray ------------------------------------------------------------------------------------------
def test_a_small_study_runs_its_trials_on_a_local_ray_cluster(tmp_path):
    """``--ray`` without ``runner.ray_address``: a Ray of this machine; two jobs, a Ray task
    each, run the trials against the study's storage through Optuna's storage proxy."""
    pytest.importorskip("ray")
    study_dir = tmp_path / "study"
    env = {**_env(), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        _tune(study_dir, 2, "--jobs", "2", "--ray"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["trials"] >= 2 and report["on_ray"]
    assert len(_finished_trials(study_dir)) >= 2
    assert not _processes_under(study_dir)
