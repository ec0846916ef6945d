"""Pong training throughput against the compute bound measured in the same run.

Prints

1. the per-step costs, each timed alone on one thread: a preprocessed Pong env step (frame
   skip 4) in one actor's vector env of 8 (ale-py's C++ one with the preset's
   ``env.kwargs.vector=ale``), acting (one decision as the actor loop makes it,
   ``impala_rl.nn.act``: the Nature CNN's policy forward, a sample and its log-probability,
   per observation, at the batch of one actor's envs) and learning (forward, backward and
   RMSProp per sample at the preset's unroll x batch, 80 x 8), times
   ``algorithm.num_passes`` (each pass over a batch is a full update);
2. the compute bound: 2 cores / (env + acting + learning per step);
3. the training rate of the ``pong`` preset (one actor of 8 envs, unroll 80, batch 8) and its
   ratio to the bound, in one of two ways:

   - ``--steps N`` (the default, 192,000 = three of the preset's epochs): the whole process
     as a user runs it, ``impala train pong max_env_steps=N`` in a new Python, timed from its
     start to its exit: imports, start-up, the preset's evaluation (4 episodes in the
     background after each epoch, the last one waited for), checkpoints and shut-down
     included. The steady rate between its first and last epoch is printed next to it.
   - ``--seconds S``: the steady rate alone, in this process, for S seconds with an epoch
     every 12.8k steps and a one-step evaluation (actor start-up and evaluation excluded:
     the rate is taken between the first and last epoch).

    python benchmarks/pong_throughput.py                 # whole process, 192k env steps
    python benchmarks/pong_throughput.py --seconds 45    # steady rate, 45 s of training
    python benchmarks/pong_throughput.py --seconds 20 runner.backend=sequential
    python benchmarks/pong_throughput.py env.kwargs.vector=python   # Gymnasium's wrappers
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from precision import batch_for, median_time  # benchmarks/precision.py (same folder)

import impala_rl
from impala_rl.config import load_config
from impala_rl.envs import EnvFactory, make_vector_env
from impala_rl.learner import Learner
from impala_rl.malloc import keep_freed_memory
from impala_rl.nn import act
from impala_rl.nn.factory import build_model
from impala_rl.plot import load_metrics

CORES = 2


def per_step_costs(overrides: list[str]) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = load_config("pong", overrides)
    if cfg.runner.keep_freed_memory:  # as the trainer sets up its learner process
        keep_freed_memory()
    # One stepping thread: the bound counts CPU time, which the preset's vector_threads spreads.
    kwargs = {**cfg.env.kwargs, "vector_threads": 1} if "vector_threads" in cfg.env.kwargs else {}
    factory = EnvFactory(cfg.env.id, kwargs or cfg.env.kwargs)
    env = factory()
    n = cfg.algorithm.envs_per_actor
    envs = make_vector_env(factory, n)  # as one actor steps them (env.kwargs.vector)
    envs.reset(seed=0)

    actions = np.random.default_rng(0).integers(0, envs.single_action_space.n, (25, n))

    def env_steps(repeats: int = 25) -> None:
        for t in range(repeats):
            envs.step(actions[t])

    env_s = median_time(env_steps, 5) / (25 * n)
    envs.close()
    model = build_model(cfg.model, env.observation_space, env.action_space)
    obs = torch.randint(0, 256, (n, *env.observation_space.shape), dtype=torch.uint8)

    def decide() -> None:
        with torch.inference_mode():
            act(model, 0, obs)

    act_s = median_time(decide, 20) / n
    T = cfg.algorithm.n_rollout_steps
    B = cfg.algorithm.envs_per_actor * cfg.algorithm.actors_batch_size
    learner = Learner(model, cfg.algorithm)
    batch = batch_for(T, B, env.observation_space.shape, int(env.action_space.n))
    passes = cfg.algorithm.num_passes
    learn_s = passes * median_time(lambda: learner.update(batch), 3) / (T * B)
    env.close()
    return {"env": env_s, "act": act_s, "learn": learn_s}


def rate_between_epochs(run_dir: str) -> float | None:
    """Env steps/s between a run's first and last epoch (``None`` with fewer than two)."""
    rows = load_metrics(run_dir)  # one row per epoch
    if len(rows) < 2:
        return None
    steps = rows[-1]["env_steps"] - rows[0]["env_steps"]
    return steps / (rows[-1]["wall_time_s"] - rows[0]["wall_time_s"])


def training_rate(seconds: float, overrides: list[str]) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="impala-pong-") as run_dir:
        summary = impala_rl.train(
            "pong",
            [
                "algorithm.epoch_length=20",  # evaluation (a new env) once per 12.8k steps
                "algorithm.rollout_evaluator.n_episodes=1",
                "algorithm.rollout_evaluator.max_episode_steps=1",
                "target_return=null",
                f"max_wall_time_s={seconds}",
                "log.console=false",
                "log.tensorboard=false",
                *overrides,
            ],
            run_dir=run_dir,
        )
        steady = rate_between_epochs(run_dir)
    if steady is None:
        steady = summary["env_steps"] / summary["wall_time_s"]
    return steady, summary


def whole_process_rate(steps: int, overrides: list[str]) -> tuple[float, float | None, int]:
    """``impala train pong max_env_steps=steps`` in a new Python: env steps over the time from
    its start to its exit, the steady rate between its first and last epoch (``None`` with
    fewer than two epochs), and the env steps it took."""
    with tempfile.TemporaryDirectory(prefix="impala-pong-") as run_dir:
        command = [
            sys.executable,
            *("-m", "impala_rl.cli", "train", "pong"),
            f"max_env_steps={steps}",
            "target_return=null",
            *overrides,
            *("--run-dir", run_dir),
        ]
        log = Path(run_dir, "train.log")
        with log.open("w") as out:
            start = time.perf_counter()
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
            wall = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"training failed ({code}):\n{log.read_text()[-3000:]}")
        steady = rate_between_epochs(run_dir)
        taken = json.loads(Path(run_dir, "summary.json").read_text())["env_steps"]
    return taken / wall, steady, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--steps", type=int, default=192_000, help="whole-process run of this many env steps"
    )
    mode.add_argument("--seconds", type=float, help="steady rate alone, for this many seconds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the pong preset")
    args = parser.parse_args()
    costs = per_step_costs(args.overrides)
    per_step = sum(costs.values())
    bound = CORES / per_step
    print("per-step cost, one thread:")
    for name, value in costs.items():
        print(f"  {name:<6} {value * 1e3:.3f} ms")
    print(f"compute bound: {CORES} cores / {per_step * 1e3:.3f} ms = {bound:,.0f} env steps/s")
    if args.seconds is not None:
        rate, summary = training_rate(args.seconds, args.overrides)
        print(
            f"training: {rate:,.0f} env steps/s ({4 * rate:,.0f} frames/s) over "
            f"{summary['env_steps']:,} steps; {rate / bound:.2f} of the compute bound"
        )
        return
    rate, steady, taken = whole_process_rate(args.steps, args.overrides)
    between = "" if steady is None else f"; between epochs {steady:,.0f} ({steady / bound:.2f})"
    print(
        f"whole process: {rate:,.0f} env steps/s ({4 * rate:,.0f} frames/s) over {taken:,} "
        f"steps, start-up and evaluation included; {rate / bound:.2f} of the compute bound"
        + between
    )


if __name__ == "__main__":
    main()
