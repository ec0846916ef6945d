"""What the first optimizer steps do to the network: critic values, entropy, dead ReLUs.

Trains a preset for a few updates under each optimizer variant (same seed, the sequential
backend so every variant sees the same first batch), then reads the epoch rows (critic value,
policy entropy) and counts the ReLU units that output 0 on every one of a set of observations
from random play.

    python benchmarks/optimizer_start.py --updates 50          # pong, the variants below
    python benchmarks/optimizer_start.py --variant x algorithm.lr=1e-4 ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dead_units import dead_fraction, initial_policy  # benchmarks/dead_units.py (same folder)

from impala_rl.config import load_config
from impala_rl.plot import load_metrics
from impala_rl.policy import load_policy

VARIANTS: dict[str, list[str]] = {
    "rmsprop, mean square from 0 (preset)": [],
    "rmsprop, mean square from 1/(TB)^2": ["algorithm.rmsprop_initial_square_avg=2.44e-6"],
    "rmsprop, lr warm-up 32k steps": ["algorithm.lr_warmup_env_steps=32000"],
    "adam 2.5e-4, eps 1e-5": [
        "algorithm.optimizer=adam",
        "algorithm.lr=2.5e-4",
        "algorithm.optimizer_eps=1e-5",
    ],
}


def run_variant(preset: str, overrides: list[str], updates: int, seed: int, out: Path) -> dict:
    cfg = load_config(preset, overrides)
    alg = cfg.algorithm
    steps_per_batch = alg.n_rollout_steps * alg.envs_per_actor * alg.actors_batch_size
    batches = max(1, updates // alg.num_passes)
    cmd = [
        sys.executable, "-m", "impala_rl.cli", "train", preset, *overrides,
        f"seed={seed}", f"max_env_steps={batches * steps_per_batch}",
        "runner.backend=sequential", "algorithm.num_actors=1", "algorithm.actors_batch_size=1",
        f"algorithm.epoch_length={max(1, batches // 5)}", "target_return=null",
        "algorithm.rollout_evaluator.n_episodes=1",
        "algorithm.rollout_evaluator.max_episode_steps=10",
        "algorithm.rollout_evaluator.background=false", f"log.run_dir={out}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = load_metrics(out)
    return {
        "critic_value": [round(r.get("critic_value/0", float("nan")), 2) for r in rows],
        "entropy": [round(r.get("policy_entropy/0", float("nan")), 3) for r in rows],
        "dead_relu": dead_fraction(load_policy(out, which="last"), 256, seed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="pong")
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variant", nargs="+", help="NAME OVERRIDE...: one variant instead")
    args = p.parse_args()
    variants = {args.variant[0]: args.variant[1:]} if args.variant else VARIANTS
    results = {}
    at_init = dead_fraction(initial_policy(args.preset, args.seed), 256, args.seed)
    print(f"{'at initialisation':40s} dead ReLUs {at_init:.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(variants.items()):
            r = run_variant(args.preset, overrides, args.updates, args.seed, Path(tmp) / str(i))
            results[name] = r
            print(f"{name:40s} dead ReLUs {r['dead_relu']:.3f}  critic value per epoch "
                  f"{r['critic_value']}  entropy {r['entropy']}", flush=True)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
