"""Actor processes writing into preallocated shared-memory slots: the fast default.

Layout
------
- ``num_slots = max_waiting + num_actors + actors_batch_size`` slots (dicts of shared
  tensors, ``[T+1, N, ...]``; uint8 stays uint8), created once. Only slot *indices* travel.
  Each field is one shared tensor ``[num_slots, ...]`` whose rows are the slots, and the policy
  travels pickled by value: an actor process receives a file descriptor per field and two for
  the weights, however many slots or parameters (the forkserver passes fewer than 256).
- Each actor owns one pipe to the learner process. The supervisor's dispatcher thread
  (:class:`impala_rl.actors.supervisor.ActorSupervisor`: the queue and its bound, stale drops,
  prefetch, restarts, errors and the collect loop are its) hands an actor a free slot index;
  the actor fills it (one unroll) and sends the index back with its episode statistics. A full
  slot waits in the queue, or blocked with its actor, until it is copied into a batch or
  dropped; then it is free again.
- Dead actors are noticed at once (process sentinels); their slot is reclaimed before the
  supervisor restarts them.
- Weights: one shared flat float buffer plus a header ``[seqlock, version]``. The learner
  writes under the seqlock; actors copy a consistent snapshot between unrolls only.
- With ``runner.inference=central`` the actors hold no weights: each has a second pipe, to
  its inference server's process (:mod:`impala_rl.actors.inference`; actor ``i`` to server
  ``i % runner.inference_servers``), which reads the same weight buffer between batches of
  requests. With ``runner.env_splits=K`` an actor's envs are K groups taking turns, each with
  a pipe and a request row of its own (``i * K + g``, served by server ``(i * K + g) %
  runner.inference_servers``). The server's end of a restarted actor's new pipe is handed to
  it over its control pipe; a server failing ends training with its error.
  ``runner.inference=learner``: one server, a thread of the learner's process, whose weights
  the learner's broadcasts copy on the device (no shared buffer written).

Shared memory comes from torch's file-descriptor strategy, so nothing is left under
``/dev/shm`` even when a process is killed.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing  # noqa: F401  (registers shared-tensor pickling)

from impala_rl.actors.base import ActorError, actor_seed
from impala_rl.actors.inference import (
    CentralActing,
    InferenceProcess,
    InferenceThread,
    allocate_requests,
)
from impala_rl.actors.rollout_queue import Rollout
from impala_rl.actors.supervisor import (
    DEATH,
    ERROR,
    READY,
    ROLLOUT,
    Actor,
    ActorEvent,
    ActorSupervisor,
)
from impala_rl.child_processes import leave_stopping_to_parent, preload_forkserver, start_child
from impala_rl.distributed import main_file_missing
from impala_rl.group_signals import hangup_blocked
from impala_rl.helper_processes import stop_helper_processes_quietly
from impala_rl.rollout import ActorLoop, ActorSplits, RolloutSpec

log = logging.getLogger(__name__)


def start_forkserver() -> None:
    """Start the forkserver (it imports torch and the actor loop once, ~1.5 s, for every actor
    it forks); called early by the trainer, so that this runs on another core while the
    learner is built."""
    preload_forkserver("impala_rl.rollout")
    with hangup_blocked():  # it ignores SIGHUP once its preload runs; the tracker never does
        forkserver.ensure_running()
    # A script that trains through the library returns with no `impala` command to stop them:
    # at its exit, after multiprocessing has joined its children (priority below 0), the
    # helpers are stopped and joined too. One finalizer however many runs; the CLI's own stop
    # leaves it a no-op.
    global _helpers_stopped_at_exit
    if not _helpers_stopped_at_exit:
        mp_util.Finalize(None, stop_helper_processes_quietly, exitpriority=-100)
        _helpers_stopped_at_exit = True


_helpers_stopped_at_exit = False


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
    inference: tuple[list[Connection], dict[str, torch.Tensor]] | None = None,
) -> None:
    """One actor process. ``inference`` (central): a pipe to the server per env group
    (``runner.env_splits``), group ``g`` writing request row ``actor_index * groups + g``."""
    leave_stopping_to_parent()  # the learner handles Ctrl-C and SIGTERM, then stops this
    torch.set_num_threads(1)
    try:
        slots = slot_views(store)
        model = pickle.loads(model_bytes)
        if inference is None:
            loops = [ActorLoop(env_factory, num_envs, model, seed, unroll_length, actor_index)]
            loops[0].policy_version = weights.read_into(model, -1)
        else:  # central: the server processes act, no weights here
            infer_conns, requests = inference
            groups, loops = len(infer_conns), []
            n = num_envs // groups
            for g, infer_conn in enumerate(infer_conns):
                rows = {name: field[actor_index * groups + g] for name, field in requests.items()}
                acting = CentralActing(infer_conn, rows, model)
                # env i of group g is env g * n + i of the ungrouped actor: the same seed
                loops.append(
                    ActorLoop(
                        env_factory, n, model, seed + g * n, unroll_length, actor_index, acting
                    )
                )
        loop = ActorSplits(loops)
        conn.send(("ready",))  # its envs and policy are built: it came up
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if inference is None:
                loops[0].policy_version = weights.read_into(model, loops[0].policy_version)
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


class _Actor(Actor):
    """The learner's view of one actor process."""

    def __init__(self, index: int):
        super().__init__(index)
        self.process: Any = None
        self.conn: Connection | None = None
        self.slot: int | None = None  # slot it is filling (a full one waits in the queue)


class SubprocessDistributedActors(ActorSupervisor[_Actor, int]):
    """``num_actors`` processes filling shared-memory slots: the transport of the supervisor."""

    def __init__(
        self, *args: Any, runner: Any = None, device: torch.device | str = "cpu", **kwargs: Any
    ):
        super().__init__(*args, runner=runner, **kwargs)
        place = getattr(runner, "inference", "actor")
        self.central = place in ("central", "learner")
        self.in_learner = place == "learner"  # the server a thread of this process
        self._splits = getattr(runner, "env_splits", 1) if self.central else 1
        if self.cfg.envs_per_actor % self._splits:
            raise ActorError(
                f"runner.env_splits must divide algorithm.envs_per_actor="
                f"{self.cfg.envs_per_actor}, got {self._splits}"
            )
        self.device = torch.device(device)
        # central: actor i's is servers[i % len]
        self.servers: list[InferenceProcess | InferenceThread] = []
        self.start_method = getattr(runner, "start_method", "forkserver")
        self._unreaped: list[Any] = []

    # -- life cycle ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        pickled = {}
        # the factory goes as a process argument; the policy as bytes, by value where its
        # classes are a notebook's (cloudpickle: an interactive main module has no file)
        for name, obj, dumps in (
            ("env factory", self.env_factory, pickle.dumps),
            ("policy", self._template, cloudpickle.dumps),
        ):
            try:
                pickled[name] = dumps(obj)
            except Exception as exc:
                raise ActorError(
                    f"the {name} {obj!r} cannot be sent to an actor process "
                    f"({type(exc).__name__}: {exc}); use an importable 'module:callable' "
                    "factory, or runner.backend=sequential"
                ) from None
        self._model_bytes = pickled["policy"]
        if self.start_method == "fork" and threading.active_count() > 1:
            # forking a process with threads can copy a held lock and hang the child
            log.warning(
                "runner.start_method=fork is unsafe with %d threads running in this process; "
                "using forkserver instead",
                threading.active_count(),
            )
            self.start_method = "forkserver"
        main_file = main_file_missing()
        if self.start_method != "fork" and main_file:
            raise ActorError(
                f"runner.start_method={self.start_method} actor processes import the main "
                f"module, and {main_file!r} is not a file (a script read from stdin?): save "
                "the script to a file, or use runner.backend=sequential"
            )
        self.ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            start_forkserver()  # a no-op when the trainer has started it already

    def _open(self, spec: RolloutSpec) -> None:
        cfg = self.cfg
        # full slots: queued, blocked with their actor, or dropped as stale
        n_slots = self.max_waiting + cfg.num_actors + cfg.actors_batch_size
        self._store = spec.allocate(share_memory=True, n_slots=n_slots)
        self.slots = slot_views(self._store)
        self.weights = SharedWeights(self._template.state_dict())
        self.weights.publish(self._template.state_dict(), self.policy_version)
        self._free: collections.deque[int] = collections.deque(range(n_slots))
        if self.central:
            # a row per env group of each actor (runner.env_splits)
            clients = cfg.num_actors * self._splits
            self._requests = allocate_requests(spec, clients, spec.N // self._splits)
            if self.in_learner:  # the learner's broadcasts load its weights (_publish)
                self.servers.append(
                    InferenceThread(
                        self._template, self._requests, self.device, self.seed, self.policy_version
                    )
                )
            else:
                self._start_server_processes(getattr(self.runner, "inference_servers", 1))

    def _start_server_processes(self, n: int) -> None:
        """``runner.inference=central``'s ``n`` server processes, each its own sampler seed,
        apart from the actors'."""
        for s in range(n):
            self.servers.append(
                InferenceProcess(
                    self.ctx,
                    self._template,
                    self._requests,
                    self.device,
                    self.weights,
                    self.seed if s == 0 else actor_seed(self.seed, self.cfg.num_actors + s),
                    index=s,
                    count=n,
                )
            )

    def _new_actor(self, index: int) -> _Actor:
        return _Actor(index)

    def _spawn(self, actor: _Actor, seed: int) -> None:
        cfg = self.cfg
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        inference = None
        pipes: list[tuple[Connection, Connection]] = []
        if self.central:  # a pipe per env group, group g's row and server: client index
            pipes = [self.ctx.Pipe(duplex=True) for _ in range(self._splits)]
            inference = ([child for _, child in pipes], self._requests)
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
        start_child(process)
        child_conn.close()
        for g, (infer_parent, infer_child) in enumerate(pipes):
            infer_child.close()
            client = actor.index * self._splits + g
            self._server_of(client).add_actor(client, infer_parent)
        actor.process, actor.conn = process, parent_conn

    def _give_work(self, actor: _Actor) -> None:
        if actor.slot is None and self._free:
            actor.slot = self._free.popleft()
            try:
                actor.conn.send(actor.slot)  # type: ignore[union-attr]
            except (BrokenPipeError, ConnectionResetError):
                pass  # died since the last wait: its sentinel fires next and reclaims the slot

    def _alive(self, actor: _Actor) -> bool:
        return actor.conn is not None

    def _close(self) -> None:
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
                    actor.process.kill()  # a SIGTERM would be taken as notice
                self._unreaped.append(actor.process)
            if actor.conn is not None:
                actor.conn.close()
            actor.process = actor.conn = None
        self._unreaped = [p for p in self._unreaped if _reap(p, timeout=2.0) is None]

    # -- the dispatcher's side -----------------------------------------------------------------
    def _waitables(self) -> dict[Any, tuple[_Actor, int]]:
        owner: dict[Any, tuple[_Actor, int]] = {}
        for actor in self.actors:
            if actor.conn is not None:
                owner[actor.conn] = owner[actor.process.sentinel] = (actor, actor.starts)
        return owner

    def _events(
        self, waitables: dict[Any, tuple[_Actor, int]], timeout: float
    ) -> Iterator[ActorEvent[int]]:
        for ready in wait(list(waitables), timeout=timeout):
            actor, generation = waitables[ready]
            # the actor is the dispatcher's own: it may have died and been restarted meanwhile
            if actor.conn is None or actor.starts != generation:
                continue
            if ready is actor.conn:
                try:
                    msg = actor.conn.recv()
                except (EOFError, OSError):
                    yield ActorEvent(actor, generation, DEATH)
                    continue
                if msg[0] == "ready":
                    yield ActorEvent(actor, generation, READY)
                    continue
                if msg[0] == "error":
                    _, index, summary, text = msg
                    error = ActorError(f"actor {index} failed: {summary}\n{text}")
                    yield ActorEvent(actor, generation, ERROR, error=error)
                    continue
                _, slot, result = msg
                version = int(self.slots[slot]["policy_version"][0])
                yield ActorEvent(actor, generation, ROLLOUT, Rollout(slot, version, result))
            elif ready is actor.process.sentinel and not actor.conn.poll():
                yield ActorEvent(actor, generation, DEATH)

    def _accept(self, actor: _Actor, event: ActorEvent[int]) -> bool:
        if event.kind == ROLLOUT:
            actor.slot = None
        return True

    def _bury(self, actor: _Actor, cause: str) -> str:
        process = actor.process
        exitcode = _reap(process, timeout=5.0)
        if exitcode is None:
            self._unreaped.append(process)  # joined again in stop()
        if actor.slot is not None:  # reclaim the slot it was filling
            self._free.append(actor.slot)
            actor.slot = None
        actor.conn.close()  # type: ignore[union-attr]
        actor.process = actor.conn = None
        return f"exit code {exitcode}"

    def _death_hint(self, actor: _Actor) -> str:
        if actor.delivered:
            return ""
        return (
            "; it died before its first rollout. If you start training from a script, guard "
            "it with `if __name__ == '__main__':` (actor processes import your main module)"
        )

    def _release(self, payload: int) -> None:
        self._free.append(payload)

    def _copy_rollout(self, block: dict[str, torch.Tensor], payload: int) -> None:
        for key, src in self.slots[payload].items():
            block[key].copy_(src)

    def _publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.in_learner:  # copied on the device, no shared memory: the actors hold none
            for server in self.servers:
                server.load(state_dict, version)  # type: ignore[union-attr]
            return
        self.weights.publish(state_dict, version)  # read by the actors or the server

    def _failure(self, actor: _Actor | None = None) -> ActorError | None:
        """Central inference's error, or that a server's process is gone (None while they
        serve); ``actor``: one whose failure may be its server's (waited for up to a second:
        the actor can see its pipe break before the server's exit code is there)."""
        serving = []  # the servers of the actor's env groups
        if actor is not None and self.servers:
            first = actor.index * self._splits
            serving = [self._server_of(c) for c in range(first, first + self._splits)]
        for server in self.servers:
            try:
                server.check(1.0 if server in serving else 0.0)
            except RuntimeError as exc:
                return ActorError(f"central inference: {exc}")
        return None

    def _server_of(self, client: int) -> InferenceProcess | InferenceThread:
        """The server of request row ``client`` (actor ``i``'s env group ``g``: ``i *
        runner.env_splits + g``)."""
        return self.servers[client % len(self.servers)]
