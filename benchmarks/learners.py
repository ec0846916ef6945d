"""Several learners against one on the same work: time per update of a global batch.

    PYTHONPATH=src python benchmarks/learners.py                   # Nature CNN, T 80, B 8, CPU
    PYTHONPATH=src python benchmarks/learners.py --device cuda --batch 8 16 32

One learner updates ``B`` columns; ``N`` learners (a gloo or NCCL group of processes, as
``algorithm.num_learners`` forms) each update ``B / N`` columns and average their gradients.
Synthetic uint8 frames, no env, no actors: it measures the update and the all-reduce only.
Per setting it prints the median and spread (min-max) over ``--repeats`` timed updates after
``--warmup``, the ratio of N learners to one measured in the same run, and the all-reduce's
size and median time (the flat gradient of every parameter). On the CPU each learner gets
``cores / N`` threads, so the comparison is on the same cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import gymnasium as gym
import numpy as np
import torch
from precision import batch_for

from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
from impala_rl.distributed import LearnerGroup, Rendezvous, make_store
from impala_rl.learner import Learner
from impala_rl.nn.factory import build_model

FRAME = (4, 84, 84)
N_ACTIONS = 6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    """Seconds per call of ``fn``, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _worker(rank: int, n: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // n) if args.threads is None else args.threads)
    device = torch.device(args.device)
    group = None
    if n > 1:
        group = LearnerGroup(rank, Rendezvous("127.0.0.1", port, n), device)
        device = group.device
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(encoder="nature_cnn", channels_last=True),
        gym.spaces.Box(0, 255, FRAME, np.uint8),
        gym.spaces.Discrete(N_ACTIONS),
    )
    learner = Learner(model, ImpalaAlgorithmConfig(optimizer="rmsprop"), device, group=group)
    batch = {
        k: v.to(device) for k, v in batch_for(args.unroll, args.columns // n, FRAME, 6).items()
    }
    for _ in range(args.warmup):
        learner.update(batch)
    times = timed(lambda: learner.update(batch), args.repeats, device)
    reduce_times: list[float] = []
    params = [p for p in learner.model.parameters() if p.requires_grad]
    if group is not None:
        reduce_times = timed(lambda: group.average_gradients(params), args.repeats, device)
        group.close()
    if rank == 0:
        out.put(
            {
                "times": times,
                "reduce_times": reduce_times,
                "reduce_mb": 4 * sum(p.numel() + 1 for p in params) / 1e6,
            }
        )


def measure(n: int, args: argparse.Namespace) -> dict:
    """Rank 0's timings; every learner is a child process, this one holds the store."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = make_store("127.0.0.1", n) if n > 1 else None
    port = store.port if store is not None else 0
    procs = [ctx.Process(target=_worker, args=(r, n, port, args, out)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="global columns")
    parser.add_argument("--unroll", type=int, default=80)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for columns in args.batch:
        args.columns = columns
        base = None
        for n in args.learners:
            r = measure(n, args)
            med = statistics.median(r["times"])
            base = med if n == args.learners[0] else base
            row = {
                "device": args.device,
                "global_columns": columns,
                "learners": n,
                "update_ms_median": round(1e3 * med, 2),
                "update_ms_min": round(1e3 * min(r["times"]), 2),
                "update_ms_max": round(1e3 * max(r["times"]), 2),
                "ratio_to_first": round(med / base, 3),
            }
            if r["reduce_times"]:
                row["allreduce_mb"] = round(r["reduce_mb"], 2)
                row["allreduce_ms_median"] = round(1e3 * statistics.median(r["reduce_times"]), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
