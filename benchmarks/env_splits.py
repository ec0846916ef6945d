"""Actors and central inference without a learner: how fast they fill batches with each
actor's envs in one group, and in ``runner.env_splits`` groups that take turns.

With central inference an actor's step waits for the server's answer. Split into groups, one
group steps while another's request is served (Sample Factory's double-buffered sampling).
This times only that part of a run: the subprocess backend with its inference servers, the
batches taken as fast as they come and thrown away (no update, no broadcast), env steps per
second over ``--seconds`` after one batch of warm-up. The variants alternate, ``--pairs``
times, each with fresh processes; printed: each variant's median and range, and the ratio of
the medians (split / one group).

    PYTHONPATH=src python benchmarks/env_splits.py pong --seconds 20 --pairs 3
    python benchmarks/env_splits.py pong_appo algorithm.device=cuda algorithm.num_actors=16 \\
        algorithm.actors_batch_size=4 env.kwargs.vector_threads=1 runner.inference_servers=2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from impala_rl.actors import make_actors
from impala_rl.config import RunConfig, load_config
from impala_rl.envs import make_env_factory
from impala_rl.nn.factory import build_model


def rate(cfg: RunConfig, seconds: float) -> float:
    """Env steps per second that ``cfg``'s actors and servers deliver, after one batch."""
    factory = make_env_factory(cfg.env)
    probe = factory()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, probe.observation_space, probe.action_space)
    probe.close()
    device = torch.device(cfg.algorithm.device if cfg.algorithm.device != "auto" else "cpu")
    with make_actors(cfg, factory, model, device=device) as actors:
        actors.collect_outputs("cpu")
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            steps += actors.collect_outputs("cpu").env_steps
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--splits", type=int, default=2, help="runner.env_splits to compare")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    central = [
        "runner.backend=subprocess",
        "runner.inference=central",
        "runner.size_to_machine=false",
    ]
    variants = {
        "one group": load_config(args.preset, [*central, *args.overrides, "runner.env_splits=1"]),
        f"{args.splits} groups": load_config(
            args.preset, [*central, *args.overrides, f"runner.env_splits={args.splits}"]
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for i in range(args.pairs):
        for name in order if i % 2 == 0 else order[::-1]:
            rates[name].append(rate(variants[name], args.seconds))
            print(f"  pair {i + 1}, {name}: {rates[name][-1]:.0f} env steps/s", flush=True)
    alg = variants["one group"].algorithm
    print(
        f"{args.preset} {' '.join(args.overrides)}: {alg.num_actors} actors x "
        f"{alg.envs_per_actor} envs, central inference on {alg.device}, "
        f"{variants['one group'].runner.inference_servers} server(s), {args.seconds:.0f} s each"
    )
    for name, values in rates.items():
        print(
            f"  {name}: {statistics.median(values):.0f} env steps/s "
            f"({min(values):.0f}-{max(values):.0f})"
        )
    split = rates[f"{args.splits} groups"]
    ratios = [s / o for s, o in zip(split, rates["one group"], strict=True)]
    ratio = statistics.median(split) / statistics.median(rates["one group"])
    pairs = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  {args.splits} groups / one group: {ratio:.2f} (pairs: {pairs})")


if __name__ == "__main__":
    main()
