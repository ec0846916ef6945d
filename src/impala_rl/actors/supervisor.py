"""One supervisor for every multi-actor backend: it starts the actors, restarts them within the
budget, surfaces their errors, assembles batches (ahead of the learner) and shuts them down.

A backend is only a transport (:class:`ActorSupervisor`'s hooks): it spawns one actor, hands it
work, turns what its actors send into :class:`ActorEvent` s (a finished rollout, an error, a
death), copies a finished rollout into a batch, publishes weights and stops. The subprocess
backend moves slot indices over pipes into shared-memory slots; the Ray backend moves rollouts
through the object store.

The supervisor
--------------
- A dispatcher thread waits for the transport's events and handles each under one lock: a
  finished rollout goes into the :class:`impala_rl.actors.rollout_queue.RolloutQueue` (whose
  bound decides whether its actor gets new work), an error ends collection with an
  :class:`ActorError` naming the actor, a death frees what the actor held and restarts it, up
  to ``runner.max_actor_restarts`` restarts in all. An actor that dies again before it came up
  (no rollout, no ready signal) is restarted after a back-off that doubles with each such death
  (``RESTART_BACKOFF_S``, at most ``MAX_RESTART_BACKOFF_S``): a restart that Ray places on a
  node that is dying but not yet declared dead, or an env that crashes at start, would
  otherwise spend the whole restart budget in a fraction of a second.
- Between rounds it assembles the next batch while the learner updates (prefetch).
  ``max_policy_lag`` holds at hand-out, where the learner measures it: a batch prefetched during
  an update is handed out after that update's broadcast, so the prefetch drops (and counts) the
  rollouts that will then be too old; :meth:`collect_outputs` checks again and drops a
  prefetched batch that went stale anyway (more than one broadcast since it was assembled).
- A rollout's episode statistics are recorded when it leaves the queue, taken or dropped,
  together with its env steps (see :class:`impala_rl.actors.base.CollectedOutputs`).
- :meth:`abandon` restarts nothing from then on; :meth:`stop` joins the dispatcher, then the
  transport stops its actors and frees its resources.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from impala_rl.actors.base import ActorError, CollectedOutputs, DistributedActors, actor_seed
from impala_rl.actors.rollout_queue import Rollout, RolloutQueue
from impala_rl.envs.structured import is_structured
from impala_rl.rollout import RolloutSpec, UnrollResult, column_block

POLL_S = 0.05
RESTART_BACKOFF_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0
log = logging.getLogger(__name__)

P = TypeVar("P")  # where a finished rollout's data is: a slot index, arrays, ...


class Actor:
    """The supervisor's view of one actor; a transport adds where it runs and what it holds."""

    def __init__(self, index: int):
        self.index = index
        self.starts = 0  # (re)starts so far: an event of an earlier start is out of date
        self.delivered = 0  # rollouts delivered since the last (re)start
        self.up = False  # ready or delivered since the last (re)start
        self.deaths_before_up = 0  # deaths in a row before it came up: the restart back-off
        self.restart_due: float | None = None  # monotonic time of a backed-off restart


A = TypeVar("A", bound=Actor)

ROLLOUT, READY, ERROR, DEATH = "rollout", "ready", "error", "death"


@dataclass
class ActorEvent(Generic[P]):
    """What one actor's transport received: ``ROLLOUT`` (``rollout``), ``READY`` (it is up,
    give it work), ``ERROR`` (``error``: an exception in its env or policy) or ``DEATH``
    (``cause``: its exit code or the exception that reported it). ``generation`` is the actor's
    ``starts`` when its transport began waiting; ``token`` is the transport's (e.g. the call)."""

    actor: Actor
    generation: int
    kind: str
    rollout: Rollout[P] | None = None
    error: ActorError | None = None
    cause: str = ""
    token: Any = None


class ActorSupervisor(DistributedActors, Generic[A, P]):
    """``num_actors`` actors behind a transport, a bounded queue, restarts and prefetching."""

    dispatcher_name = "impala-dispatcher"

    def __init__(self, *args: Any, runner: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.runner = runner
        self.max_restarts = getattr(runner, "max_actor_restarts", 3)
        self.shutdown_timeout_s = getattr(runner, "shutdown_timeout_s", 10.0)
        self.restarts = 0
        self.actors: list[A] = []
        self._started = False
        self._stopping = False
        self._error: BaseException | None = None
        self._lock = threading.Condition()
        self._dispatcher: threading.Thread | None = None

    # -- the transport ---------------------------------------------------------------------------
    def _prepare(self) -> None:  # noqa: B027 (a transport with nothing to check)
        """Checks and connections before anything needs stopping (may raise)."""

    @abc.abstractmethod
    def _open(self, spec: RolloutSpec) -> None:
        """Allocate what the actors share (slots, weights, servers); :meth:`stop` frees it."""

    @abc.abstractmethod
    def _new_actor(self, index: int) -> A:
        """The supervisor's view of actor ``index``, not started yet."""

    @abc.abstractmethod
    def _spawn(self, actor: A, seed: int) -> None:
        """Start ``actor`` (again) with ``seed``; the supervisor counts its ``starts``."""

    @abc.abstractmethod
    def _give_work(self, actor: A) -> None:
        """Let ``actor`` fill its next rollout(s) if it has none to fill (it is not blocked)."""

    @abc.abstractmethod
    def _alive(self, actor: A) -> bool:
        """Whether ``actor`` runs (it was not buried, or was restarted since)."""

    @abc.abstractmethod
    def _waitables(self) -> Any:
        """Under the lock: what the dispatcher waits on next (with each actor's generation)."""

    @abc.abstractmethod
    def _events(self, waitables: Any, timeout: float) -> Iterator[ActorEvent[P]]:
        """Outside the lock: wait up to ``timeout`` and yield what arrived, oldest first."""

    def _accept(self, actor: A, event: ActorEvent[P]) -> bool:
        """Under the lock: take note that ``actor`` delivered ``event`` (a rollout, or
        ``READY``); False when the event is out of date."""
        return True

    @abc.abstractmethod
    def _bury(self, actor: A, cause: str) -> str:
        """Under the lock: ``actor`` died of ``cause``; reap it and free what it held (not its
        blocked rollouts: the supervisor releases those). Returns the cause to report."""

    def _release(self, payload: P) -> None:  # noqa: B027 (a payload that frees itself)
        """A rollout's storage is free again (taken into a batch, dropped, or lost)."""

    @abc.abstractmethod
    def _copy_rollout(self, block: dict[str, torch.Tensor], payload: P) -> None:
        """Copy a finished rollout into its columns of a batch (``block``: ``[T+1, N, ...]``)."""

    @abc.abstractmethod
    def _publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Publish weights as ``version`` (the supervisor counts versions first)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Stop every actor and free every resource (after the dispatcher ended); idempotent."""

    def _failure(self, actor: A | None = None) -> ActorError | None:
        """An error behind the actors' (a central inference server's), or None."""
        return None

    def _death_hint(self, actor: A) -> str:
        """A sentence to add when an actor's death ends collection."""
        return ""

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        self._prepare()
        self._started = True
        try:
            probe = self.env_factory()
            # a structured env's observations reach the slot as its keys' model forms: the
            # model's spaces (its own space holds the raw Dict, an action_mask and all)
            space = None if is_structured(probe) else probe.observation_space
            spec: RolloutSpec = self.spec(space)
            probe.close()
            # finished rollouts: queued, blocked with their actor, or dropped as stale
            self.queue: RolloutQueue[P] = RolloutQueue(cfg)
            self.max_waiting = self.queue.max_waiting
            self._batch_spec = dataclasses.replace(spec, N=spec.N * cfg.actors_batch_size)
            # assembled batches, each with its oldest policy version and the reports it hands out
            self._batches: collections.deque[tuple[CollectedOutputs, int, list[UnrollResult]]] = (
                collections.deque()
            )
            self._in_update = False  # between a hand-out and the next broadcast
            self._assembling = False
            self._learner_device: torch.device | None = None
            self._open(spec)
            self.actors = [self._new_actor(i) for i in range(cfg.num_actors)]
            with self._lock:
                for actor in self.actors:
                    self._start_actor(actor)
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop, name=self.dispatcher_name, daemon=True
            )
            self._dispatcher.start()
        except BaseException:
            self.stop()
            raise

    def _start_actor(self, actor: A) -> None:
        seed = actor_seed(self.seed, actor.index)
        if actor.starts:
            seed = actor_seed(self.seed + 7919 * actor.starts, actor.index)
        self._spawn(actor, seed)
        actor.delivered = 0
        actor.up = False
        actor.restart_due = None
        actor.starts += 1
        self._resume(actor)

    def _resume(self, actor: A) -> None:
        if self._alive(actor) and not self.queue.is_blocked(actor.index):
            self._give_work(actor)

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=self.shutdown_timeout_s)
        self._close()
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.clear()

    def abandon(self) -> None:
        # No lock: a main thread that does not return may hold it. The dispatcher reads the
        # flag at its next round and returns; no death is handled once it is set.
        self._stopping = True

    # -- the dispatcher thread -------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    self._start_due_restarts()
                    waitables = self._waitables()
                for event in self._events(waitables, POLL_S):
                    with self._lock:
                        self._handle(event)
                self._assemble()
        except BaseException as exc:  # surfaces in collect_outputs
            with self._lock:
                self._error = self._error or exc
                self._lock.notify_all()

    def _handle(self, event: ActorEvent[P]) -> None:
        actor: A = event.actor  # type: ignore[assignment]
        # Out of date: died (not restarted), or died and restarted while this round's other
        # events were handled (a transport's handle can be reused: match generations).
        if self._stopping or actor.starts != event.generation or not self._alive(actor):
            return
        if event.kind == DEATH:
            self._on_death(actor, event.cause)
        elif event.kind == ERROR:
            self._error = self._error or self._failure(actor) or event.error
        elif not self._accept(actor, event):
            return
        else:
            actor.up, actor.deaths_before_up = True, 0
            if event.kind == READY:
                self._resume(actor)
            else:
                assert event.rollout is not None
                actor.delivered += 1
                if self.queue.put(actor.index, event.rollout):
                    self._resume(actor)
        self._lock.notify_all()

    def _on_death(self, actor: A, cause: str) -> None:
        cause = self._bury(actor, cause)
        for lost in self.queue.discard_blocked(actor.index):  # neither recorded nor counted
            self._release(lost.payload)
        if self._error is not None:
            return
        self._error = self._failure(actor)  # e.g. its answers are lost with its server
        if self._error is not None:
            return
        pending = sum(a.restart_due is not None for a in self.actors)
        if self.restarts + pending >= self.max_restarts:
            self._error = ActorError(
                f"actor {actor.index} died ({cause}) and the restart limit "
                f"runner.max_actor_restarts={self.max_restarts} is reached"
                + self._death_hint(actor)
            )
            return
        delay = self._restart_delay(actor)
        log.warning(
            "actor %d died (%s); restarting it%s (%d of runner.max_actor_restarts=%d)",
            actor.index,
            cause,
            f" in {delay:g} s ({actor.deaths_before_up} deaths in a row before it came up)"
            if delay
            else "",
            self.restarts + pending + 1,
            self.max_restarts,
        )
        if delay:
            actor.restart_due = time.monotonic() + delay
        else:
            self._restart(actor)

    def _restart(self, actor: A) -> None:
        self._start_actor(actor)
        self.restarts += 1  # counted once the new actor runs
        self.events.actor_restarts(1)

    @staticmethod
    def _restart_delay(actor: Actor) -> float:
        """Seconds to wait before restarting ``actor``, which just died: none if it had come
        up, else a back-off that doubles with each death in a row before it came up."""
        actor.deaths_before_up = 0 if actor.up else actor.deaths_before_up + 1
        if not actor.deaths_before_up:
            return 0.0
        return min(RESTART_BACKOFF_S * 2 ** (actor.deaths_before_up - 1), MAX_RESTART_BACKOFF_S)

    def _start_due_restarts(self) -> None:
        """Under the lock: start the backed-off restarts whose time has come."""
        now = time.monotonic()
        for actor in self.actors:
            if actor.restart_due is not None and now >= actor.restart_due:
                self._restart(actor)

    def _drop_stale(self, handout_version: int) -> None:
        """Drop rollouts more than ``max_policy_lag`` behind ``handout_version``; free them."""
        for rollout in self.queue.drop_stale(handout_version):
            self._release(rollout.payload)
        self._unblock()

    def _unblock(self) -> None:
        """Move blocked rollouts into the queue while there is room; give their actors work."""
        self.queue.unblock()
        for actor in self.actors:
            self._resume(actor)

    def _assemble(self, in_learner: bool = False) -> None:
        """Copy ``actors_batch_size`` queued rollouts into a batch while the learner is busy.

        The batch's ``dequeue_time`` is the learner's own time spent on it: the copy when the
        learner thread assembles it, nothing when it was prefetched.
        """
        with self._lock:
            if self._batches or self._assembling or self._learner_device is None:
                return
            # during an update the batch is handed out after that update's broadcast
            self._drop_stale(self.policy_version + int(self._in_update))
            if len(self.queue) < self.cfg.actors_batch_size:
                return
            queue_before = len(self.queue)
            rollouts = self.queue.take(self.cfg.actors_batch_size)
            self._assembling = True
            device = self._learner_device
        t0 = time.perf_counter()
        batch = self._batch_spec.allocate(pin_memory=device.type == "cuda")
        n = self._batch_spec.N // self.cfg.actors_batch_size
        for b, rollout in enumerate(rollouts):
            self._copy_rollout(column_block(batch, b * n, (b + 1) * n), rollout.payload)
        if device.type != "cpu":
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        copy_time = time.perf_counter() - t0
        with self._lock:
            self._assembling = False
            for rollout in rollouts:
                self._release(rollout.payload)
            self._unblock()
            dropped = self.queue.take_dropped()
            results = [r.result for r in rollouts] + dropped
            out = CollectedOutputs(
                batch,
                queue_before,
                len(self.queue),
                copy_time if in_learner else 0.0,
                sum(r.env_steps for r in results),
                len(dropped),
            )
            self._batches.append((out, min(r.version for r in rollouts), results))
            self._lock.notify_all()

    # -- the learner's side ----------------------------------------------------------------------
    def _check(self) -> None:
        """Under the lock, while the learner waits: raise what stops collection."""
        if self._error is not None:
            raise self._error
        failure = self._failure()
        if failure is not None:
            raise failure
        if self._dispatcher is None or not self._dispatcher.is_alive():
            raise ActorError("the dispatcher thread stopped unexpectedly")

    def broadcast_updated_policy(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> None:
        with self._lock:  # the version before the weights: a rollout is never newer
            self.policy_version = self.policy_version + 1 if version is None else version
            self._in_update = False
            version = self.policy_version
        self._publish(state_dict, version)

    def collect_outputs(self, learner_device: torch.device | str) -> CollectedOutputs:
        device = torch.device(learner_device)
        with self._lock:
            self._learner_device = device
            self._in_update = False
        while True:
            with self._lock:
                while not self._batches:
                    self._check()
                    if len(self.queue) >= self.cfg.actors_batch_size and not self._assembling:
                        break
                    self._lock.wait(timeout=POLL_S)
            if not self._batches:
                self._assemble(in_learner=True)  # data is ready: no need to wait for the thread
            t_pop = time.perf_counter()
            with self._lock:
                if not self._batches:
                    continue  # stale rollouts were dropped: wait for fresh ones
                out, oldest, results = self._batches.popleft()
                self._lock.notify_all()
                if self.queue.is_stale(oldest, self.policy_version):
                    self.queue.drop_taken(results)  # prefetched before several broadcasts
                    continue
                self._in_update = True
                for result in results:
                    self.record_unroll(result)
            out.dequeue_time += time.perf_counter() - t_pop
            return out

    def queue_size(self) -> int:
        with self._lock:
            return len(self.queue)
