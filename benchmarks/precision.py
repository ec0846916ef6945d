"""Time one learner update and one acting step per model precision and memory format.

    PYTHONPATH=src python benchmarks/precision.py                 # Nature CNN, 84x84x4, B 8, T 80
    PYTHONPATH=src python benchmarks/precision.py --encoder impala_resnet --batch 8

Prints the median over ``--repeats`` timed calls (after one warm-up) for fp32 and bf16, each
with and without channels-last. Synthetic uint8 frames, no env: it measures the network only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym
import numpy as np
import torch

from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
from impala_rl.learner import Learner
from impala_rl.nn.factory import build_model


def batch_for(T: int, B: int, shape: tuple[int, ...], n_actions: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "obs": torch.randint(0, 256, (T + 1, B, *shape), dtype=torch.uint8, generator=g),
        "first": torch.zeros(T + 1, B, dtype=torch.bool),
        "action": torch.randint(0, n_actions, (T + 1, B), generator=g),
        "behaviour_log_prob": torch.full((T, B), -float(np.log(n_actions))),
        "reward": torch.randn(T, B, generator=g),
        "terminated": torch.zeros(T, B, dtype=torch.bool),
        "truncated": torch.zeros(T, B, dtype=torch.bool),
        "truncation_value": torch.zeros(T, B),
        "policy_version": torch.zeros(B, dtype=torch.int64),
        "actor_index": torch.zeros(B, dtype=torch.int64),
    }


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="nature_cnn")
    parser.add_argument("--frame", type=int, nargs=3, default=[4, 84, 84])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--unroll", type=int, default=80)
    parser.add_argument("--act-batch", type=int, default=4, help="envs per acting step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(args.frame)
    obs_space = gym.spaces.Box(0, 255, shape, dtype=np.uint8)
    action_space = gym.spaces.Discrete(6)
    batch = batch_for(args.unroll, args.batch, shape, 6)
    act_obs = batch["obs"][0, : args.act_batch]
    print(
        f"{args.encoder} {shape}, learner batch T={args.unroll} x B={args.batch}, acting on "
        f"{args.act_batch} frames, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    for precision in ("fp32", "bf16"):
        for channels_last in (False, True):
            torch.manual_seed(0)
            cfg = ModelConfig(
                encoder=args.encoder,
                shared_torso=True,
                precision=precision,
                channels_last=channels_last,
            )
            model = build_model(cfg, obs_space, action_space)
            learner = Learner(model, ImpalaAlgorithmConfig(optimizer="rmsprop"))
            update = median_time(lambda learner=learner: learner.update(batch), args.repeats)
            with torch.inference_mode():
                act = median_time(lambda m=model: m.policy(0, act_obs).sample(), 20 * args.repeats)
            print(
                f"  {precision} channels_last={str(channels_last).lower():5}  "
                f"update {update * 1e3:8.1f} ms   act {act * 1e3:6.2f} ms"
            )


if __name__ == "__main__":
    main()
