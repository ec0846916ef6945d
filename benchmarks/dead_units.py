"""ReLU units that never fire, per layer: a model as initialised, or a run's checkpoints.

A unit (a convolution's channel or a linear layer's neuron) is dead when it outputs 0 on every
one of ``--obs`` observations of random play. A dead unit passes no gradient to its weights, so
it stays dead: the layer has lost that much of its width.

    PYTHONPATH=src python benchmarks/dead_units.py RUN_DIR                  # its last.pt
    PYTHONPATH=src python benchmarks/dead_units.py RUN_DIR copies/*.pt      # checkpoints kept
    PYTHONPATH=src python benchmarks/dead_units.py --preset pong_appo --seed 1  # initialised

A checkpoint file given after RUN_DIR is loaded into RUN_DIR's model (copies of ``last.pt``
taken while the run trained, say).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from impala_rl import checkpoint
from impala_rl.config import load_config
from impala_rl.envs import EnvFactory
from impala_rl.nn.factory import build_model_for_env
from impala_rl.policy import Policy, load_policy


def initial_policy(preset: str, seed: int, overrides: list[str] | None = None) -> Policy:
    """The preset's model (with ``overrides``) as initialised for ``seed`` (no update)."""
    cfg = load_config(preset, [*(overrides or []), f"seed={seed}"])
    factory = EnvFactory.of(cfg.env)
    env = factory()
    torch.manual_seed(seed)
    model = build_model_for_env(cfg.model, env)
    env.close()
    return Policy(model, factory, cfg)


def random_play(policy: Policy, n_obs: int, seed: int) -> np.ndarray:
    """``[n_obs, *obs]``: observations of uniformly random actions from ``seed``'s reset."""
    env = policy.env_factory()
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    batch = []
    for _ in range(n_obs):
        batch.append(np.asarray(obs))
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    return np.stack(batch)


def dead_units(policy: Policy, n_obs: int = 256, seed: int = 0) -> list[tuple[str, int, int]]:
    """``(layer, dead, units)`` for each ReLU of ``policy``'s model, in forward order."""
    alive: list[tuple[str, torch.Tensor]] = []

    def hook(name: str):
        def record(_module, _inputs, out):
            dims = [d for d in range(out.dim()) if d != 1]  # all but the unit axis
            alive.append((name, (out > 0).amax(dim=dims)))

        return record

    handles = [
        module.register_forward_hook(hook(name))
        for name, module in policy.model.named_modules()
        if isinstance(module, torch.nn.ReLU)
    ]
    try:
        policy.act(random_play(policy, n_obs, seed))
    finally:
        for h in handles:
            h.remove()
    return [(name, int((~a).sum()), a.numel()) for name, a in alive]


def dead_fraction(policy: Policy, n_obs: int = 256, seed: int = 0) -> float:
    """Share of all of ``policy``'s ReLU units that are dead."""
    layers = dead_units(policy, n_obs, seed)
    return sum(d for _, d, _ in layers) / sum(n for _, _, n in layers)


def _row(label: str, layers: list[tuple[str, int, int]]) -> str:
    names = [n for n, _, _ in layers]
    cut = os.path.commonprefix(names).rfind(".") + 1 if len(names) > 1 else 0
    return f"{label:>16s}  " + "  ".join(f"{n[cut:]} {d}/{u}" for n, d, u in layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", help="a run directory (its last.pt)")
    p.add_argument("checkpoints", nargs="*", help="checkpoint files for RUN_DIR's model")
    p.add_argument("--preset", help="instead of a run: the preset's model as initialised")
    p.add_argument("--seed", type=int, default=0, help="the random play's (and init's) seed")
    p.add_argument("--obs", type=int, default=256, help="observations of random play")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.preset:
        policy = initial_policy(args.preset, args.seed)
        print("dead ReLU units per layer:")
        print(_row("initialised", dead_units(policy, args.obs, args.seed)))
        return
    if not args.run_dir:
        p.error("give RUN_DIR or --preset")
    policy = load_policy(args.run_dir, which="last")
    print("dead ReLU units per layer:")
    if not args.checkpoints:
        print(_row("last.pt", dead_units(policy, args.obs, args.seed)))
    for path in sorted(args.checkpoints, key=lambda f: (len(Path(f).name), Path(f).name)):
        policy.model.load_state_dict(checkpoint.load(Path(path))["model"])
        print(_row(Path(path).name, dead_units(policy, args.obs, args.seed)), flush=True)


if __name__ == "__main__":
    main()
