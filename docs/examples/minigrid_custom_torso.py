"""Train MiniGrid-DoorKey-5x5-v0 from Python with your own torso, given by import path.

    pip install 'impala-rl[minigrid]'        # or: pip install minigrid
    python docs/examples/minigrid_custom_torso.py --steps 100000 --run-dir runs/doorkey

MiniGrid's observation is a Dict: ``image`` (7x7 cells x (object, colour, state) codes, uint8),
``direction`` (Discrete(4)) and ``mission`` (a sentence, constant in DoorKey). The run keeps
that structure: the model receives ``{"image": uint8 [N, 3, 7, 7] (channels first),
"direction": int64 [N], "mission": int16 [N, 32, 2]}`` (the mission's words as hashed ids,
which this torso leaves alone), and :class:`OneHotTorso` below is the whole encoder. It follows the
protocol of ``model.encoder=package.module:Class``:

- built as ``Class(observation_space, **model.encoder_kwargs)``,
- an ``nn.Module`` with an int ``out_features``,
- ``forward`` maps one batch dimension of observations to float features ``[N, out_features]``.

The heads, an LSTM core (``model.core="lstm"``), last action/reward inputs and the rest sit on
top of it. The run directory records the import path and kwargs, so ``impala train --resume``,
``impala eval`` and ``impala_rl.load_policy`` rebuild it, as long as this file's directory is
importable (``main`` puts it on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gymnasium as gym
import torch
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent


class OneHotTorso(nn.Module):
    """One-hot codes of every cell (object, colour and state each), the direction one-hot, an
    MLP over both."""

    def __init__(self, observation_space: gym.spaces.Dict, codes: int = 11, width: int = 128):
        super().__init__()
        channels, height, width_cells = observation_space["image"].shape
        self.codes = codes
        self.directions = int(observation_space["direction"].n)
        inputs = channels * height * width_cells * codes + self.directions
        self.net = nn.Sequential(
            nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
        self.out_features = width

    def forward(self, obs: dict[str, Tensor]) -> Tensor:
        # MiniGrid's codes are < 11; a code outside the table (a random sample) is clamped
        image = obs["image"].long().clamp_(max=self.codes - 1)
        cells = nn.functional.one_hot(image, self.codes).flatten(1).float()
        direction = nn.functional.one_hot(obs["direction"].long(), self.directions).float()
        return self.net(torch.cat([cells, direction], dim=-1))


def make_config(steps: int, seed: int = 0):
    """The run, built in code: the same fields as a preset's YAML."""
    from impala_rl.config import (
        EnvConfig,
        ImpalaAlgorithmConfig,
        ModelConfig,
        RolloutEvaluatorConfig,
        RunConfig,
        RunnerConfig,
    )

    return RunConfig(
        seed=seed,
        max_env_steps=steps,
        env=EnvConfig(id="MiniGrid-DoorKey-5x5-v0"),  # registered on demand
        model=ModelConfig(
            # this module by import path: `minigrid_custom_torso`, importable from HERE
            encoder=f"{Path(__file__).stem}:OneHotTorso",
            encoder_kwargs={"width": 128},
            shared_torso=True,
        ),
        algorithm=ImpalaAlgorithmConfig(
            epoch_length=8,
            patience=0,
            n_rollout_steps=32,
            num_actors=2,
            envs_per_actor=8,
            actors_batch_size=1,
            lr=1e-3,
            entropy_coef=0.01,
            rollout_evaluator=RolloutEvaluatorConfig(n_episodes=10),
        ),
        runner=RunnerConfig(backend="sequential", learner_threads=1),
    )


def main(argv: list[str] | None = None) -> dict:
    import impala_rl

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="env steps to train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="run directory (default: runs/<time>)")
    args = parser.parse_args(argv)

    # the encoder is imported by its path, here and in any process the run starts
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p
    )
    summary = impala_rl.train(make_config(args.steps, args.seed), run_dir=args.run_dir)
    print(
        f"trained {summary['env_steps']} env steps; best evaluation return "
        f"{summary['best_eval_return']}; run directory {summary.get('run_dir', args.run_dir)}"
    )
    return summary


if __name__ == "__main__":
    main()
