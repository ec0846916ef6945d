"""``impala tune``: a search over config keys with Optuna, each trial an ordinary run.

Optuna's TPE sampler proposes each trial's values and its median pruner stops a trial whose
evaluation curve falls below the median of earlier trials at the same env step (RL-Zoo's
``--optimize``): a well-kept library with an embedded storage (SQLite, ``study.db`` in the
study directory) that its dashboard reads, and a storage proxy for trials on other machines.

The study directory holds ``study.json`` (what the study searches: a rerun of another study
there is refused), ``study.db``, one run directory per trial and seed
(``trials/<n>/seed<s>``), and what the report writes: ``trials.csv``, ``best.yaml`` (the base
config with the best values: ``impala train --config best.yaml`` runs it) and ``study.png``.
Rerunning the same command continues the study: finished trials stay, and a trial the tuner
was stopped in (Ctrl-C, SIGTERM, or a SIGKILL, after which its runs ended with it) is run
again with the same values, resuming its runs from their checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from impala_rl.config import ConfigError
from impala_rl.group_signals import detach_output_on_hangup, stop_signals
from impala_rl.machine import available_cores
from impala_rl.rundir import lock_run_dir
from impala_rl.tune.runs import TrainingRun, finite, is_statistic, statistic_names
from impala_rl.tune.space import Param, overrides_of, parse_space

log = logging.getLogger(__name__)

OBJECTIVE = "eval_return/mean"
STUDY_NAME = "impala"
"""The study's name in ``study.db`` (one study a folder)."""


@dataclass
class StudySettings:
    """What a study searches and how (``study.json``)."""

    preset: str | None
    overrides: list[str]
    space: list[str]
    trials: int = 20
    steps: int = 100_000
    jobs: int = 1
    seeds: list[int] = field(default_factory=lambda: [0])
    objective: str = OBJECTIVE
    direction: str = "maximize"
    sampler_seed: int = 0
    prune: bool = True
    ray: bool = False  # trials as Ray tasks: on runner.ray_address's cluster, else a local Ray
    study_dir: str = "runs/study"

    def key(self) -> dict[str, Any]:
        """What a rerun must share with the study it continues (``trials`` and ``jobs`` may
        change)."""
        data = asdict(self)
        for name in ("trials", "jobs", "study_dir", "ray"):
            data.pop(name)
        return data


def check_settings(s: StudySettings) -> list[Param]:
    """Everything a study needs, refused before anything starts, naming the field."""
    if s.trials < 1:
        raise ConfigError(f"tune.trials: {s.trials}; valid: an integer >= 1")
    if s.steps < 1:
        raise ConfigError(f"tune.steps: {s.steps}; valid: an integer >= 1 (env steps per trial)")
    if s.jobs < 1:
        raise ConfigError(f"tune.jobs: {s.jobs}; valid: an integer >= 1")
    if not s.seeds or any(seed < 0 for seed in s.seeds):
        raise ConfigError(f"tune.seeds: {s.seeds}; valid: one or more integers >= 0")
    if s.direction not in ("maximize", "minimize"):
        raise ConfigError(f"tune.direction: {s.direction!r}; valid: maximize | minimize")
    if not is_statistic(s.objective):
        names = [n for n in statistic_names() if "<key>" not in n]
        raise ConfigError(
            f"tune.objective: no run reports {s.objective!r}; valid: a statistic of "
            f"metrics.jsonl, e.g. eval_return/mean, episode_return/mean ({len(names)} in all: "
            "docs/reference.md#events)"
        )
    return parse_space(s.space, s.preset, trial_overrides(s, {}, s.seeds[0]))


def trial_overrides(s: StudySettings, values: dict[str, Any], seed: int) -> list[str]:
    """A trial's settings: the study's overrides, the trial's values, its seed and budget."""
    return [*s.overrides, *overrides_of(values), f"seed={seed}", f"max_env_steps={s.steps}"]


def suggest(trial: Any, param: Param) -> Any:
    """The trial's value of one parameter."""
    if param.kind == "choice":
        index = trial.suggest_categorical(param.key, list(range(len(param.choices))))
        return param.choices[index]
    if param.kind in ("int", "intlog"):
        return trial.suggest_int(param.key, param.low, param.high, log=param.log)
    return trial.suggest_float(param.key, param.low, param.high, log=param.log)


class _Stopped(Exception):
    """The tuner is stopping (Ctrl-C, SIGTERM): the trial's runs were stopped and checkpointed."""


class _QuietStops(logging.Filter):
    """Optuna logs a trial that raised as failed, with the traceback: for a trial that the
    tuner's stop ended (:class:`_Stopped`) neither line says anything true (the table says
    ``stopped``; the trial runs again when the study continues)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Trial "):
            return True
        number = message.split()[1]
        if record.exc_info and isinstance(record.exc_info[1], _Stopped):
            self.stopped.add(number)
            return False
        return not (number in self.stopped and " failed with value " in message)


class Study:
    """A study in ``settings.study_dir``: create or continue it, run its trials, report."""

    def __init__(self, settings: StudySettings):
        from impala_rl.env_defaults import resolve_config

        self.s = settings
        self.space = check_settings(settings)
        self.dir = Path(settings.study_dir)
        self.ray_address = resolve_config(settings.preset, settings.overrides).runner.ray_address
        self._stopping = threading.Event()
        self._runs: set[TrainingRun] = set()
        self._runs_lock = threading.Lock()
        self.on_ray = False

    @property
    def stopping(self) -> bool:
        """Whether the tuner was told to stop (Ctrl-C, SIGTERM)."""
        return self._stopping.is_set()

    # -- the study's files ------------------------------------------------------------------
    def _check_study_file(self) -> None:
        path = self.dir / "study.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved != self.s.key():
                changed = sorted(k for k in saved if saved.get(k) != self.s.key().get(k))
                raise ConfigError(
                    f"--study-dir {str(self.dir)!r} holds a study with other settings "
                    f"({', '.join(changed)}); rerun it as it was, or use another --study-dir"
                )
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.s.key(), indent=2) + "\n")

    def storage_url(self) -> str:
        return f"sqlite:///{(self.dir / 'study.db').resolve()}"

    def _create_storage_file(self) -> None:
        """``study.db`` with its tables and its study, built aside and renamed into place: a
        reader (the dashboard, a second ``impala tune``) that sees the file never races the
        tuner to create the schema, and finds the study in it."""
        db = self.dir / "study.db"
        if db.is_file():
            return
        from optuna.storages import RDBStorage
        from optuna.study import StudyDirection

        aside = db.with_name("study.db.new")
        aside.unlink(missing_ok=True)
        storage = RDBStorage(f"sqlite:///{aside.resolve()}")
        storage.create_new_study([StudyDirection[self.s.direction.upper()]], study_name=STUDY_NAME)
        storage.remove_session()
        storage.engine.dispose()
        os.replace(aside, db)

    def load(self, storage: Any = None) -> Any:
        """The Optuna study (created on first use)."""
        optuna = import_optuna()

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.s.sampler_seed)
        pruner: Any = optuna.pruners.NopPruner()
        if self.s.prune:  # after 5 trials; not before a trial's third of the budget
            pruner = optuna.pruners.MedianPruner(
                n_startup_trials=5, n_warmup_steps=self.s.steps // 3
            )
        if storage is None:
            self._create_storage_file()
        return optuna.create_study(
            study_name=STUDY_NAME,
            storage=storage or self.storage_url(),
            sampler=sampler,
            pruner=pruner,
            direction=self.s.direction,
            load_if_exists=True,
        )

    # -- running -----------------------------------------------------------------------------
    def run(self, progress: Any = None) -> Any:
        """Run trials until ``trials`` have finished; returns the Optuna study."""
        self._check_study_file()
        lock = lock_run_dir(self.dir)
        try:
            study = self.load()
            self._requeue(study)
            previous = {s: signal.signal(s, self._on_signal) for s in stop_signals()}
            optuna_log, quiet = logging.getLogger("optuna.study._optimize"), _QuietStops()
            optuna_log.addFilter(quiet)
            try:
                if self.s.ray or self.ray_address is not None:
                    self._run_on_ray(study, progress)
                while not self._stopping.is_set():
                    left = self.s.trials - len(self.finished(study))
                    if left <= 0:
                        break
                    study.optimize(
                        self.objective,
                        n_trials=left,
                        n_jobs=self.s.jobs,
                        callbacks=[progress] if progress else None,
                    )
            except _Stopped:
                pass
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
                self._stop_runs()
                optuna_log.removeFilter(quiet)
            self._requeue(study)
            return study
        finally:
            lock.close()

    def _run_on_ray(self, study: Any, progress: Any) -> None:
        """``jobs`` Ray tasks, anywhere on the cluster (a Ray of this machine without
        ``runner.ray_address``), each running trials against this
        study's storage through Optuna's gRPC storage proxy served from here, until
        ``trials`` have finished. Each task's runs are its node's processes; their run
        directories are written on that node, under the same path."""
        import socket

        import ray
        from optuna.storages import run_grpc_proxy_server

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"log_to_driver": False}
            if self.ray_address is None:  # a Ray of this machine, for this study
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                kwargs.update(
                    num_cpus=max(self.s.jobs, available_cores()),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                )
            ray.init(address=self.ray_address, **kwargs)
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:  # a free port for the proxy
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        storage = study._storage
        server = threading.Thread(
            target=run_grpc_proxy_server,
            args=(storage,),
            kwargs={"host": "0.0.0.0", "port": port},
            daemon=True,
        )
        server.start()
        settings = asdict(self.s)
        task = ray.remote(num_cpus=1)(_trials_on_ray)
        refs = [
            task.remote(settings, host, port, str(self.dir.resolve())) for _ in range(self.s.jobs)
        ]
        pending = list(refs)
        while pending and not self._stopping.is_set():
            _, pending = ray.wait(pending, timeout=1.0)
            if progress is not None:
                progress.refresh(study)
        self.on_ray = True
        if pending:  # stopping: each task's runs checkpoint as they end
            for ref in pending:
                ray.cancel(ref)
            return
        ray.get(refs)  # a task's error, if any

    def _on_signal(self, signum: int, _frame: Any) -> None:
        detach_output_on_hangup(signum)
        if not self._stopping.is_set():
            log.warning("stopping the study: the running trials checkpoint and stop")
        self._stopping.set()
        threading.Thread(target=self._stop_runs, daemon=True).start()

    def _stop_runs(self) -> None:
        with self._runs_lock:
            runs = list(self._runs)
        for run in runs:
            run.stop()

    # A trial the tuner was stopped in is failed in the storage and queued again with its
    # values, to resume its runs; interrupted.json lists them, so they do not count.
    def _interrupted(self) -> set[int]:
        path = self.dir / "interrupted.json"
        return set(json.loads(path.read_text())) if path.is_file() else set()

    def _requeue(self, study: Any) -> None:
        """Trials left running by a tuner that was killed, and those it stopped: failed, then
        queued again with the same values (and run directories)."""
        from optuna.trial import TrialState

        interrupted = self._interrupted()
        for trial in study.get_trials(deepcopy=False):
            stale = trial.state == TrialState.RUNNING
            stopped = trial.state == TrialState.FAIL and trial.user_attrs.get("stopped")
            if not (stale or stopped) or trial.number in interrupted:
                continue
            if stale:
                study.tell(trial.number, state=TrialState.FAIL)
            interrupted.add(trial.number)
            attrs = {"resume_from": trial.user_attrs.get("run_dir", str(trial.number))}
            study.enqueue_trial(trial.params, user_attrs=attrs, skip_if_exists=False)
        path = self.dir / "interrupted.json"
        path.write_text(json.dumps(sorted(interrupted)) + "\n")

    def finished(self, study: Any) -> list[Any]:
        """The trials that count towards ``trials``: complete, pruned or failed, but not those
        the tuner was stopped in (they run again)."""
        from optuna.trial import TrialState

        done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        interrupted = self._interrupted()
        return [
            t
            for t in study.get_trials(deepcopy=False, states=done)
            if t.number not in interrupted and not t.user_attrs.get("stopped")
        ]

    def objective(self, trial: Any) -> float:
        """One trial: a run per seed with the trial's values; the mean of each run's last
        ``objective`` statistic. A run whose curve is pruned stops as on Ctrl-C."""
        optuna = import_optuna()

        if self._stopping.is_set():
            trial.set_user_attr("stopped", True)
            raise _Stopped
        values = {p.key: suggest(trial, p) for p in self.space}
        trial_dir = self.dir / "trials" / str(trial.user_attrs.get("resume_from", trial.number))
        trial.set_user_attr("run_dir", trial_dir.name)
        scores = []
        for i, seed in enumerate(self.s.seeds):
            run_dir = trial_dir / f"seed{seed}"
            resume = (run_dir / "checkpoints" / "last.pt").is_file()
            overrides = trial_overrides(self.s, values, seed)
            if resume:  # a run this trial began before the tuner stopped
                overrides = [f"max_env_steps={self.s.steps}"]
            run = TrainingRun(run_dir, self.s.preset, overrides, resume=resume)
            with self._runs_lock:
                self._runs.add(run)
            last, pruned = None, False
            try:
                for row in run.epochs():
                    value = row.get(self.s.objective)
                    if not finite(value):
                        continue
                    last = float(value)
                    trial.report(last, step=i * self.s.steps + int(row["env_steps"]))
                    if self.s.prune and trial.should_prune():
                        pruned = True
                        run.stop()
                        break
                summary = run.wait()
            finally:
                with self._runs_lock:
                    self._runs.discard(run)
            if self._stopping.is_set():
                trial.set_user_attr("stopped", True)
                raise _Stopped
            if pruned:
                raise optuna.TrialPruned()
            if summary is None or summary.get("stopped_because") == "error" or last is None:
                reason = (summary or {}).get("error") or run.failure() or "no evaluation"
                trial.set_user_attr("error", f"seed {seed}: {reason}")
                return math.nan  # a failed trial
            scores.append(last)
        return sum(scores) / len(scores)


def import_optuna() -> Any:
    """Optuna, or an error that says how to install it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("impala tune needs Optuna: pip install 'impala-rl[tune]'") from None
    return optuna


def _trials_on_ray(settings: dict[str, Any], host: str, port: int, study_dir: str) -> int:
    """One Ray task: trials of the study served at ``host:port`` until enough have finished."""
    from optuna.storages import GrpcStorageProxy

    study = Study(StudySettings(**{**settings, "study_dir": study_dir, "jobs": 1}))
    optuna_study = study.load(GrpcStorageProxy(host=host, port=port))
    ran = 0
    while len(study.finished(optuna_study)) < study.s.trials:
        optuna_study.optimize(study.objective, n_trials=1)
        ran += 1
    return ran
