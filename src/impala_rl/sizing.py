"""A preset sized to the machine it starts on (``runner.size_to_machine``).

A preset describes learning (unroll, passes, lr) for the 2-core machine it was tuned on. A
preset that sets ``runner.size_to_machine: true`` is sized at start-up to the cores and the GPU
this process sees, for the settings the user did not give (an override always wins):

- **a GPU** (unless ``algorithm.device=cpu`` is given): the learner on it
  (``algorithm.device=cuda``), one actor process per core with one stepping thread each,
  batches of a quarter of the actors' unrolls
  (``actors_batch_size``), central inference with one server per 8 cores, each actor's envs
  in two groups that take turns (``runner.env_splits``). Measured on one H100/H200 with 16
  cores (docs/performance.md): B=4 of 16 actors trained fastest, central inference 1.2x
  actor-side, two servers beside one; the two groups filled batches 1.46x faster than one on
  2 CPU cores (one actor, one server: benchmarks/env_splits.py), not yet timed on a GPU;
- **no GPU, more than 2 cores**: half the cores step envs (one actor process each, one
  stepping thread), the other half run the learner (``runner.learner_threads``), a batch of
  one unroll per actor (not measured beyond 2 cores);
- **2 cores or fewer**: the preset as written.

Precision is never sized: ``model.precision=bf16`` is the user's choice. On a CPU with bf16
units it makes a ``pong_appo`` batch 0.67x fp32's (a whole run 1.08x the env steps/s), and
within 1.5M env steps it reached +18 on 1 of 4 seeds, fp32 on 3 of 5: not the sooner +18 a
sized default needs (docs/experiments/pong.md, "bf16 and the last points").

``algorithm.epoch_length`` is scaled by the preset's batch over the new one, so an epoch
stays the same number of env steps. A batch of k times the preset's unrolls is cut into k times
its ``algorithm.num_minibatches``: each optimizer step sees the preset's minibatch, and a run
takes the preset's optimizer steps per env step, which is what ends Pong's plateau. On 2 cores,
`pong_appo` with batches of 4 unrolls passed -15 at 1.344M env steps in 4 minibatches (the GPU
box's sizing before), at 512k in 16 (docs/experiments/pong.md, "Batches sized for the machine").

What was chosen is said on the log and kept in the run's config (``runner.sized_for``, the
sized values): a resume runs it as it was, on any machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from impala_rl.config import ImpalaAlgorithmConfig, RunConfig, load_config, to_dict
from impala_rl.machine import available_cores

log = logging.getLogger(__name__)

CORES_PER_SERVER = 8
"""Central inference servers on a GPU box: one per this many cores."""


@dataclass(frozen=True)
class Machine:
    """What a run can use: cores (this process's affinity) and the GPU's name, if any."""

    cores: int
    gpu: str | None = None

    def __str__(self) -> str:
        return f"{self.cores} cores" + (f", {self.gpu}" if self.gpu else ", no GPU")


def detect_machine() -> Machine:
    """This process's machine."""
    cores = available_cores()
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # a broken CUDA install counts as none
        gpu = None
    return Machine(cores, gpu)


def _given(overrides: list[str]) -> set[str]:
    return {item.split("=", 1)[0].strip().lstrip("+") for item in overrides}


def sized_settings(cfg: RunConfig, machine: Machine, given: set[str] | None = None) -> dict:
    """The settings ``machine`` gives ``cfg`` (dotted keys); those in ``given`` (the user's
    overrides, already in ``cfg``) are left out and the others follow them (a given actor
    count sets the batch). Empty for a machine of 2 cores or fewer without a GPU."""
    given = given or set()
    on_gpu = machine.gpu is not None and (
        "algorithm.device" not in given or cfg.algorithm.device != "cpu"
    )
    out = _process_layout(cfg, machine, on_gpu, given)
    return {k: v for k, v in out.items() if k not in given}


def _process_layout(cfg: RunConfig, machine: Machine, on_gpu: bool, given: set[str]) -> dict:
    """Where actors, the learner and inference run, and the batch and epoch that follow; empty
    on 2 cores or fewer without a GPU."""
    a = cfg.algorithm
    out: dict[str, object] = {}
    if on_gpu:
        actors = a.num_actors if "algorithm.num_actors" in given else machine.cores
        out["algorithm.device"] = "cuda"
        out["algorithm.actors_batch_size"] = max(1, actors // 4)
        place = cfg.runner.inference if "runner.inference" in given else "central"
        if cfg.runner.backend == "subprocess" and place != "actor":  # central inference's
            out["runner.inference"] = place
            if place == "central":  # each learner runs servers for its own share of the actors
                per_learner = max(1, actors // a.num_learners)
                servers = max(1, min(per_learner, machine.cores // CORES_PER_SERVER))
                out["runner.inference_servers"] = servers
            if a.envs_per_actor % 2 == 0:  # one half steps while the other's answer comes
                out["runner.env_splits"] = 2
    elif machine.cores > 2:
        actors = a.num_actors if "algorithm.num_actors" in given else machine.cores // 2
        out["algorithm.actors_batch_size"] = actors
        out["runner.learner_threads"] = max(1, machine.cores - actors)
    else:
        return out
    out["algorithm.num_actors"] = actors
    if "algorithm.actors_batch_size" not in given:
        batch = int(out["algorithm.actors_batch_size"])  # type: ignore[call-overload]
        out["algorithm.epoch_length"] = max(1, round(a.epoch_length * a.actors_batch_size / batch))
        if batch % a.actors_batch_size == 0:  # each step on the preset's minibatch
            scaled = a.num_minibatches * batch // a.actors_batch_size
            minibatches = _within_lag(a, scaled)
            out["algorithm.num_minibatches"] = minibatches
            if a.broadcast_every is not None and "algorithm.num_minibatches" not in given:
                # the preset's publishes a batch: each copies the weights out of the learner
                # (~0.9 ms on an H200), and k - 1 steps more lag are nothing beside a batch's
                factor = max(1, minibatches // a.num_minibatches)
                out["algorithm.broadcast_every"] = a.broadcast_every * factor
    if "vector_threads" in cfg.env.kwargs:
        out["env.kwargs.vector_threads"] = 1
    return out


def _within_lag(a: ImpalaAlgorithmConfig, scaled: int) -> int:
    """``scaled`` minibatches, or the most of its divisors (at least the preset's) whose steps
    per batch keep within ``max_policy_lag``: a step n on a batch sees n more updates than
    its first, and a bound that the preset's own minibatches break is left to the config's
    refusal, which names the field."""
    if a.max_policy_lag is None:
        return scaled
    fits = [
        n
        for n in range(a.num_minibatches, scaled + 1)
        if scaled % n == 0 and a.num_passes * n - 1 <= a.max_policy_lag
    ]
    return max(fits, default=scaled)


def size_to_machine(
    cfg: RunConfig,
    overrides: list[str],
    machine: Machine | None = None,
    given: set[str] | None = None,
) -> RunConfig:
    """``cfg`` sized to ``machine`` (this one by default) if its preset asks for it, the
    keys in ``overrides`` and ``given`` (those a config file of the user's sets) left as
    given; records ``runner.sized_for`` and logs the choice."""
    if not cfg.runner.size_to_machine or cfg.runner.sized_for is not None:
        return cfg
    machine = machine or detect_machine()
    chosen = sized_settings(cfg, machine, _given(overrides) | set(given or ()))
    what = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "the preset as written"
    sized = load_config(base=to_dict(cfg), overrides=[f"{k}={v}" for k, v in chosen.items()])
    sized.runner.sized_for = str(machine)
    log.info(
        "sized for %s: %s (overrides win; runner.size_to_machine=false: as written)", machine, what
    )
    return sized
