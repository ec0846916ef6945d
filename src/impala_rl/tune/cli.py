"""``impala tune``'s command: its settings from the flags and a study file's ``tune:`` section,
a progress display while it runs, then the report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from impala_rl.config import ConfigError

TUNE_KEYS = {
    "space": dict,
    "trials": int,
    "steps": int,
    "jobs": int,
    "seeds": list,
    "objective": str,
    "direction": str,
    "prune": bool,
    "population": int,
    "interval": int,
    "quantile": float,
    "exploit": bool,
}


def study_file_settings(path: str, study_dir: Path) -> tuple[str, dict[str, Any]]:
    """A config file's ``tune:`` section, and the path of the file without it (the config the
    trials run, written into the study directory)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    if not isinstance(data, dict) or "tune" not in data:
        return path, {}
    section = data.pop("tune") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: tune: a mapping of {', '.join(TUNE_KEYS)}")
    for key, value in section.items():
        if key not in TUNE_KEYS:
            raise ConfigError(f"{path}: unknown key tune.{key}; valid: {', '.join(TUNE_KEYS)}")
        kind = TUNE_KEYS[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ConfigError(f"{path}: tune.{key}={value!r}; valid: a {kind.__name__}")
    study_dir.mkdir(parents=True, exist_ok=True)
    stripped = study_dir / "config.yaml"
    stripped.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(stripped), section


def _pick(flag: Any, section: dict[str, Any], key: str, default: Any) -> Any:
    if flag is not None:
        return flag
    return section.get(key, default)


def run_tune(args: argparse.Namespace, preset: str | None, overrides: list[str]) -> int:
    default_dir = "runs/pbt" if args.pbt else "runs/tune"
    study_dir = Path(args.study_dir or default_dir)
    section: dict[str, Any] = {}
    if args.config:
        preset, section = study_file_settings(args.config, study_dir)
    merged = {str(k): str(v) for k, v in (section.get("space") or {}).items()}
    for item in args.space:  # a flag wins over the file's entry for its key
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--space {item!r}: expected KEY=DISTRIBUTION")
        merged[key.strip()] = value
    space = [f"{k}={v}" for k, v in merged.items()]
    objective = _pick(args.objective, section, "objective", "eval_return/mean")
    jobs = _pick(args.jobs, section, "jobs", 1)
    if args.pbt:
        return _run_population(args, preset, overrides, space, objective, jobs, section, study_dir)
    from impala_rl.tune.study import Study, StudySettings

    direction = "minimize" if args.minimize else section.get("direction", "maximize")
    settings = StudySettings(
        preset=preset,
        overrides=overrides,
        space=space,
        trials=_pick(args.trials, section, "trials", 20),
        steps=_pick(args.steps, section, "steps", 100_000),
        jobs=jobs,
        seeds=_pick(args.seeds, section, "seeds", [0]),
        objective=objective,
        direction=direction,
        prune=not args.no_prune and section.get("prune", True),
        ray=args.ray,
        study_dir=str(study_dir),
    )
    study = Study(settings)
    with _Progress(settings.trials, study) as progress:
        optuna_study = study.run(progress=progress)
    return _report_study(study, optuna_study)


def _report_study(study: Any, optuna_study: Any) -> int:
    from rich.console import Console

    from impala_rl.tune.report import (
        best_values,
        plot_study,
        rich_table,
        trial_rows,
        write_best_config,
        write_trials_csv,
    )

    s = study.s
    rows = trial_rows(optuna_study, study.space, s.direction == "maximize")
    write_trials_csv(rows, study.dir / "trials.csv")
    Console(stderr=True).print(rich_table(rows, f"{len(rows)} trials, best first ({s.objective})"))
    best = best_values(optuna_study, study.space)
    out: dict[str, Any] = {
        "study_dir": str(study.dir),
        "trials": len(study.finished(optuna_study)),
        "stopped": study.stopping,
        "storage": study.storage_url(),
        "on_ray": study.on_ray,
    }
    if best is not None:
        score = optuna_study.best_value
        write_best_config(s.preset, s.overrides, best, s.objective, score, study.dir / "best.yaml")
        plot_study(optuna_study, study.space, s.objective, study.dir / "study.png")
        out.update(
            best_value=score,
            best_trial=optuna_study.best_trial.number,
            best_params=best,
            best_config=str(study.dir / "best.yaml"),
            figure=str(study.dir / "study.png"),
        )
    print(json.dumps(out, indent=2))
    return 130 if study.stopping else 0


def _run_population(
    args: argparse.Namespace,
    preset: str | None,
    overrides: list[str],
    space: list[str],
    objective: str,
    jobs: int,
    section: dict[str, Any],
    study_dir: Path,
) -> int:
    from rich.console import Console

    from impala_rl.tune.pbt import Population, PopulationSettings
    from impala_rl.tune.report import plot_population, population_rows, rich_table

    seeds = _pick(args.seeds, section, "seeds", [0])
    settings = PopulationSettings(
        preset=preset,
        overrides=overrides,
        space=space,
        population=_pick(args.population, section, "population", 4),
        steps=_pick(args.steps, section, "steps", 500_000),
        interval=_pick(args.interval, section, "interval", 50_000),
        quantile=_pick(args.quantile, section, "quantile", 0.25),
        jobs=jobs,
        seed=seeds[0],
        objective=objective,
        exploit=not args.no_exploit and section.get("exploit", True),
        study_dir=str(study_dir),
    )
    population = Population(settings)
    state = population.run()
    rows = population_rows(state, population.space)
    title = f"{len(rows)} members after round {state['round']} of {population.rounds()}"
    Console(stderr=True).print(rich_table(rows, title))
    if state["rounds"]:
        plot_population(state, population.space, objective, population.dir / "population.png")
    out = {
        "study_dir": str(population.dir),
        "rounds": state["round"],
        "of": population.rounds(),
        "members": rows,
        "figure": str(population.dir / "population.png"),
    }
    print(json.dumps(out, indent=2))
    return 0 if state["round"] >= population.rounds() else 130


class _Progress:
    """A live line on stderr (a terminal): trials finished of all, the best value so far; an
    Optuna callback."""

    def __init__(self, total: int, study: Any):
        self.total, self.study = total, study
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = Console(stderr=True)
        if console.is_terminal:
            self._progress = Progress(
                TextColumn("trials"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[best]}"),
                console=console,
            )
            self._progress.start()
            self._task = self._progress.add_task("tune", total=self.total, best="")
        return self

    def refresh(self, optuna_study: Any) -> None:
        """Trials run elsewhere (Ray tasks): the display from the storage."""
        if self._progress is not None:
            done = len(self.study.finished(optuna_study))
            self._progress.update(self._task, completed=done, best=self._best(optuna_study))

    @staticmethod
    def _best(optuna_study: Any) -> str:
        try:
            return f"best {optuna_study.best_value:.4g} (trial {optuna_study.best_trial.number})"
        except ValueError:
            return ""

    def __call__(self, optuna_study: Any, trial: Any) -> None:
        done = len(self.study.finished(optuna_study))
        best = self._best(optuna_study)
        if self._progress is not None:
            self._progress.update(self._task, completed=done, best=best)
            if trial.user_attrs.get("error"):
                self._progress.console.print(
                    f"trial {trial.number} failed: {trial.user_attrs['error']}"
                )
        else:
            from impala_rl.tune.report import trial_state

            value = "-" if trial.value is None else f"{trial.value:.4g}"
            error = trial.user_attrs.get("error")
            print(
                f"trial {trial.number} {trial_state(trial)} {value}; "
                f"{done}/{self.total} finished; {best}" + (f"\n  {error}" if error else ""),
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
