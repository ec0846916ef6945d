"""fp32 vs bf16 learning on MinAtar: the same preset, seeds and env-step budget per precision.

Each run trains ``minatar_breakout`` (or ``--preset``) in this process for ``--env-steps``
env steps with ``model.precision`` set, and reports the final training return (mean of the
last 100 episodes), the best evaluation return and the wall time; then the medians over seeds.

    PYTHONPATH=src python benchmarks/minatar_precision.py                  # 3 seeds, 64k steps
    PYTHONPATH=src python benchmarks/minatar_precision.py --seeds 0 1 2 3 4 --env-steps 200000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import impala_rl


def run(preset: str, precision: str, seed: int, env_steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"impala-minatar-{precision}-{seed}-") as tmp:
        t0 = time.perf_counter()
        summary = impala_rl.train(
            preset,
            [
                "log.console=false",
                "log.tensorboard=false",
                "log.jsonl=false",
                f"seed={seed}",
                f"max_env_steps={env_steps}",
                f"model.precision={precision}",
                *extra,
            ],
            run_dir=tmp,
        )
        wall = time.perf_counter() - t0
    return {
        "train_return": summary["train_return_recent"],
        "best_eval_return": summary["best_eval_return"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="minatar_breakout")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--env-steps", type=int, default=64_000)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for precision in ("fp32", "bf16"):
        results[precision] = []
        for seed in args.seeds:
            r = run(args.preset, precision, seed, args.env_steps, args.overrides)
            results[precision].append(r)
            print(
                f"{precision} seed {seed}: train return {r['train_return']:.2f}, best eval "
                f"{r['best_eval_return']:.2f}, {r['wall_s']:.1f} s",
                flush=True,
            )
    print(f"medians over seeds {args.seeds}, {args.env_steps} env steps, {args.preset}:")
    for precision, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"  {precision}: train return {med['train_return']:.2f}, best eval "
            f"{med['best_eval_return']:.2f}, wall {med['wall_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
