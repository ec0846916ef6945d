"""Learning curves: a preset for a budget of env steps over seeds, resumable, with a PNG.

Each seed trains ``python -m impala_rl.cli train PRESET seed=S max_env_steps=STEPS`` in
``OUT/seed<S>/run`` as its own process, one seed after the other. The preset's other stopping
rules (``target_return``, ``patience``, ``n_epochs``) are switched off so every seed spends
the whole budget; ``key=value`` overrides after the preset are passed on (and win). A seed
whose run directory has a checkpoint continues with ``impala train --resume`` (a killed
benchmark is started again with the same command); one that already spent its budget is only
re-read. Overrides that would change an existing run's settings are refused before anything
starts (a resume trains with the run's saved config). Then it writes:

- ``OUT/seed<S>.json``: env steps and wall time (the trainer's, which a resume continues) at
  which the training return (mean of the last 100 training episodes) first reached each
  ``--thresholds`` value (``null`` if it never did), the same for the evaluation mean and
  ``--eval-thresholds``, the final training return, env steps,
  wall time and whole-run steps/s;
- ``OUT/summary.json``: the per-seed records and the command that reproduces them;
- ``OUT/learning.png``: the training return against env steps and against wall time, the
  seeds overlaid, the thresholds dashed.

    python benchmarks/learning.py cartpole --steps 20000 --seeds 0 1 --out runs/bench-cartpole
    python benchmarks/learning.py pong --steps 5000000 --seeds 1 2 --thresholds -15 0 18 \\
        --out runs/bench-pong --background
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RETURN_KEY = "train_return_recent"
EVAL_KEY = "eval_return/mean"  # the rollout evaluator's deterministic episodes
# Budget runs: the preset's early stops would end seeds at different points of the budget.
BUDGET_OVERRIDES = ["target_return=null", "algorithm.patience=0", "algorithm.n_epochs=0"]


def run_dir_of(out: Path, seed: int) -> Path:
    return out / f"seed{seed}" / "run"


def train_command(preset: str, seed: int, steps: int, overrides: list[str], run_dir: Path) -> list:
    """The ``impala train`` command for one seed: a fresh run, or ``--resume`` of its
    checkpoint."""
    base = [sys.executable, "-m", "impala_rl.cli", "train"]
    budget = [f"max_env_steps={steps}", "log.console=false"]
    if (run_dir / "checkpoints" / "last.pt").is_file():
        return [*base, "--resume", str(run_dir), *budget]
    return [
        *base,
        preset,
        f"seed={seed}",
        *BUDGET_OVERRIDES,
        *budget,
        *overrides,
        "--run-dir",
        str(run_dir),
    ]


def budget_spent(run_dir: Path, steps: int) -> bool:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return False
    data = json.loads(summary.read_text())
    return data.get("stopped_because") not in ("interrupted", "error") and (
        data.get("env_steps", 0) >= steps
    )


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_by(run_dir: Path, overrides: list[str]) -> dict[str, tuple[Any, Any]]:
    """The settings of an existing run that ``overrides`` would change: ``{key: (saved,
    override)}``. A resume trains with the run's saved config, so a changed override would be
    silently ignored and the JSON's command would not reproduce the run."""
    from impala_rl.config import load_config, to_dict
    from impala_rl.policy import load_run_config

    saved = to_dict(load_run_config(run_dir))  # one read of the checkpoint
    wanted = _flat(to_dict(load_config(base=saved, overrides=overrides)))
    flat_saved = _flat(saved)
    return {k: (v, wanted[k]) for k, v in flat_saved.items() if v != wanted[k]}


def refuse_changed_settings(out: Path, seeds: list[int], overrides: list[str]) -> None:
    """Exit (status 2) before anything starts if a seed's existing run has other settings."""
    from impala_rl.config import ConfigError

    for seed in seeds:
        run_dir = run_dir_of(out, seed)
        if not overrides or not (run_dir / "checkpoints" / "last.pt").is_file():
            continue
        try:
            changed = changed_by(run_dir, overrides)
        except ConfigError as exc:
            print(f"learning.py: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if changed:
            listed = ", ".join(
                f"{k}={new!r} (the run has {old!r})" for k, (old, new) in changed.items()
            )
            print(
                f"learning.py: error: seed {seed}'s run in {run_dir} was started with other "
                f"settings: the overrides would change {listed}. Give the run's overrides to "
                "continue it, or another --out for a new run.",
                file=sys.stderr,
            )
            raise SystemExit(2)


def run_seed(preset: str, seed: int, steps: int, overrides: list[str], out: Path) -> None:
    """Train (or resume) one seed until its budget is spent; raise if the trainer fails."""
    run_dir = run_dir_of(out, seed)
    if budget_spent(run_dir, steps):
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = train_command(preset, seed, steps, overrides, run_dir)
    log = run_dir.parent / "train.log"
    with log.open("a") as handle:
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()  # the trainer writes a final checkpoint on SIGTERM
            proc.wait()
            raise
    if code != 0 or not budget_spent(run_dir, steps):
        raise RuntimeError(f"seed {seed}: training exited with {code}; see {log}")


def first_reaching(
    rows: list[dict], threshold: float, key: str = RETURN_KEY
) -> dict[str, float] | None:
    """Env steps and wall time of the first epoch whose ``key`` (the training return; or the
    evaluation mean, ``EVAL_KEY``) is >= threshold."""
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and value >= threshold:
            return {"env_steps": row["env_steps"], "wall_time_s": row["wall_time_s"]}
    return None


def seed_record(
    run_dir: Path, seed: int, thresholds: list[float], eval_thresholds: list[float] = ()
) -> dict[str, Any]:
    """The per-seed JSON record (see the module docstring)."""
    from impala_rl.plot import load_metrics

    rows = load_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    wall = summary["wall_time_s"]
    return {
        "seed": seed,
        "env_steps": summary["env_steps"],
        "wall_time_s": wall,
        "steps_per_second": summary["env_steps"] / wall if wall else None,
        "final_return": summary["train_return_recent"],
        "best_eval_return": summary["best_eval_return"],
        "thresholds": {str(t): first_reaching(rows, t) for t in thresholds},
        "eval_thresholds": {str(t): first_reaching(rows, t, EVAL_KEY) for t in eval_thresholds},
        "run_dir": str(run_dir),
    }


def plot(out: Path, seeds: list[int], thresholds: list[float]) -> Path:
    """Training return against env steps and wall time, one line per seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from impala_rl.plot import _series, load_metrics

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_steps, ax_wall = fig.subplots(1, 2)
    for i, seed in enumerate(seeds):
        rows = load_metrics(run_dir_of(out, seed))
        for ax, x_key in ((ax_steps, "env_steps"), (ax_wall, "wall_time_s")):
            xs, ys = _series(rows, x_key, RETURN_KEY)
            scale = 60.0 if x_key == "wall_time_s" else 1.0
            ax.plot([x / scale for x in xs], ys, color=f"C{i % 10}", label=f"seed {seed}")
    for ax, xlabel in ((ax_steps, "env steps"), (ax_wall, "wall time (min)")):
        for threshold in thresholds:
            ax.axhline(threshold, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training return (mean of last 100 episodes)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    path = out / "learning.png"
    fig.savefig(path, dpi=100, format="png")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", help="preset name or config file")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--steps", type=int, required=True, help="env steps per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--thresholds", type=float, nargs="*", default=[])
    parser.add_argument(
        "--eval-thresholds",
        type=float,
        nargs="*",
        default=[],
        help="also record where the evaluation mean first reaches each value",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--background", action="store_true", help="detach; progress goes to OUT/learning.log"
    )
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    bad = [item for item in args.overrides if "=" not in item]
    if bad:
        parser.error(f"overrides are key=value, got {bad}")
    return args


RESUME_HINT = "interrupted: the trainer kept its checkpoint; the same command resumes"


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    print(RESUME_HINT, file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)  # run_seed stops its trainer (which checkpoints) on the way out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    refuse_changed_settings(out, args.seeds, args.overrides)
    if args.background:
        log = (out / "learning.log").open("a")
        rest = [a for a in argv if a != "--background"]
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *rest],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the terminal; stop it with kill PID (SIGTERM)
        )
        print(json.dumps({"pid": proc.pid, "log": str(out / "learning.log")}))
        return None
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `kill PID` must not orphan the trainer
    thresholds = sorted(args.thresholds)
    records = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        run_seed(args.preset, seed, args.steps, args.overrides, out)
        record = seed_record(run_dir_of(out, seed), seed, thresholds, args.eval_thresholds)
        (out / f"seed{seed}.json").write_text(json.dumps(record, indent=2) + "\n")
        records.append(record)
        print(
            f"seed {seed}: final return {record['final_return']}, "
            f"{record['steps_per_second']:.0f} steps/s ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    finals = [r["final_return"] for r in records if r["final_return"] is not None]
    summary = {
        "preset": args.preset,
        "overrides": args.overrides,
        "steps": args.steps,
        "command": shlex.join(["python", "benchmarks/learning.py", *argv]),
        "median_final_return": statistics.median(finals) if finals else None,
        "seeds": records,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(plot(out, args.seeds, thresholds), flush=True)
    return summary


if __name__ == "__main__":
    # A shell's `command &` (nohup, scripts) starts it with SIGINT ignored: `kill -INT PID`
    # would then do nothing while the trainer trains on. Ctrl-C and kill -INT both stop it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: run_seed has stopped the trainer on the way out
        print(RESUME_HINT, file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
