"""The ``impala`` command: ``train``, ``eval`` and ``plot`` (``bench`` comes with monitoring)."""

from __future__ import annotations

import argparse
import json
import logging
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
"""


def _parser() -> argparse.ArgumentParser:
    from impala_rl.config import list_presets

    parser = argparse.ArgumentParser(
        prog="impala",
        description="IMPALA with V-trace: train and evaluate agents.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
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
    finally:
        from impala_rl.actors.subprocess import stop_helper_processes

        stop_helper_processes()  # this process ends here: nothing it started may outlive it
    print(json.dumps(summary, indent=2))
    return 130 if summary["stopped_because"] == "interrupted" else 0


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
    factory = EnvFactory(env_cfg.id, kwargs, env_cfg.max_episode_steps)
    recording = None
    if args.video:
        from impala_rl.envs.video import check_video_support, recording_factory

        check_video_support(factory)
        recording = recording_factory(factory, Path(args.video))
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


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False, show_time=False)],
    )
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "train" or any(e.startswith("-") for e in extra)):
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
        from impala_rl.checkpoint import CheckpointError
        from impala_rl.envs import EnvError

        user_errors += (EnvError, CheckpointError)
    if args.command == "train":  # only training imports the actors and the learner
        from impala_rl.trainer import TRAINING_ERRORS

        user_errors += TRAINING_ERRORS
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "plot":
            return _plot(args)
        return _eval(args)
    except user_errors as exc:
        print(f"impala: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("impala: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
