"""The bounded queue of finished rollouts that every multi-actor backend uses.

A backend moves slots and weights (its transport); this queue decides which finished rollout
waits where and which ones are dropped:

- At most ``max_waiting = ceil(queue_out_of_sync_factor * actors_batch_size)`` rollouts wait
  for the learner. A rollout that finds the queue full is *blocked* with its actor, and the
  backend gives that actor no new work until the learner takes a batch: this bounds staleness.
- :meth:`RolloutQueue.drop_stale` drops the rollouts (blocked ones first, actor by actor, then
  the queued ones in order) that would be more than ``max_policy_lag`` behind at hand-out; their
  reports wait in :meth:`take_dropped` for the next hand-out, where they count as collected and
  discarded (see :class:`impala_rl.actors.base.CollectedOutputs`).
- :meth:`RolloutQueue.unblock` moves blocked rollouts into the queue while there is room, the
  oldest first whichever its actor; the backend then gives its actors work again. (In actor
  order, while the learner is the bound, the first actors would block again before each batch
  and take all the room, and the others would wait until their rollouts went stale.)

The queue holds no lock: the supervisor calls it under its own. (Not ``queue.py``: the Ray
watchdog runs as a script from this directory, where that name would hide the standard library's
``queue``.)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Generic, TypeVar

from impala_rl.config import ImpalaAlgorithmConfig, handout_lag_bound, max_waiting_rollouts
from impala_rl.rollout import UnrollResult

P = TypeVar("P")


@dataclass
class Rollout(Generic[P]):
    """A finished rollout: where its data is (``payload``: a slot index, arrays, ...), the
    policy version that produced it, and its actor's report."""

    payload: P
    version: int
    result: UnrollResult


class RolloutQueue(Generic[P]):
    """Finished rollouts of ``cfg.num_actors`` actors: a bounded queue, blocked ones per actor,
    and the reports of the stale ones dropped since the last hand-out."""

    def __init__(self, cfg: ImpalaAlgorithmConfig):
        self.cfg = cfg
        self.max_waiting = max_waiting_rollouts(cfg)
        num_actors = cfg.num_actors
        self.ready: collections.deque[Rollout[P]] = collections.deque()
        # per actor, its blocked rollouts in order, each with its arrival number
        self.blocked: list[list[tuple[int, Rollout[P]]]] = [[] for _ in range(num_actors)]
        self._arrivals = 0
        self._dropped: list[UnrollResult] = []  # stale rollouts since the last hand-out

    def __len__(self) -> int:
        return len(self.ready)

    def put(self, actor_index: int, rollout: Rollout[P]) -> bool:
        """Queue an actor's finished rollout; False when it is blocked (the queue is full, or
        the actor's earlier rollouts wait already): then the actor gets no new work."""
        if len(self.ready) < self.max_waiting and not self.blocked[actor_index]:
            self.ready.append(rollout)
            return True
        self.blocked[actor_index].append((self._arrivals, rollout))
        self._arrivals += 1
        return False

    def is_blocked(self, actor_index: int) -> bool:
        return bool(self.blocked[actor_index])

    def discard_blocked(self, actor_index: int) -> list[Rollout[P]]:
        """Remove an actor's blocked rollouts (lost with their actor: neither recorded nor
        counted) and return them, so the backend can free their storage."""
        lost, self.blocked[actor_index] = self.blocked[actor_index], []
        return [rollout for _, rollout in lost]

    def is_stale(self, version: int, handout_version: int) -> bool:
        """Whether a rollout of policy ``version`` handed out at ``handout_version`` would be
        more than ``max_policy_lag`` behind when the learner's last pass over it measures."""
        bound = handout_lag_bound(self.cfg)
        return bound is not None and handout_version - version > bound

    def drop_stale(self, handout_version: int) -> list[Rollout[P]]:
        """Drop the rollouts more than ``max_policy_lag`` behind ``handout_version``: blocked
        ones (which :meth:`unblock` would otherwise queue unchecked) and queued ones. Returns
        them, so the backend can free their storage; their reports count at the next hand-out.
        """
        if handout_lag_bound(self.cfg) is None:
            return []
        dropped: list[Rollout[P]] = []
        for i, rollouts in enumerate(self.blocked):
            fresh = []
            for arrival, rollout in rollouts:
                if self.is_stale(rollout.version, handout_version):
                    dropped.append(rollout)
                else:
                    fresh.append((arrival, rollout))
            self.blocked[i] = fresh
        keep: collections.deque[Rollout[P]] = collections.deque()
        for rollout in self.ready:
            (dropped if self.is_stale(rollout.version, handout_version) else keep).append(rollout)
        self.ready = keep
        self._dropped += [rollout.result for rollout in dropped]
        return dropped

    def unblock(self) -> None:
        """Move blocked rollouts into the queue while there is room, the oldest first."""
        while len(self.ready) < self.max_waiting:
            heads = [(rollouts[0][0], i) for i, rollouts in enumerate(self.blocked) if rollouts]
            if not heads:
                return
            _, oldest = min(heads)
            self.ready.append(self.blocked[oldest].pop(0)[1])

    def take(self, n: int) -> list[Rollout[P]]:
        """The ``n`` oldest queued rollouts (the caller checks that there are ``n``)."""
        return [self.ready.popleft() for _ in range(n)]

    def take_dropped(self) -> list[UnrollResult]:
        """The reports of the rollouts dropped since the last call, oldest first."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def drop_taken(self, results: list[UnrollResult]) -> None:
        """Count rollouts already taken (a batch that went stale before its hand-out) as
        dropped, ahead of the ones dropped since."""
        self._dropped[:0] = results

    def clear(self) -> None:
        """Forget every rollout (the actors stop)."""
        self.ready.clear()
        for rollouts in self.blocked:
            rollouts.clear()
        self._dropped = []
