"""The ``impala`` command: ``train``, ``eval`` and ``plot`` (``bench`` comes with monitoring)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

EPILOG = """examples:
  impala train cartpole
  impala train cartpole algorithm.lr=3e-4 seed=1 --run-dir runs/cp1
  impala train env.id=Acrobot-v1 max_env_steps=500000   # no preset: defaults for the env
  impala train --config my.yaml max_env_steps=100000
  impala train --resume runs/cp1
  impala eval runs/cp1 --episodes 20          # also writes runs/cp1/eval.json
  impala eval runs/cp1 --episodes 1 --video cp1.mp4
  impala plot runs/cp1 runs/cp2 --out compare.png
  impala tune env.id=Acrobot-v1 --space algorithm.lr='loguniform(1e-5, 1e-2)' --trials 20
  impala tune --config study.yaml --pbt --population 4 --study-dir runs/pbt
"""


TUNE_EPILOG = """a study searches settings with Optuna (TPE, median pruning), each trial an
ordinary run in STUDY_DIR/trials/<n>/seed<s>; --pbt trains a population (STUDY_DIR/members/<i>).
Rerunning the same command continues. STUDY_DIR gets trials.csv, best.yaml (impala train
--config best.yaml runs it) and study.png (population.png). Watch a study live:
optuna-dashboard sqlite:///STUDY_DIR/study.db

examples:
  impala tune env.id=Acrobot-v1 --space algorithm.lr='loguniform(1e-5, 1e-2)' \\
      --space algorithm.entropy_coef='uniform(0, 0.05)' --trials 20 --steps 100000 --jobs 2
  impala tune --config study.yaml            # a tune: section with space, trials, steps, ...
  impala tune minatar_breakout --pbt --space algorithm.lr='loguniform(1e-4, 1e-2)' \\
      --population 4 --steps 2000000 --interval 200000 --study-dir runs/pbt-breakout
"""


def _parser() -> argparse.ArgumentParser:
    from impala_rl.config import list_presets

    parser = argparse.ArgumentParser(
        prog="impala",
        description="IMPALA with V-trace: train and evaluate agents.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    from impala_rl import __version__

    parser.add_argument("--version", action="version", version=f"impala-rl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train an agent",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    train.add_argument(
        "items",
        nargs="*",
        metavar="[PRESET] [key=value ...]",
        help=f"a preset ({', '.join(list_presets())}) or YAML path, then "
        "config overrides such as algorithm.lr=3e-4; without a preset, env.id=ID gets "
        "defaults for that env (printed at start), and no env.id the cartpole preset",
    )
    train.add_argument("--config", help="a YAML config file (instead of a preset)")
    train.add_argument("--run-dir", help="where to write the run (default runs/<env>-<time>)")
    train.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint"
    )
    tune = sub.add_parser(
        "tune",
        help="search settings (Optuna) or train a population (PBT)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=TUNE_EPILOG,
    )
    tune.add_argument(
        "items", nargs="*", metavar="[PRESET] [key=value ...]", help="as for impala train"
    )
    tune.add_argument("--config", help="a YAML config file; its tune: section sets the study")
    tune.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=DIST",
        help="a key to search: loguniform(lo, hi), uniform(lo, hi), int(lo, hi), intlog(lo, "
        "hi) or choice(a, b, ...); once per key",
    )
    tune.add_argument("--trials", type=int, help="trials to finish (20)")
    tune.add_argument("--steps", type=int, help="env steps per trial, or per member (100000)")
    tune.add_argument("--jobs", type=int, help="trials (or members) trained at once (1)")
    tune.add_argument("--seeds", type=int, nargs="+", help="seeds each trial runs, averaged (0)")
    tune.add_argument("--objective", help="the statistic to maximize (eval_return/mean)")
    tune.add_argument("--minimize", action="store_true", help="minimize the objective")
    tune.add_argument("--no-prune", action="store_true", help="no median pruning")
    tune.add_argument("--study-dir", help="the study's directory (runs/tune, runs/pbt)")
    tune.add_argument(
        "--ray",
        action="store_true",
        help="trials as Ray tasks: on runner.ray_address's cluster, else a Ray of this machine",
    )
    tune.add_argument("--pbt", action="store_true", help="population-based training")
    tune.add_argument("--population", type=int, help="PBT: members (4)")
    tune.add_argument("--interval", type=int, help="PBT: env steps between exploits (50000)")
    tune.add_argument("--quantile", type=float, help="PBT: bottom and top share (0.25)")
    tune.add_argument(
        "--no-exploit", action="store_true", help="PBT: the same members, trained apart"
    )
    ev = sub.add_parser("eval", help="evaluate a trained run's best policy")
    ev.add_argument("run_dir")
    ev.add_argument("--episodes", type=int, default=10)
    ev.add_argument("--stochastic", action="store_true", help="sample instead of the mode")
    ev.add_argument("--render", action="store_true", help="show the env (render_mode=human)")
    ev.add_argument("--which", choices=("best", "last"), default="best")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument(
        "--max-episode-steps",
        type=int,
        help="cut episodes after this many steps (default: the run's "
        "algorithm.rollout_evaluator.max_episode_steps)",
    )
    ev.add_argument(
        "--video",
        metavar="FILE.mp4",
        help="record the first episode (needs rgb_array rendering and MoviePy)",
    )
    plot = sub.add_parser("plot", help="draw runs' metrics.jsonl into a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs to overlay")
    plot.add_argument(
        "--out",
        metavar="FILE.png",
        help="where to write (default RUN_DIR/plots.png for one run, ./impala_plots.png "
        "for several)",
    )
    return parser


def _split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    """``[PRESET] [key=value ...]``: the first item is a preset unless it has an ``=``."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _train(args: argparse.Namespace) -> int:
    from impala_rl.env_defaults import resolve_config
    from impala_rl.policy import load_run_config
    from impala_rl.trainer import Trainer

    preset, overrides = _split_preset(args.items)
    if args.resume:
        if preset or args.config:
            raise _UsageError(
                "--resume continues a run with its saved config; "
                "give only key=value overrides with it"
            )
        cfg = load_run_config(args.resume, overrides)
        trainer = Trainer(cfg, run_dir=args.resume, resume=True)
    else:
        if preset and args.config:
            raise _UsageError("give a preset or --config FILE, not both")
        cfg = resolve_config(args.config or preset, overrides)
        trainer = Trainer(cfg, run_dir=args.run_dir)
    try:
        summary = trainer.train()
    except BaseException as exc:
        if hasattr(exc, "summary"):  # the run started, then failed: what it did, for scripts
            print(json.dumps(exc.summary, indent=2))
        raise
    finally:
        from impala_rl.helper_processes import stop_helper_processes

        stop_helper_processes()  # this process ends here: nothing it started may outlive it
    print(json.dumps(summary, indent=2))
    return 130 if summary["stopped_because"] == "interrupted" else 0


def _tune(args: argparse.Namespace) -> int:
    from impala_rl.tune.cli import run_tune

    preset, overrides = _split_preset(args.items)
    if preset and args.config:
        raise _UsageError("give a preset or --config FILE, not both")
    return run_tune(args, args.config or preset, overrides)


def _eval(args: argparse.Namespace) -> int:
    import numpy as np

    from impala_rl.envs import EnvFactory
    from impala_rl.evaluation import evaluate
    from impala_rl.policy import load_policy

    if args.episodes < 1:
        raise _UsageError("--episodes must be >= 1")
    if args.max_episode_steps is not None and args.max_episode_steps < 1:
        raise _UsageError("--max-episode-steps must be >= 1")
    if args.video and (args.render or not args.video.endswith(".mp4")):
        raise _UsageError("--video takes a FILE.mp4 and does not go with --render")
    run_dir = Path(args.run_dir)
    policy = load_policy(run_dir, args.which)
    max_steps = args.max_episode_steps
    if max_steps is None:
        max_steps = policy.config.algorithm.rollout_evaluator.max_episode_steps
    env_cfg = policy.config.env
    kwargs = {**env_cfg.kwargs, **env_cfg.eval_kwargs}
    if args.render or args.video:
        kwargs["render_mode"] = "human" if args.render else "rgb_array"
    factory = EnvFactory.of(env_cfg, kwargs, vector="python")
    recording = None
    if args.video:
        from impala_rl.envs.video import check_video_support, recording_factory

        video = Path(args.video)
        if video.is_dir():
            raise _UsageError(f"--video {args.video!r} is a directory; give a FILE.mp4")
        check_video_support(factory)
        video.parent.mkdir(parents=True, exist_ok=True)  # as a run directory is made
        recording = recording_factory(factory, video)
    n_parallel = 1 if args.render else args.episodes
    returns: list[float] = []
    wins: list[bool] = []
    try:
        while len(returns) < args.episodes:
            video_now = recording is not None and not returns
            result = evaluate(
                policy.model,
                recording[0] if video_now else factory,  # type: ignore[index]
                1 if video_now else min(n_parallel, args.episodes - len(returns)),
                deterministic=not args.stochastic,
                seed=args.seed + len(returns),
                max_episode_steps=max_steps,
            )
            if video_now:
                from impala_rl.envs.video import finish_recording

                finish_recording(recording[1], Path(args.video))  # type: ignore[index]
            returns += result.returns
            wins += result.wins or []
    finally:
        if recording is not None:
            shutil.rmtree(recording[1], ignore_errors=True)
    report = {
        "episodes": len(returns),
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),
        "min_return": float(np.min(returns)),
        "max_return": float(np.max(returns)),
    }
    if len(wins) == len(returns):
        report["win_rate"] = float(np.mean(wins))
    settings = {"which": args.which, "stochastic": args.stochastic, "seed": args.seed}
    if args.video:
        settings["video"] = str(Path(args.video).resolve())
    path = run_dir / "eval.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**report, **settings}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(json.dumps(report, indent=2))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from impala_rl.plot import plot_runs

    print(plot_runs(args.run_dirs, args.out))
    return 0


class _UsageError(ValueError):
    pass


REFUSED = 2
"""Exit status of a command refused before anything ran (bad settings, a missing run)."""
RUN_FAILED = 1
"""Exit status of a run that started and ended in error (its summary is on stdout)."""


def main(argv: list[str] | None = None) -> int:
    """The ``impala`` command. A console that goes away meanwhile (a pipe's reader ended, a
    terminal closed) ends none of it: the output goes to ``/dev/null`` from then on."""
    from impala_rl.console_output import console_loss_tolerated

    with console_loss_tolerated():
        _working_directory_importable()
        return _command(argv)


def _working_directory_importable() -> None:
    """``env.id=my_env:make_env`` or an import-path network of a file in the working directory
    imports, as under ``python -m``: a console script's ``sys.path`` starts at its own ``bin``
    directory instead. Actor processes and Ray's workers take the parent's ``sys.path``."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _command(argv: list[str] | None) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False, show_time=False)],
    )
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command not in ("train", "tune") or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.items = [*args.items, *extra]
    from impala_rl.config import ConfigError
    from impala_rl.rundir import RunDirError

    user_errors: tuple[type[BaseException], ...] = (
        ConfigError,
        RunDirError,
        _UsageError,
        NotImplementedError,
    )
    if args.command != "plot":  # plot reads metrics.jsonl only: no torch, no envs
        from impala_rl.machine import set_omp_spin_count

        set_omp_spin_count()  # before torch is loaded (impala_rl.checkpoint loads it)
        from impala_rl.checkpoint import CheckpointError
        from impala_rl.envs import EnvError

        user_errors += (EnvError, CheckpointError)
    if args.command == "train":  # only training imports the actors and the learner
        from impala_rl.trainer import TRAINING_ERRORS

        user_errors += TRAINING_ERRORS
    if args.command == "tune":
        from impala_rl.tune.runs import TrainingRunFailed

        user_errors += (TrainingRunFailed,)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "plot":
            return _plot(args)
        return _eval(args)
    except user_errors as exc:
        print(f"impala: error: {exc}", file=sys.stderr)
        return RUN_FAILED if hasattr(exc, "summary") else REFUSED
    except KeyboardInterrupt:
        print("impala: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
