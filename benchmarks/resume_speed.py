"""Does a resumed run train slower? The pong preset's learner update, timed in one process:

1. ``fresh``: a new learner;
2. ``resumed``: the same learner after a checkpoint round trip (``Trainer``'s save and load
   path: ``checkpoint.save_atomic``/``load``, ``load_optimizer_state``);
3. ``aged``: RMSProp's running averages as they pass, late in a run, through float32's
   subnormal range for weights that get no gradient (dead units): all set to 1e-40, timed with
   the CPU's subnormal arithmetic (``flush off``) and with subnormals flushed to zero
   (``flush on``).

Rounds alternate the variants (A B C ...) so machine drift hits all alike; it prints each
variant's median update time and its ratio to ``fresh`` over the rounds.

    PYTHONPATH=src python benchmarks/resume_speed.py --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from precision import batch_for

from impala_rl import checkpoint
from impala_rl.config import load_config
from impala_rl.learner import Learner, load_optimizer_state
from impala_rl.nn.factory import build_model


def time_update(learner: Learner, batch: dict[str, torch.Tensor], flush: bool, n: int) -> float:
    torch.set_flush_denormal(flush)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        learner.update(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=3, help="timed updates per variant")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("pong")
    alg = cfg.algorithm
    T, B = alg.n_rollout_steps, alg.actors_batch_size * alg.envs_per_actor
    obs_space = gym.spaces.Box(0, 255, (4, 84, 84), dtype=np.uint8)
    batch = batch_for(T, B, (4, 84, 84), 6)
    torch.manual_seed(0)
    fresh = Learner(build_model(cfg.model, obs_space, gym.spaces.Discrete(6)), alg)
    fresh.update(batch)  # the optimizer state exists from here on

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.pt"
        checkpoint.save_atomic(
            {
                "format": checkpoint.CHECKPOINT_FORMAT,
                "model": fresh.model.state_dict(),
                "optimizer": fresh.optimizer.state_dict(),
            },
            path,
        )
        data = checkpoint.load(path)
    resumed = Learner(build_model(cfg.model, obs_space, gym.spaces.Discrete(6)), alg)
    resumed.model.load_state_dict(data["model"])
    load_optimizer_state(resumed.optimizer, data["optimizer"], alg)

    aged = copy.deepcopy(fresh)
    torch.set_flush_denormal(False)
    for state in aged.optimizer.state.values():
        state["square_avg"].fill_(1e-40)
    subnormal = sum(
        int(((s["square_avg"] > 0) & (s["square_avg"] < torch.finfo(torch.float32).tiny)).sum())
        for s in aged.optimizer.state.values()
    )
    total = sum(p.numel() for p in aged.model.parameters())
    print(
        f"pong preset learner, T={T} x B={B}, {args.threads} thread(s); aged state: "
        f"{subnormal}/{total} subnormal averages; {args.rounds} rounds x {args.updates} updates"
    )
    variants = {
        "fresh": (fresh, True),
        "resumed": (resumed, True),
        "aged, flush off": (aged, False),
        "aged, flush on": (aged, True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (learner, flush) in variants.items():
            if name.startswith("aged"):  # the same subnormal state for both settings
                for state in learner.optimizer.state.values():
                    state["square_avg"].fill_(1e-40)
            times[name].append(time_update(learner, batch, flush, args.updates))
    torch.set_flush_denormal(True)
    for name, values in times.items():
        ratios = [v / f for v, f in zip(values, times["fresh"], strict=True)]
        print(
            f"{name:>16}: median {statistics.median(values):.3f} s "
            f"({min(values):.3f}-{max(values):.3f}); / fresh: median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
