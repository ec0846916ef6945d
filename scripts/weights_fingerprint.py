"""A fingerprint of the final weights of short seeded runs, to show a refactor changes nothing.

Each run trains a preset on the sequential backend (deterministic) for a few thousand env
steps and prints the first 16 hex digits of a sha256 over its final weights, in the order of
their names as today's model has them (a plain env's model of an earlier version named its
parts ``policy_torso``, ``value_torso``, ``policy_head`` or ``action_head``, ``value_head`` and
``obs_norm``: they count as step key 0's ``policies.0.torso``, ...), so a checkout from before
a rename gives the same digits for the same weights. Run it before and after a change: equal
digits, equal weights.

    python scripts/weights_fingerprint.py
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from impala_rl import checkpoint
from impala_rl.nn.actor_critic import EARLIER_NAMES

RUNS = {
    "cartpole": ("cartpole", ["max_env_steps=6000"]),
    "multistep_example": ("multistep_example", ["max_env_steps=6000"]),
    "tictactoe": ("tictactoe", ["max_env_steps=6000"]),
    # an env of no family: the any_env preset (APPO's passes and minibatches, PopArt, a Dict)
    "any-env-pointgoal": ("env.id=impala_rl.envs.samples:PointGoal", ["max_env_steps=3072"]),
    # minibatches of single decisions (the minigrid preset) on the grid encoder
    "minigrid-doorkey": ("env.id=MiniGrid-DoorKey-5x5-v0", ["max_env_steps=3072"]),
    "cartpole-lstm": (
        "cartpole",
        [
            "model.core=lstm",
            "model.shared_torso=true",
            "model.use_last_action_reward=true",
            "max_env_steps=3000",
        ],
    ),
}


def todays_name(name: str) -> str:
    for old, new in EARLIER_NAMES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def fingerprint(preset: str, overrides: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "impala_rl.cli", "train", preset, *overrides, "seed=3"]
        cmd += ["runner.backend=sequential", "target_return=null", f"log.run_dir={run}"]
        cmd += ["algorithm.rollout_evaluator.background=false"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        state = checkpoint.load(run / "checkpoints" / "last.pt")["model"]
    digest = hashlib.sha256()
    for name in sorted(state, key=todays_name):
        digest.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    for name, (preset, overrides) in RUNS.items():
        print(name, fingerprint(preset, overrides), flush=True)


if __name__ == "__main__":
    main()
