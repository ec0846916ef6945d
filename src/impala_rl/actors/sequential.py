"""In-process actors, stepped round-robin: deterministic for a seed, for debugging and tests."""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from impala_rl.actors.base import CollectedOutputs, DistributedActors, actor_seed
from impala_rl.rollout import ActorLoop, column_block


class SequentialDistributedActors(DistributedActors):
    """``num_actors`` actor loops run one after another in the learner's process.

    Each :meth:`collect_outputs` runs the next ``actors_batch_size`` actors (round-robin) for
    one unroll each, writing straight into column blocks of one batch buffer. The actors act
    only there (``acts_between_batches``: the learner sends a batch's last weights alone), so
    weights loaded at once are loaded between unrolls, and policy lag is always 0.
    """

    acts_between_batches = True

    def start(self) -> None:
        cfg = self.cfg
        self.actors = [
            ActorLoop(
                self.env_factory,
                cfg.envs_per_actor,
                copy.deepcopy(self._template),
                actor_seed(self.seed, i),
                cfg.n_rollout_steps,
                actor_index=i,
            )
            for i in range(cfg.num_actors)
        ]
        for actor in self.actors:
            actor.policy_version = self.policy_version
        observation_space = self.actors[0].envs.single_observation_space
        spec = self.spec(observation_space)
        self._batch = dataclasses.replace(spec, N=spec.N * cfg.actors_batch_size).allocate()
        self._next_actor = 0

    def stop(self) -> None:
        for actor in getattr(self, "actors", []):
            actor.close()
        self.actors = []

    def broadcast_updated_policy(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> None:
        self.policy_version = self.policy_version + 1 if version is None else version
        cpu_state = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        for actor in self.actors:
            actor.load_policy(cpu_state, self.policy_version)

    def collect_outputs(self, learner_device: torch.device | str) -> CollectedOutputs:
        n = self._batch["policy_version"].shape[0] // self.cfg.actors_batch_size
        env_steps = 0
        for b in range(self.cfg.actors_batch_size):
            actor = self.actors[self._next_actor]
            self._next_actor = (self._next_actor + 1) % len(self.actors)
            result = actor.unroll(column_block(self._batch, b * n, (b + 1) * n))
            self.record_unroll(result)
            env_steps += result.env_steps
        t0 = time.perf_counter()
        device = torch.device(learner_device)
        batch = {
            k: v.to(device, copy=True) if device.type != "cpu" else v
            for k, v in self._batch.items()
        }
        return CollectedOutputs(batch, 0, 0, time.perf_counter() - t0, env_steps)
