"""PopArt's effect when the reward's scale changes: CartPole with rewards x1 and x1000.

Trains the ``cartpole`` preset (sequential backend, Adam, no reward clipping) with and without
``model.popart`` on CartPole whose rewards are multiplied by ``--scales``, over ``--seeds``,
and prints the env steps to solve (evaluation mean >= 475 x scale) or ``-`` within
``--steps``. Without PopArt a larger reward scale makes the policy gradient dwarf the entropy
bonus (and the value loss the policy loss on a shared torso); with PopArt both are on the
normalized scale.

    PYTHONPATH=src python benchmarks/popart.py --seeds 0 1 --scales 1 1000 --steps 60000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import gymnasium as gym

import impala_rl


class ScaledReward(gym.RewardWrapper):
    def __init__(self, env: gym.Env, scale: float):
        super().__init__(env)
        self.scale = scale

    def reward(self, reward: float) -> float:
        return reward * self.scale


def make_scaled_cartpole(scale: float = 1.0) -> gym.Env:
    return ScaledReward(gym.make("CartPole-v1"), scale)


def steps_to_solve(scale: float, popart: bool, seed: int, steps: int) -> int | None:
    with tempfile.TemporaryDirectory() as run_dir:
        summary = impala_rl.train(
            "cartpole",
            [
                f"env.id={__name__}:make_scaled_cartpole",
                f"env.kwargs={{scale: {scale}}}",
                f"target_return={475 * scale}",
                f"max_env_steps={steps}",
                f"model.popart={str(popart).lower()}",
                "algorithm.reward_clipping=none",
                f"seed={seed}",
                "log.console=false",
                "log.tensorboard=false",
            ],
            run_dir=run_dir,
        )
    return summary["env_steps"] if summary["stopped_because"] == "target_return" else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 1000.0])
    parser.add_argument("--steps", type=int, default=60000)
    args = parser.parse_args()
    print("scale  popart  env steps to solve per seed            median")
    for scale in args.scales:
        for popart in (False, True):
            runs = [steps_to_solve(scale, popart, s, args.steps) for s in args.seeds]
            solved = [r for r in runs if r is not None]
            median = statistics.median(solved) if len(solved) == len(runs) else None
            cells = " ".join(f"{r:>7}" if r is not None else "      -" for r in runs)
            print(f"{scale:>6g}  {popart!s:>6}  {cells}   {median if median else '-'}", flush=True)


if __name__ == "__main__":
    main()
