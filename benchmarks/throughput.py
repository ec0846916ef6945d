"""Env-step throughput: raw CartPole stepping vs training with each actor backend.

Prints

1. the raw ceiling: env steps/s of random actions in a vector env of 8, 16 and 32 CartPole-v1
   envs in this one process (one core), Gymnasium's ``SyncVectorEnv`` (same-step autoreset),
   the project's ``SameStepVectorEnv`` and envpool (when installed), median of ``--raw-runs``
   runs; the ceiling is the best of them, and the ratio of ours to Gymnasium's;
2. training env steps/s (``summary.env_steps / summary.wall_time_s``, actor start-up and the
   per-epoch evaluation included) with the ``cartpole`` preset's MLP and a fixed env-step
   budget: the preset as is, then the sequential and subprocess backends with 1, 2 and 4 actors
   of 64 envs each (unroll 32): median, min and max over ``--runs`` runs, and the ratio to the
   raw ceiling;
3. the issue's target: training with the subprocess backend, 2 actors x 64 envs, unroll 32
   (``env.vector=auto``) over the raw rate of Gymnasium's ``SyncVectorEnv`` x16, both measured
   in this run (the same with ``env.vector=python`` is listed for comparison);
4. the share of the learner's update time (``time_update``) spent recording events in
   ``Trainer._record_update``.

With ``--encoder package.module:Class`` it prints only a comparison: the target
configuration (3.) with the built-in MLP and with that user encoder (``user_mlp:UserMLP``
here builds the same layers with the same init), ``--runs`` pairs in ABBA order after a
warm-up run, the learning rate 1e-12 so that both do the same work; the ratio of
the medians (user / built-in) is the cost of bringing your own network.

Timings depend on whatever else runs on the machine; compare figures from one invocation.

    python benchmarks/throughput.py            # default: 3 runs of 1000000 env steps each
    python benchmarks/throughput.py --quick    # 1 run of 20480 env steps
    python benchmarks/throughput.py --only "2 actors" --raw-runs 1   # ray vs subprocess
    python benchmarks/throughput.py --encoder user_mlp:UserMLP --runs 5 --steps 300000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

import impala_rl
from impala_rl.envs import EnvFactory, make_vector_env
from impala_rl.envs.envpool import envpool_installed
from impala_rl.trainer import Trainer

# Throughput setting: the preset's MLP with larger per-actor vector envs and unrolls, so the
# per-step cost of acting is shared by 64 envs (the preset itself trades throughput for more
# updates per env step, which solves CartPole sooner; it is measured too). An epoch of the
# preset's 10 updates is 20k env steps here, and its evaluation episode took ~20% of the
# epoch's time in steady state; 100 updates per epoch evaluate every ~200k steps.
THROUGHPUT = [
    "algorithm.envs_per_actor=64",
    "algorithm.n_rollout_steps=32",
    "algorithm.actors_batch_size=1",
    "algorithm.epoch_length=100",
]
BACKENDS: list[tuple[str, list[str]]] = [
    ("cartpole preset as is", []),
    *(
        (
            f"sequential, {n} actor{'s' * (n > 1)}",
            ["runner.backend=sequential", f"algorithm.num_actors={n}", *THROUGHPUT],
        )
        for n in (1, 2, 4)
    ),
    *(
        (
            f"subprocess, {n} actor{'s' * (n > 1)}",
            ["runner.backend=subprocess", f"algorithm.num_actors={n}", *THROUGHPUT],
        )
        for n in (1, 2, 4)
    ),
    (
        "subprocess, 2 actors, python",
        [
            "runner.backend=subprocess",
            "algorithm.num_actors=2",
            "env.vector=python",
            *THROUGHPUT,
        ],
    ),
    ("ray, 2 actors", ["runner.backend=ray", "algorithm.num_actors=2", *THROUGHPUT]),
]
TARGET = "subprocess, 2 actors"  # env.vector=auto: envpool where it times faster here


# -- raw env stepping ---------------------------------------------------------------------------
RAW_KINDS = {"gymnasium": "SyncVectorEnv", "python": "SameStepVectorEnv", "envpool": "envpool"}
REFERENCE = "SyncVectorEnv x16"  # the yardstick: Gymnasium's own, 16 envs, one core


def raw_steps_per_second(
    num_envs: int, steps: int, seed: int = 0, kind: str = "gymnasium"
) -> float:
    """Random actions in a same-step-autoreset vector env: Gymnasium's ``SyncVectorEnv``
    (``gymnasium``), the project's ``SameStepVectorEnv`` (``python``) or envpool through
    ``EnvpoolVectorEnv`` (``envpool``), on one core."""
    if kind != "gymnasium":
        envs = make_vector_env(EnvFactory("CartPole-v1", vector=kind), num_envs)
    else:
        envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1") for _ in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
    rng = np.random.default_rng(seed)
    iterations = max(1, steps // num_envs)
    actions = rng.integers(0, 2, size=(iterations, num_envs))
    envs.reset(seed=seed)
    t0 = time.perf_counter()
    for a in actions:
        envs.step(a)
    elapsed = time.perf_counter() - t0
    envs.close()
    return iterations * num_envs / elapsed


# -- training --------------------------------------------------------------------------------------
@dataclass
class RecordTimer:
    """Wraps ``Trainer._record_update``: time inside it vs the update times it is given."""

    record_s: float = 0.0
    update_s: float = 0.0
    calls: int = 0
    original: object = field(default=None, repr=False)

    def install(self) -> None:
        self.original = Trainer._record_update
        original = self.original
        timer = self

        def timed(trainer, stats, collected, collect_time, total_time):
            t0 = time.perf_counter()
            original(trainer, stats, collected, collect_time, total_time)
            timer.record_s += time.perf_counter() - t0
            timer.update_s += total_time
            timer.calls += 1

        Trainer._record_update = timed  # type: ignore[method-assign]

    def uninstall(self) -> None:
        Trainer._record_update = self.original  # type: ignore[method-assign]


def training_steps_per_second(overrides: list[str], steps: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="impala-bench-") as run_dir:
        summary = impala_rl.train(
            "cartpole",
            [
                *overrides,
                f"max_env_steps={steps}",
                "target_return=null",
                "log.console=false",
                "log.tensorboard=false",
                "algorithm.rollout_evaluator.n_episodes=1",
                "algorithm.patience=0",
            ],
            run_dir=run_dir,
        )
        # Steady state: the epochs after the first (actor and Ray start-up are in the first).
        rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
        steady = [row["steps_per_second"] for row in rows[1:] if "steps_per_second" in row]
        summary["steady_sps"] = statistics.median(steady) if steady else float("nan")
    return summary["env_steps"] / summary["wall_time_s"], summary


def fmt(x: float) -> str:
    return f"{x:,.0f}"


def compare_encoder(path: str, runs: int, steps: int) -> None:
    """The target configuration with the built-in MLP, then with ``path``, ``runs`` times.
    With ``algorithm.lr=1e-12`` both keep their shared initial weights, so both do the same
    work (episodes, evaluations, updates): only the encoder's route differs. With learning on,
    the two policies drift apart and their evaluation episodes alone move the rate by +-10%."""
    overrides = [*dict(BACKENDS)[TARGET], "algorithm.lr=1e-12"]
    kinds = {"built-in mlp": "mlp", path: path}
    print(f"{TARGET}, {steps} env steps per run, {runs} pair(s) in ABBA order, after a warm-up")
    training_steps_per_second([*overrides, f"model.encoder={path}"], min(steps, 20480))
    values: dict[str, list[float]] = {name: [] for name in kinds}
    for i in range(runs):
        for name, encoder in list(kinds.items())[:: 1 if i % 2 == 0 else -1]:
            sps, summary = training_steps_per_second(
                [*overrides, f"model.encoder={encoder}"], steps
            )
            values[name].append(sps)
            print(
                f"  pair {i + 1} {name:<20} {fmt(sps)} steps/s "
                f"({summary['env_steps']} steps in {summary['wall_time_s']:.1f} s)"
            )
    for name, vs in values.items():
        print(
            f"{name:<22} median {fmt(statistics.median(vs))} steps/s "
            f"(min {fmt(min(vs))}, max {fmt(max(vs))})"
        )
    ratios = [u / b for u, b in zip(values[path], values["built-in mlp"], strict=True)]
    ratio = statistics.median(values[path]) / statistics.median(values["built-in mlp"])
    print(
        f"{path} / built-in mlp: {ratio:.3f} (target >= 0.97); per pair "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="training runs per backend (3)")
    parser.add_argument("--steps", type=int, default=None, help="env steps per run (1000000)")
    parser.add_argument("--raw-runs", type=int, default=None, help="raw stepping runs (5)")
    parser.add_argument("--raw-steps", type=int, default=None, help="steps per raw run (100000)")
    parser.add_argument("--quick", action="store_true", help="fewer runs and steps")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="TEXT",
        help="train only the configurations whose name contains one of these (e.g. '2 actors')",
    )
    parser.add_argument(
        "--encoder",
        metavar="PATH",
        help="only compare the target configuration's built-in MLP with this user encoder",
    )
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    steps = args.steps or (20480 if args.quick else 1_000_000)
    if args.encoder:
        compare_encoder(args.encoder, runs, steps)
        return
    raw_runs = args.raw_runs or (2 if args.quick else 5)
    raw_steps = args.raw_steps or (30000 if args.quick else 100000)
    started = time.perf_counter()

    print(f"raw CartPole-v1 stepping, random actions, one process ({raw_runs} runs each)")
    raw: dict[str, float] = {}
    kinds = [k for k in RAW_KINDS if k != "envpool" or envpool_installed()]
    for kind in kinds:
        for num_envs in (8, 16, 32):
            values = [
                raw_steps_per_second(num_envs, raw_steps, seed=i, kind=kind)
                for i in range(raw_runs)
            ]
            name = f"{RAW_KINDS[kind]} x{num_envs}"
            raw[name] = statistics.median(values)
            print(
                f"  {name:<22} median {fmt(raw[name])} steps/s "
                f"(min {fmt(min(values))}, max {fmt(max(values))})"
            )
    ceiling = max(raw.values())
    for n in (8, 16, 32):
        ours, theirs = raw[f"SameStepVectorEnv x{n}"], raw[f"SyncVectorEnv x{n}"]
        print(f"  SameStepVectorEnv / SyncVectorEnv (same-step mode) x{n}: {ours / theirs:.2f}")

    print(f"\ntraining (cartpole preset's MLP): {steps} env steps per run, {runs} run(s) each")
    timer = RecordTimer()
    timer.install()
    results: list[tuple[str, list[float], float]] = []
    steady: dict[str, list[float]] = {}
    try:
        for name, overrides in BACKENDS:
            if args.only and not any(text in name for text in args.only):
                continue
            record_before, update_before = timer.record_s, timer.update_s
            values = []
            for i in range(runs):
                sps, summary = training_steps_per_second(overrides, steps)
                values.append(sps)
                steady.setdefault(name, []).append(summary["steady_sps"])
                print(
                    f"  {name:<22} run {i + 1}: {fmt(sps)} steps/s "
                    f"({summary['env_steps']} steps in {summary['wall_time_s']:.1f} s)"
                )
            share = 100.0 * (timer.record_s - record_before) / (timer.update_s - update_before)
            results.append((name, values, share))
    finally:
        timer.uninstall()

    total_share = 100.0 * timer.record_s / max(timer.update_s, 1e-12)
    print()
    header = (
        f"{'configuration':<30}{'steps/s median':>15}{'min':>10}{'max':>10}"
        f"{'x ceiling':>11}{'events %':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, value in raw.items():
        print(f"{'raw ' + name:<30}{fmt(value):>15}{'':>10}{'':>10}", end="")
        print(f"{value / ceiling:>11.2f}{'':>10}")
    for name, values, share in results:
        med = statistics.median(values)
        print(
            f"{name:<30}{fmt(med):>15}{fmt(min(values)):>10}{fmt(max(values)):>10}"
            f"{med / ceiling:>11.2f}{share:>9.2f}%"
        )
    print("-" * len(header))
    print(f"ceiling = best raw median ({fmt(ceiling)} steps/s on one core)")
    print(
        f"event recording overhead: {total_share:.2f}% of update time "
        f"({timer.record_s * 1e3 / max(timer.calls, 1):.3f} ms per update over "
        f"{timer.calls} updates)"
    )
    medians = {name: statistics.median(values) for name, values, _ in results}
    if TARGET in medians:
        print(
            f"{TARGET} (env.vector=auto) / raw {REFERENCE}: "
            f"{fmt(medians[TARGET])} / {fmt(raw[REFERENCE])} = "
            f"{medians[TARGET] / raw[REFERENCE]:.2f} (target >= 1.0; whole process, start-up "
            "included)"
        )
        target_steady = statistics.median(steady[TARGET])
        print(
            f"  steady state (median epoch after the first): {fmt(target_steady)} / "
            f"{fmt(raw[REFERENCE])} = {target_steady / raw[REFERENCE]:.2f}"
        )
    if "ray, 2 actors" in medians and "subprocess, 2 actors" in medians:
        ray_steady = statistics.median(steady["ray, 2 actors"])
        sub_steady = statistics.median(steady["subprocess, 2 actors"])
        total_ratio = medians["ray, 2 actors"] / medians["subprocess, 2 actors"]
        print(
            f"ray / subprocess, 2 actors: {total_ratio:.2f}"
            f" of the steps/s above (start-up included); steady state (epochs after the first): "
            f"{fmt(ray_steady)} / {fmt(sub_steady)} = {ray_steady / sub_steady:.2f}"
        )
    print(f"benchmark took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
