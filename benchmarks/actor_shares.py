"""How much of the learner's data each actor delivers, and how stale: whole runs.

Counts the batch columns of every actor (``actor_index``) that the learner trains on, and
reads the run's policy lag from its metrics. While the learner is the bound every actor should
deliver about the same share; a share that falls with the actor's index means the queue
favours the first actors.

    PYTHONPATH=src python benchmarks/actor_shares.py cartpole runner.backend=subprocess \
        algorithm.num_actors=4 algorithm.actors_batch_size=2 max_env_steps=40000 --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import impala_rl
from impala_rl.learner import Learner


def run(preset: str, seed: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One run: its columns per actor, its policy lag and its best training return."""
    columns: collections.Counter[int] = collections.Counter()
    update = Learner.update

    def counting_update(self: Learner, batch: dict, *args: Any, **kwargs: Any) -> Any:
        columns.update(int(i) for i in batch["actor_index"].reshape(-1).tolist())
        return update(self, batch, *args, **kwargs)

    Learner.update = counting_update  # type: ignore[method-assign]
    try:
        impala_rl.train(
            preset,
            ["log.console=false", "log.tensorboard=false", "target_return=null",
             f"seed={seed}", *overrides],
            run_dir=run_dir,
        )  # fmt: skip
    finally:
        Learner.update = update  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "columns": [columns[i] for i in range(max(columns) + 1)],
        "lag_mean": statistics.median(r["policy_lag/mean"] for r in rows),
        "lag_max": max(r["policy_lag/max"] for r in rows),
        "best_return": max(r.get("train_return_recent") or 0.0 for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("overrides", nargs="*", help="key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            r = run(args.preset, seed, args.overrides, Path(tmp) / f"seed{seed}")
            first_last = r["columns"][0] / max(r["columns"][-1], 1)
            print(
                f"seed {seed}: columns per actor {r['columns']} (first / last {first_last:.2f}), "
                f"policy lag: median of the epochs' means {r['lag_mean']:.2f}, "
                f"max {r['lag_max']:g}; best training return {r['best_return']:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
