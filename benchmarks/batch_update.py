"""One batch's learner work as training does it: milliseconds per batch and per optimizer step.

    PYTHONPATH=src python benchmarks/batch_update.py pong_appo
    PYTHONPATH=src python benchmarks/batch_update.py pong_appo algorithm.device=cuda \\
        algorithm.actors_batch_size=4 algorithm.envs_per_actor=8
    PYTHONPATH=src python benchmarks/batch_update.py pong_appo --compile-torso
    PYTHONPATH=src python benchmarks/batch_update.py pong_appo --against model.precision=bf16
    PYTHONPATH=src python benchmarks/batch_update.py env.id=impala_rl.envs.samples:GridWorld

Builds the preset's model and learner for Atari frames (synthetic uint8 ``[4, 84, 84]``, 6
actions; no env, no actors) and a batch of ``actors_batch_size * envs_per_actor`` columns of
``n_rollout_steps``, then times what the trainer does per batch: ``num_passes`` passes of
``num_minibatches`` optimizer steps (``Learner.minibatches``, ``Learner.update``), the weights
published to shared memory as the subprocess backend does (after every
``broadcast_every``-th step and the batch's last). Prints the median
and spread (min-max) over ``--repeats`` batches after ``--warmup``. ``--against KEY=VALUE``
builds a second learner with those overrides added and alternates their batches (which goes
first alternates too), then prints both and the ratio of the medians. To compare code, run it
with each version on ``PYTHONPATH`` in the same session and take the ratio of the medians.
The learner process's memory is kept as training keeps it (``runner.keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
from learners import FRAME, N_ACTIONS, timed
from precision import batch_for

from impala_rl.actors import SequentialDistributedActors
from impala_rl.actors.subprocess import SharedWeights
from impala_rl.config import RunConfig, broadcasts_after, load_config
from impala_rl.env_defaults import resolve_config
from impala_rl.envs import make_env_factory
from impala_rl.learner import Learner
from impala_rl.malloc import keep_freed_memory
from impala_rl.nn.factory import build_model
from impala_rl.startup import learner_threads


def learner_batch(
    cfg: RunConfig, device: torch.device, compile_torso: bool = False
) -> Callable[[], None]:
    """One batch's work of the preset's learner (seed 0) on synthetic Atari frames on
    ``device``, as training does it: ``num_passes`` passes of ``num_minibatches`` optimizer
    steps, the weights published to shared memory where the trainer broadcasts them
    (:func:`~impala_rl.config.broadcasts_after`), as the subprocess backend does, and a
    captured update's figures read at the next step or publish (``settle_later``).
    ``compile_torso``: the encoders' forward compiled in place (``torch.compile``, inductor;
    the state dict keeps its keys), a candidate lever that training does not use yet."""
    alg = cfg.algorithm
    torch.manual_seed(0)
    if cfg.env.id:  # the env's own spaces and one batch of its steps
        env_factory = make_env_factory(cfg.env)
        probe = env_factory()
        model = build_model(cfg.model, probe.observation_space, probe.action_space)
        probe.close()
        with SequentialDistributedActors(env_factory, model, alg, 0) as actors:
            batch = actors.collect_outputs(device).batch
    else:
        model = build_model(
            cfg.model, gym.spaces.Box(0, 255, FRAME, np.uint8), gym.spaces.Discrete(N_ACTIONS)
        )
        columns = alg.actors_batch_size * alg.envs_per_actor
        batch = batch_for(alg.n_rollout_steps, columns, FRAME, N_ACTIONS)
        batch = {k: v.to(device) for k, v in batch.items()}
    if compile_torso:
        torsos = {id(t): t for c in model.critic_keys for t in (model.critic_torso(c),)}
        torsos.update({id(net.torso): net.torso for net in model.policies.values()})
        for torso in torsos.values():
            torso.compile(dynamic=False)
    learner = Learner(model, alg, device)
    weights = SharedWeights(learner.model.state_dict())

    def one_batch() -> None:
        taken = 0
        for n in range(alg.num_passes):
            for block in learner.minibatches(batch, fresh=n == 0):
                learner.update(block, fresh=n == 0, settle_later=True)
                taken += 1
                if broadcasts_after(alg, taken):
                    learner.settle()
                    weights.publish(learner.model.state_dict(), learner.num_updates)
        learner.settle()

    return one_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--compile-torso",
        action="store_true",
        help="compile the encoders' forward in place (torch.compile) before timing",
    )
    parser.add_argument(
        "--against",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="also time with these overrides added, batches alternating; print the ratio",
    )
    args = parser.parse_args()
    env_id = args.preset.startswith("env.id=")  # the settings impala train env.id=ID chooses

    def config(overrides: list[str]) -> RunConfig:
        if env_id:
            return resolve_config(None, [args.preset, *overrides])
        return load_config(args.preset, overrides)

    cfg = config(args.overrides)
    if cfg.runner.keep_freed_memory:  # as the trainer sets up its learner process
        keep_freed_memory()
    torch.set_num_threads(learner_threads(cfg))
    device = torch.device(cfg.algorithm.device if cfg.algorithm.device != "auto" else "cpu")
    variants = {" ".join(args.overrides) or "as written": cfg}
    if args.against:
        variants[" ".join(args.against)] = config(args.overrides + args.against)
    batches = {name: learner_batch(c, device, args.compile_torso) for name, c in variants.items()}
    threads = {name: learner_threads(c) for name, c in variants.items()}  # each its own
    for name, one_batch in batches.items():
        torch.set_num_threads(threads[name])
        for _ in range(args.warmup):
            one_batch()
    times: dict[str, list[float]] = {name: [] for name in batches}
    order = list(batches)
    for i in range(args.repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            torch.set_num_threads(threads[name])
            times[name] += [1e3 * t for t in timed(batches[name], 1, device)]
    for name, c in variants.items():
        alg = c.algorithm
        steps = alg.num_passes * alg.num_minibatches
        median = statistics.median(times[name])
        print(
            f"{args.preset} {name}{' (torso compiled)' * args.compile_torso}: "
            f"{alg.actors_batch_size * alg.envs_per_actor} columns x {alg.n_rollout_steps} "
            f"steps, {steps} optimizer steps per batch on {device}: {median:.1f} ms per batch "
            f"({min(times[name]):.1f}-{max(times[name]):.1f}), {median / steps:.2f} ms per step, "
            f"{threads[name]} threads"
        )
    if args.against:
        base, other = (statistics.median(times[name]) for name in order)
        print(f"{order[1]} / {order[0]}: {other / base:.3f} per batch")


if __name__ == "__main__":
    main()
