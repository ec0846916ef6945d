"""Where one optimizer step of a preset's learner spends its time, part by part.

    PYTHONPATH=src python benchmarks/step_breakdown.py pong_appo algorithm.device=cuda \\
        algorithm.actors_batch_size=4 algorithm.envs_per_actor=8

Builds the learner as ``batch_update.py`` does (synthetic Atari frames, the preset's batch) and
first times whole batches as training runs them (ms per step, unsynchronised); then wraps the
parts of a step (the replayed graph, the figures' read, the optimizer step, the weights
published to shared memory, the target's move) so that each is synchronised on its own, and
prints each part's ms per step. The synchronised parts add up to more than the unsynchronised
step: on a GPU the waits they add are what the unsynchronised step overlaps. A captured update
takes its optimizer step in the graph (its time is the replay's; "optimizer step" is then
the host's finiteness check) and its figures are read a step late; ``--step-outside-graph``
captures it without the step, which the host then takes after reading the figures at once,
as before both (the comparison).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from batch_update import learner_batch

from impala_rl import learner as learner_module
from impala_rl.actors.subprocess import SharedWeights
from impala_rl.config import load_config, steps_per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument(
        "--step-outside-graph",
        action="store_true",
        help="capture the update without its optimizer step (the host steps after the read)",
    )
    args = parser.parse_args()
    if args.step_outside_graph:
        start = learner_module.CapturedStep.__init__

        def outside(self: Any, *a: Any, **k: Any) -> None:
            start(self, *a, **k)
            self.enabled = False

        learner_module.CapturedStep.__init__ = outside  # type: ignore[method-assign]
    cfg = load_config(args.preset, args.overrides)
    alg = cfg.algorithm
    device = torch.device(alg.device if alg.device != "auto" else "cpu")
    sync: Callable[[], None] = (
        torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # type: ignore[assignment]
    )
    one_batch = learner_batch(cfg, device)
    steps = steps_per_batch(alg)

    def timed_batches() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(args.batches):
            one_batch()
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        one_batch()
    plain = [timed_batches() / args.batches for _ in range(3)]
    where = "outside" if args.step_outside_graph else "inside"
    print(
        f"{args.preset} {' '.join(args.overrides)} on {device}, {steps} steps per batch, the "
        f"optimizer step {where} a captured update: "
        f"{1e3 * statistics.median(plain) / steps:.2f} ms per step unsynchronised "
        f"({1e3 * min(plain) / steps:.2f}-{1e3 * max(plain) / steps:.2f})"
    )

    spent: dict[str, float] = collections.defaultdict(float)

    def part(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[name] += time.perf_counter() - t0
            return out

        return wrapped

    learner_module.UpdateGraph.run = part("graph replay", learner_module.UpdateGraph.run)
    learner_module._to_host = part("figures' read", learner_module._to_host)
    learner_module.Learner._step = part("optimizer step", learner_module.Learner._step)
    learner_module.Learner._follow_target = part(
        "target's move", learner_module.Learner._follow_target
    )
    SharedWeights.publish = part("weights published", SharedWeights.publish)
    learner_module.Learner.update = part("update (all)", learner_module.Learner.update)
    total = timed_batches()
    print(f"synchronised parts, ms per step over {args.batches} batches:")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<18} {1e3 * seconds / (args.batches * steps):6.2f}")
    print(f"  {'batch (all)':<18} {1e3 * total / (args.batches * steps):6.2f}")


if __name__ == "__main__":
    main()
