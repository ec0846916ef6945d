"""The ``DistributedActors`` interface every backend implements."""

from __future__ import annotations

import abc
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala_rl.config import ImpalaAlgorithmConfig, check_queue_out_of_sync_factor
from impala_rl.events import ActorEvents
from impala_rl.nn import Model
from impala_rl.rollout import RolloutSpec, UnrollResult, rollout_spec_for
from impala_rl.stats import EPOCH, EpochStatsAggregator, EventRecorder


class ActorError(RuntimeError):
    """An actor failed (an exception in its env or policy, or too many deaths)."""


@dataclass
class CollectedOutputs:
    """One learner batch and how getting it went.

    ``batch`` holds the slot fields of :mod:`impala_rl.rollout` with ``B = actors_batch_size *
    envs_per_actor`` columns: ``[T+1, B, ...]`` for observations, ``[T, B]`` per step.

    Every rollout is recorded once, when it leaves the queue: taken into a batch, or dropped
    for exceeding ``max_policy_lag`` (``dropped_stale``, since the previous batch). A dropped
    rollout counts as collected and discarded: its episodes go into the episode statistics and
    its env steps into ``env_steps``, next to the batch's own. Rollouts still queued when the
    actors stop, or lost with a dead actor, count in neither.
    """

    batch: dict[str, torch.Tensor]
    queue_size_before: int
    queue_size_after: int
    dequeue_time: float
    env_steps: int
    dropped_stale: int = 0


def actor_seed(seed: int, actor_index: int) -> int:
    """Independent, reproducible seed for one actor's envs and sampler."""
    return int(np.random.SeedSequence([seed, actor_index]).generate_state(1)[0])


class DistributedActors(abc.ABC):
    """Actors that fill rollouts with a (slightly stale) copy of the policy.

    The learner calls :meth:`broadcast_updated_policy` after its updates and
    :meth:`collect_outputs` before the next one. Actors record episode statistics as
    :class:`impala_rl.events.ActorEvents`, reduced per epoch by the aggregator.
    """

    #: Whether only a batch's last broadcast reaches the actors (they act between batches,
    #: not while the learner steps): the learner then skips the others.
    acts_between_batches: bool = False

    def __init__(
        self,
        env_factory: Callable[[], gym.Env],
        model: Model,
        cfg: ImpalaAlgorithmConfig,
        seed: int,
    ):
        check_queue_out_of_sync_factor(cfg)
        self.env_factory = env_factory
        self.cfg = cfg
        self.seed = seed
        self.policy_version = 0
        self._template = copy.deepcopy(model).cpu()
        self.recorder = EventRecorder()
        self.events = self.recorder.interface(ActorEvents)
        self._aggregator = EpochStatsAggregator(self.recorder)
        self._new_returns: list[float] = []
        self._returns_lock = threading.Lock()

    def spec(self, observation_space: gym.spaces.Space | None) -> RolloutSpec:
        return rollout_spec_for(
            self._template, observation_space, self.cfg.n_rollout_steps, self.cfg.envs_per_actor
        )

    @abc.abstractmethod
    def start(self) -> None:
        """Create the actors; they may begin collecting at once."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop and join every actor and free every resource; safe to call twice."""

    def abandon(self) -> None:  # noqa: B027 (a backend that restarts nothing has nothing to do)
        """Restart no actor from now on: the process is ending without :meth:`stop` (its
        main thread does not return) and stops every process it started itself. Safe from
        any thread."""

    @abc.abstractmethod
    def broadcast_updated_policy(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> None:
        """Publish new weights; actors load them between unrolls. ``version``: the learner's
        optimizer steps so far (``algorithm.broadcast_every`` > 1 skips some); ``None``
        increments the version by one."""

    @abc.abstractmethod
    def collect_outputs(self, learner_device: torch.device | str) -> CollectedOutputs:
        """Gather ``actors_batch_size`` finished rollouts into one batch on the device.

        The batch is only valid until the next call (a backend may reuse its buffers): clone
        what must outlive the update.
        """

    def record_unroll(self, result: UnrollResult) -> None:
        """Record a rollout's episodes and env steps as it leaves the queue (see above)."""
        for ret, length in zip(result.episode_returns, result.episode_lengths, strict=True):
            self.events.episode_return(ret)
            self.events.episode_length(length)
        self.events.actor_env_steps(result.env_steps)
        with self._returns_lock:
            self._new_returns.extend(result.episode_returns)

    def recent_returns_since_last_call(self) -> list[float]:
        """Episode returns finished since the previous call (for live progress)."""
        with self._returns_lock:
            returns, self._new_returns = self._new_returns, []
        return returns

    def get_epoch_stats_aggregator(self) -> EpochStatsAggregator:
        return self._aggregator

    def get_stats_value(self, event: Any, level: str = EPOCH, name: str | None = None) -> Any:
        return self._aggregator.get_stats_value(event, level, name)

    def __enter__(self) -> DistributedActors:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
