"""Actor processes writing into preallocated shared-memory slots: the fast default.

Layout
------
- ``num_slots = max_waiting + num_actors + actors_batch_size`` slots (dicts of shared
  tensors, ``[T+1, N, ...]``; uint8 stays uint8), created once. Only slot *indices* travel.
  Each field is one shared tensor ``[num_slots, ...]`` whose rows are the slots, and the policy
  travels pickled by value: an actor process receives a file descriptor per field and two for
  the weights, however many slots or parameters (the forkserver passes fewer than 256).
- Each actor owns one pipe to the learner process. The learner's dispatcher thread hands an
  actor a free slot index; the actor fills it (one unroll) and sends the index back with its
  episode statistics. At most ``max_waiting = ceil(queue_out_of_sync_factor *
  actors_batch_size)`` full slots wait for the learner; an actor whose slot finds the queue
  full is given no new slot until the learner takes a batch (it blocks), which bounds
  staleness. The queue, its stale drops and their accounting are
  :class:`impala_rl.actors.rollout_queue.RolloutQueue`'s, as for the Ray backend.
- The dispatcher also assembles the next batch while the learner updates (prefetch), notices
  dead actors at once (process sentinels), reclaims their slot and restarts them up to
  ``runner.max_actor_restarts``.
- ``max_policy_lag`` holds at hand-out, where the learner measures it. A batch prefetched during
  an update is handed out after that update's broadcast, so the prefetch drops (and counts) the
  slots that will then be too old; :meth:`collect_outputs` checks again and drops a prefetched
  batch that went stale anyway (more than one broadcast since it was assembled).
- A slot's episode statistics are recorded when it leaves the queue, taken or dropped, together
  with its env steps (see :class:`CollectedOutputs`).
- Weights: one shared flat float buffer plus a header ``[seqlock, version]``. The learner
  writes under the seqlock; actors copy a consistent snapshot between unrolls only.
- With ``runner.inference=central`` the actors hold no weights: each has a second pipe, to
  its inference server's process (:mod:`impala_rl.actors.inference`; actor ``i`` to server
  ``i % runner.inference_servers``), which reads the same weight buffer between batches of
  requests. The server's end of a restarted actor's new pipe is handed to it over its control
  pipe; a server failing ends training with its error.

Shared memory comes from torch's file-descriptor strategy, so nothing is left under
``/dev/shm`` even when a process is killed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing import forkserver, resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers shared-tensor pickling)

from impala_rl.actors.base import ActorError, CollectedOutputs, DistributedActors, actor_seed
from impala_rl.actors.inference import CentralActing, InferenceProcess, allocate_requests
from impala_rl.actors.rollout_queue import Rollout, RolloutQueue
from impala_rl.rollout import ActorLoop, RolloutSpec, UnrollResult, column_block

POLL_S = 0.05
log = logging.getLogger(__name__)


def start_forkserver() -> None:
    """Start the forkserver (it imports torch and the actor loop once, ~1.5 s, for every actor
    it forks); called early by the trainer, so that this runs on another core while the
    learner is built."""
    mp.get_context("forkserver").set_forkserver_preload(["impala_rl.rollout"])
    forkserver.ensure_running()


def stop_helper_processes() -> None:
    """Stop and join the forkserver and the resource tracker, where this process runs them:
    left alone, each exits only after it notices that its parent is gone, so `impala train`
    would return with them still there (~2 s for the forkserver)."""
    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)  # private (CPython's tests use it); absent: left be
        if stop is not None:
            stop()  # a no-op where the helper is not running


# -- weights: a flat buffer behind a seqlock --------------------------------------------------
class SharedWeights:
    """A flat float32 copy of a state dict in shared memory, with a version counter."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.keys = list(state_dict)
        self.shapes = [tuple(v.shape) for v in state_dict.values()]
        self.dtypes = [v.dtype for v in state_dict.values()]
        self.numels = [v.numel() for v in state_dict.values()]
        self.buffer = torch.zeros(sum(self.numels), dtype=torch.float32).share_memory_()
        self.header = torch.zeros(2, dtype=torch.int64).share_memory_()  # [seq, version]
        self._pinned: torch.Tensor | None = None  # a reader's staging for a GPU model

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write ``state_dict`` (on any device) as ``version``: flattened where it lies, then
        one copy into shared memory (a GPU learner publishes after every optimizer step)."""
        flat = torch.cat([state_dict[k].detach().reshape(-1).float() for k in self.keys])
        self.header[0] += 1  # odd: writing
        self.buffer.copy_(flat)
        self.header[1] = version
        self.header[0] += 1  # even: consistent

    def read_into(self, model: torch.nn.Module, known_version: int) -> int:
        """Copy the weights into ``model`` if newer than ``known_version``; returns the version.

        A model on a GPU (central inference's) gets the snapshot through one pinned buffer and
        one upload, then loads it on the device, instead of one pageable copy per tensor.
        """
        staging = None
        device = next(model.parameters()).device
        if device.type == "cuda":
            if self._pinned is None:
                self._pinned = torch.empty_like(self.buffer).pin_memory()
            staging = self._pinned
        while True:
            seq = int(self.header[0])
            version = int(self.header[1])
            if version == known_version and seq % 2 == 0:
                return known_version
            if seq % 2 == 1:
                time.sleep(0.0005)
                continue
            snapshot = self.buffer.clone() if staging is None else staging.copy_(self.buffer)
            if int(self.header[0]) != seq:
                continue
            if staging is not None:
                snapshot = snapshot.to(device)  # from pinned memory, before the next copy_
            state = {}
            offset = 0
            for key, shape, dtype, n in zip(
                self.keys, self.shapes, self.dtypes, self.numels, strict=True
            ):
                state[key] = snapshot[offset : offset + n].view(shape).to(dtype)
                offset += n
            model.load_state_dict(state)
            return version


def slot_views(store: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Slot ``i`` of ``store`` (``{field: [num_slots, ...]}``): row ``i`` of every field."""
    n_slots = len(next(iter(store.values())))
    return [{k: v[i] for k, v in store.items()} for i in range(n_slots)]


# -- the actor process --------------------------------------------------------------------------
def _actor_main(
    actor_index: int,
    conn: Connection,
    env_factory: Any,
    model_bytes: bytes,
    store: dict[str, torch.Tensor],
    weights: SharedWeights,
    num_envs: int,
    unroll_length: int,
    seed: int,
    inference: tuple[Connection, dict[str, torch.Tensor]] | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner process handles Ctrl-C
    torch.set_num_threads(1)
    try:
        slots = slot_views(store)
        model = pickle.loads(model_bytes)
        acting = None
        if inference is not None:  # central: the learner process acts, no weights here
            infer_conn, requests = inference
            rows = {name: field[actor_index] for name, field in requests.items()}
            acting = CentralActing(infer_conn, rows, model)
        loop = ActorLoop(env_factory, num_envs, model, seed, unroll_length, actor_index, acting)
        if acting is None:
            loop.policy_version = weights.read_into(loop.model, -1)
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if acting is None:
                loop.policy_version = weights.read_into(loop.model, loop.policy_version)
            result = loop.unroll(slots[msg])
            conn.send(("full", msg, result))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the learner is gone or stopping us
    except BaseException as exc:  # report, then exit non-zero
        text = "".join(traceback.format_exception(exc))
        try:
            conn.send(("error", actor_index, f"{type(exc).__name__}: {exc}", text))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)
    finally:
        try:
            loop.close()  # type: ignore[possibly-undefined]
        except Exception:
            pass


def _reap(process: Any, timeout: float) -> int | None:
    """Join ``process`` (killing it if it outlives ``timeout``), release it, return its exit code.

    None means it could not be reaped in time; the caller keeps it to try again.
    A process whose pipe closed may not be reaped yet (forkserver reports exit codes late).
    """
    process.join(timeout=timeout)
    if process.exitcode is None:
        process.kill()
        process.join(timeout=timeout)
    exitcode = process.exitcode
    if exitcode is not None:
        process.close()
    return exitcode


class _Actor:
    """The learner's view of one actor process."""

    def __init__(self, index: int):
        self.index = index
        self.process: Any = None
        self.conn: Connection | None = None
        self.slot: int | None = None  # slot it is filling (a full one waits in the queue)
        self.starts = 0
        self.delivered = 0  # rollouts delivered since the last (re)start


class SubprocessDistributedActors(DistributedActors):
    """``num_actors`` processes, shared-memory slots, a bounded queue and prefetching."""

    def __init__(
        self, *args: Any, runner: Any = None, device: torch.device | str = "cpu", **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.runner = runner
        self.central = getattr(runner, "inference", "actor") == "central"
        self.device = torch.device(device)
        self.servers: list[InferenceProcess] = []  # central: actor i's is servers[i % len]
        self.start_method = getattr(runner, "start_method", "forkserver")
        self.max_restarts = getattr(runner, "max_actor_restarts", 3)
        self.shutdown_timeout_s = getattr(runner, "shutdown_timeout_s", 10.0)
        self.restarts = 0
        self._started = False

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        pickled = {}
        for name, obj in (("env factory", self.env_factory), ("policy", self._template)):
            try:
                pickled[name] = pickle.dumps(obj)
            except Exception as exc:
                raise ActorError(
                    f"the {name} {obj!r} cannot be sent to an actor process "
                    f"({type(exc).__name__}: {exc}); use an importable 'module:callable' "
                    "factory, or runner.backend=sequential"
                ) from None
        if self.start_method == "fork" and threading.active_count() > 1:
            # forking a process with threads can copy a held lock and hang the child
            log.warning(
                "runner.start_method=fork is unsafe with %d threads running in this process; "
                "using forkserver instead",
                threading.active_count(),
            )
            self.start_method = "forkserver"
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if self.start_method != "fork" and main_file and not os.path.exists(main_file):
            raise ActorError(
                f"runner.start_method={self.start_method} actor processes import the main "
                f"module, and {main_file!r} is not a file (a script read from stdin?): save "
                "the script to a file, or use runner.backend=sequential"
            )
        self.ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            start_forkserver()  # a no-op when the trainer has started it already
        probe = self.env_factory()
        spec: RolloutSpec = self.spec(probe.observation_space)
        probe.close()
        # full slots: queued, blocked with their actor, or dropped as stale
        self.queue: RolloutQueue[int] = RolloutQueue(cfg)
        self.max_waiting = self.queue.max_waiting
        n_slots = self.max_waiting + cfg.num_actors + cfg.actors_batch_size
        self._store = spec.allocate(share_memory=True, n_slots=n_slots)
        self.slots = slot_views(self._store)
        self._model_bytes = pickled["policy"]
        self._batch_spec = dataclasses.replace(spec, N=spec.N * cfg.actors_batch_size)
        self.weights = SharedWeights(self._template.state_dict())
        self.weights.publish(self._template.state_dict(), self.policy_version)
        self._free: collections.deque[int] = collections.deque(range(n_slots))
        self._lock = threading.Condition()
        # assembled batches, each with its oldest policy version and the reports it hands out
        self._batches: collections.deque[tuple[CollectedOutputs, int, list[UnrollResult]]] = (
            collections.deque()
        )
        self._in_update = False  # between a hand-out and the next broadcast
        self._error: BaseException | None = None
        self._stopping = False
        self._unreaped: list[Any] = []
        self._assembling = False
        self._learner_device: torch.device | None = None
        self.actors = [_Actor(i) for i in range(cfg.num_actors)]
        self._started = True
        try:
            if self.central:
                self._requests = allocate_requests(spec, cfg.num_actors, spec.N)
                n = getattr(self.runner, "inference_servers", 1)
                for s in range(n):  # each its own sampler seed, apart from the actors'
                    self.servers.append(
                        InferenceProcess(
                            self.ctx,
                            self._template,
                            self._requests,
                            self.device,
                            self.weights,
                            self.seed if s == 0 else actor_seed(self.seed, cfg.num_actors + s),
                            index=s,
                            count=n,
                        )
                    )
            for actor in self.actors:
                self._spawn(actor)
                self._give_slot(actor)
        except BaseException:
            self.stop()
            raise
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="impala-dispatcher", daemon=True
        )
        self._dispatcher.start()

    def _spawn(self, actor: _Actor) -> None:
        cfg = self.cfg
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        inference = infer_child = None
        if self.central:
            infer_parent, infer_child = self.ctx.Pipe(duplex=True)
            inference = (infer_child, self._requests)
        seed = actor_seed(self.seed, actor.index)
        if actor.starts:
            seed = actor_seed(self.seed + 7919 * actor.starts, actor.index)
        process = self.ctx.Process(
            target=_actor_main,
            name=f"impala-actor-{actor.index}",
            args=(
                actor.index,
                child_conn,
                self.env_factory,
                self._model_bytes,
                self._store,
                self.weights,
                cfg.envs_per_actor,
                cfg.n_rollout_steps,
                seed,
                inference,
            ),
            daemon=True,
        )
        process.start()
        child_conn.close()
        if infer_child is not None:
            infer_child.close()
            self._server_of(actor.index).add_actor(actor.index, infer_parent)
        actor.process, actor.conn = process, parent_conn
        actor.delivered = 0
        actor.starts += 1

    def _give_slot(self, actor: _Actor) -> None:
        if actor.slot is None and not self.queue.is_blocked(actor.index) and self._free:
            actor.slot = self._free.popleft()
            try:
                actor.conn.send(actor.slot)  # type: ignore[union-attr]
            except (BrokenPipeError, ConnectionResetError):
                pass  # died since the last wait: its sentinel fires next and reclaims the slot

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.join(timeout=self.shutdown_timeout_s)
        for server in self.servers:
            server.stop()
        for actor in self.actors:
            if actor.conn is not None:
                try:
                    actor.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + self.shutdown_timeout_s
        for actor in self.actors:
            if actor.process is not None:
                actor.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for actor in self.actors:
            if actor.process is not None:
                if actor.process.is_alive():
                    actor.process.terminate()
                self._unreaped.append(actor.process)
            if actor.conn is not None:
                actor.conn.close()
            actor.process = actor.conn = None
        self._unreaped = [p for p in self._unreaped if _reap(p, timeout=2.0) is None]

    def abandon(self) -> None:
        # No lock: a main thread that does not return may hold it. The dispatcher reads the
        # flag at its next round and returns; _on_death restarts nothing once it is set.
        self._stopping = True

    # -- the dispatcher thread ------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    waitables: list[Any] = []
                    owner: dict[Any, tuple[_Actor, int]] = {}
                    for actor in self.actors:
                        if actor.conn is not None:
                            waitables += [actor.conn, actor.process.sentinel]
                            owner[actor.conn] = owner[actor.process.sentinel] = (
                                actor,
                                actor.starts,
                            )
                for ready in wait(waitables, timeout=POLL_S):
                    actor, generation = owner[ready]
                    with self._lock:
                        # Already handled: died (not restarted), or died and restarted while
                        # this round's other entries waited. The replacement's sentinel can
                        # reuse the dead one's fd number, so match generations, not values.
                        if actor.conn is None or actor.starts != generation:
                            continue
                        if ready is actor.conn:
                            self._on_message(actor)
                        elif ready is actor.process.sentinel and not actor.conn.poll():
                            self._on_death(actor)
                self._assemble()
        except BaseException as exc:  # surfaces in collect_outputs
            with self._lock:
                self._error = self._error or exc
                self._lock.notify_all()

    def _on_message(self, actor: _Actor) -> None:
        try:
            msg = actor.conn.recv()  # type: ignore[union-attr]
        except (EOFError, OSError):
            self._on_death(actor)
            return
        if msg[0] == "error":
            _, index, summary, text = msg
            self._error = self._server_failure(of_actor=index) or ActorError(
                f"actor {index} failed: {summary}\n{text}"
            )
            self._lock.notify_all()
            return
        _, slot, result = msg
        result: UnrollResult
        actor.delivered += 1
        actor.slot = None
        if self.queue.put(actor.index, Rollout(slot, self._slot_version(slot), result)):
            self._give_slot(actor)
        self._lock.notify_all()

    def _on_death(self, actor: _Actor) -> None:
        if self._stopping:
            return
        process = actor.process
        exitcode = _reap(process, timeout=5.0)
        if exitcode is None:
            self._unreaped.append(process)  # joined again in stop()
        failed = self._error is not None
        if actor.slot is not None:  # reclaim the slot it was filling
            self._free.append(actor.slot)
            actor.slot = None
        for lost in self.queue.discard_blocked(actor.index):  # neither recorded nor counted
            self._free.append(lost.payload)
        actor.conn.close()
        actor.process = actor.conn = None
        if failed:
            return
        self._error = self._server_failure(of_actor=actor.index)  # its answers are lost
        if self._error is not None:
            self._lock.notify_all()
            return
        if self.restarts >= self.max_restarts:
            self._error = ActorError(
                f"actor {actor.index} died (exit code {exitcode}) and the restart limit "
                f"runner.max_actor_restarts={self.max_restarts} is reached"
                + (
                    ""
                    if actor.delivered
                    else "; it died before its first rollout. If you start training from a "
                    "script, guard it with `if __name__ == '__main__':` (actor processes "
                    "import your main module)"
                )
            )
            self._lock.notify_all()
            return
        log.warning(
            "actor %d died (exit code %s); restarting it (%d of runner.max_actor_restarts=%d)",
            actor.index,
            exitcode,
            self.restarts + 1,
            self.max_restarts,
        )
        self._spawn(actor)
        self._give_slot(actor)
        self.restarts += 1  # counted once the new process runs
        self.events.actor_restarts(1)

    def _assemble(self, in_learner: bool = False) -> None:
        """Copy ``actors_batch_size`` ready slots into a batch while the learner is busy.

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
            taken = [r.payload for r in rollouts]
            oldest = min(r.version for r in rollouts)
            results = [r.result for r in rollouts]
        t0 = time.perf_counter()
        batch = self._batch_spec.allocate(pin_memory=device.type == "cuda")
        n = self._batch_spec.N // self.cfg.actors_batch_size
        for b, slot_index in enumerate(taken):
            block = column_block(batch, b * n, (b + 1) * n)
            for key, src in self.slots[slot_index].items():
                block[key].copy_(src)
        if device.type != "cpu":
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        copy_time = time.perf_counter() - t0
        with self._lock:
            self._assembling = False
            self._free.extend(taken)
            self._unblock()
            dropped = self.queue.take_dropped()
            results += dropped
            out = CollectedOutputs(
                batch,
                queue_before,
                len(self.queue),
                copy_time if in_learner else 0.0,
                sum(r.env_steps for r in results),
                len(dropped),
            )
            self._batches.append((out, oldest, results))
            self._lock.notify_all()

    def _server_failure(self, of_actor: int | None = None) -> ActorError | None:
        """Central inference's error, or that a server's process is gone (None while they
        serve); ``of_actor``: an actor whose failure may be its server's (waited for up to a
        second: the actor can see its pipe break before the server's exit code is there)."""
        serving = None if of_actor is None or not self.servers else self._server_of(of_actor)
        for server in self.servers:
            try:
                server.check(1.0 if server is serving else 0.0)
            except RuntimeError as exc:
                return ActorError(f"central inference: {exc}")
        return None

    def _server_of(self, actor_index: int) -> InferenceProcess:
        return self.servers[actor_index % len(self.servers)]

    def _slot_version(self, slot_index: int) -> int:
        return int(self.slots[slot_index]["policy_version"][0])

    def _drop_stale(self, handout_version: int) -> None:
        """Drop full slots more than ``max_policy_lag`` behind ``handout_version``, free them."""
        for rollout in self.queue.drop_stale(handout_version):
            self._free.append(rollout.payload)
        self._unblock()

    def _unblock(self) -> None:
        """Move blocked full slots into the queue while there is room; re-arm their actors."""
        self.queue.unblock()
        for actor in self.actors:
            if actor.conn is not None:
                self._give_slot(actor)

    # -- the learner's side -----------------------------------------------------------------------
    def broadcast_updated_policy(self, state_dict: dict[str, torch.Tensor]) -> None:
        with self._lock:  # the version before the weights: a rollout is never newer
            self.policy_version += 1
            self._in_update = False
            version = self.policy_version
        self.weights.publish(state_dict, version)  # read by the actors or the server

    def collect_outputs(self, learner_device: torch.device | str) -> CollectedOutputs:
        device = torch.device(learner_device)
        with self._lock:
            self._learner_device = device
            self._in_update = False
        while True:
            with self._lock:
                while not self._batches:
                    if self._error is not None:
                        raise self._error
                    failure = self._server_failure()
                    if failure is not None:
                        raise failure
                    if not self._dispatcher.is_alive():
                        raise ActorError("the dispatcher thread stopped unexpectedly")
                    if len(self.queue) >= self.cfg.actors_batch_size and not self._assembling:
                        break
                    self._lock.wait(timeout=POLL_S)
            if not self._batches:
                self._assemble(in_learner=True)  # data is ready: no need to wait for the thread
            t_pop = time.perf_counter()
            with self._lock:
                if not self._batches:
                    continue  # stale slots were dropped: wait for fresh ones
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
