"""Several learners: one ``torch.distributed`` group of data-parallel learner processes.

Every learner takes its own batches from its own actors; before each optimizer step the
gradients are averaged across the group (one all-reduce of a flat buffer), so every learner
takes the same step and holds the same weights. The statistics the update moves besides the
weights (``normalize_obs``'s running moments, PopArt's) are merged over every learner's rows,
so they stay identical too. Learner 0 (the *leader*, the process the user started) owns the
rendezvous (a ``TCPStore``), starts the others (:func:`start_peer_learners`: processes on
one machine, Ray actors on a cluster), evaluates, writes events and checkpoints, and
decides when the run stops; the others follow its decisions through :class:`LearnerGroup`.

Gradients travel with NCCL when every learner has a GPU of its own, else with gloo (learners
sharing one GPU copy the flat buffer to the host): the leader decides from every learner's
device (host and GPU UUID) and tells the others, so the group never splits between the two.
Control messages always use gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from impala_rl.child_processes import end_learners, ended_by_second_sigterm
from impala_rl.group_signals import hangup_blocked

log = logging.getLogger(__name__)

# Collectives wait this long for a peer (the first one waits for every learner to build its
# model and start its actors); a learner that exits fails the next collective at once.
GROUP_TIMEOUT_S = 600.0
ERROR_KEY = "impala_rl/learner_error/{rank}"
JOINED_KEY = "impala_rl/joined/{rank}"


class LearnerGroupError(RuntimeError):
    """A learner of the group failed (it exited, or its connection broke)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the leader's store listens, and the group's size."""

    host: str
    port: int
    world_size: int


DEVICE_KEY = "impala_rl/device/{rank}"
BACKEND_KEY = "impala_rl/backend"


def device_identity(device: torch.device) -> str:
    """The physical device a learner trains on, comparable across processes and nodes: the
    host and, for a GPU, its UUID (a Ray learner sees its GPU as ``cuda:0`` whichever it is)."""
    host = socket.gethostname()
    if device.type != "cuda":
        return f"{device.type}|{host}"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda|{host}|{uuid if uuid is not None else index}"


def choose_backend(identities: Sequence[str]) -> tuple[str, str]:
    """The gradients' backend for learners on these devices (:func:`device_identity`, in rank
    order) and why: ``nccl`` when every learner trains on a GPU of its own, else ``gloo``
    (NCCL refuses two ranks on one GPU)."""
    if not all(i.startswith("cuda|") for i in identities):
        return "gloo", "not every learner is on a GPU"
    if len(set(identities)) < len(identities):
        shared = sorted({i.split("|", 2)[2] for i in identities if identities.count(i) > 1})
        return "gloo", f"learners share a GPU ({', '.join(shared)}): gradients go through the host"
    if not dist.is_nccl_available():
        return "gloo", "this torch has no NCCL"
    return "nccl", "every learner has a GPU of its own"


def agree_backend(store: dist.TCPStore, rank: int, world_size: int, device: torch.device) -> str:
    """The backend the leader chose from every learner's device, the same on every learner:
    each decided alone before, and a leader that saw all of its node's GPUs picked NCCL while
    its Ray peers, each seeing one, picked gloo, and the group hung."""
    store.set(DEVICE_KEY.format(rank=rank), device_identity(device))
    if rank != 0:
        return store.get(BACKEND_KEY).decode()
    keys = [DEVICE_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys)
    backend, why = choose_backend([store.get(k).decode() for k in keys])
    (log.info if backend == "nccl" or why.startswith("not") else log.warning)(
        "learner group: %s (%s)", backend, why
    )
    store.set(BACKEND_KEY, backend)
    return backend


def learner_device(device: torch.device, rank: int) -> torch.device:
    """Learner ``rank``'s device: ``cuda`` (no index) becomes ``cuda:rank`` modulo the GPUs
    this process sees (learners share GPUs when there are fewer); other devices as given."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def make_store(host: str, world_size: int) -> dist.TCPStore:
    """The leader's rendezvous store on a free port (``store.port``)."""
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    return dist.TCPStore(host, 0, world_size, True, timeout, wait_for_workers=False)


def report_error(rendezvous: Rendezvous, rank: int, message: str) -> None:
    """Leave learner ``rank``'s error in the leader's store for the leader to name (best
    effort: the leader may be gone)."""
    try:
        timeout = datetime.timedelta(seconds=5)
        store = dist.TCPStore(
            rendezvous.host, rendezvous.port, rendezvous.world_size, False, timeout
        )
        store.set(ERROR_KEY.format(rank=rank), message[:2000])
    except Exception:
        pass


class LearnerGroup:
    """One learner's handle on the group: gradient averaging, merged statistics, the
    leader's decisions. ``rank`` 0 is the leader; ``store`` is the leader's own store (the
    others connect to ``rendezvous``)."""

    def __init__(
        self,
        rank: int,
        rendezvous: Rendezvous,
        device: torch.device,
        store: dist.TCPStore | None = None,
        describe_failure: Callable[[], str | None] | None = None,
    ):
        self.rank, self.world_size = rank, rendezvous.world_size
        self.device = device
        self._describe_failure = describe_failure
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        if store is None:
            store = self._collective(
                lambda: dist.TCPStore(
                    rendezvous.host, rendezvous.port, rendezvous.world_size, False, timeout
                ),
            )
            store.set(JOINED_KEY.format(rank=rank), "1")
        self.store = store
        self.backend = self._collective(lambda: agree_backend(store, rank, self.world_size, device))
        if self.backend == "nccl":
            torch.cuda.set_device(device)
        self._collective(
            lambda: dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=self.world_size, timeout=timeout
            ),
        )
        # Control messages (stop flags, events, decisions) stay on the host.
        self._control = (
            self._collective(lambda: dist.new_group(backend="gloo"))
            if self.backend == "nccl"
            else None
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives ---------------------------------------------------------------------------
    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run a collective (or a step of forming the group); a broken group becomes a
        :class:`LearnerGroupError` that names the learner that failed, where the leader can
        tell, else torch's message: its first line (the C++ frames under it are for torch)."""
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as exc:
            detail = self._describe_failure() if self._describe_failure else None
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise LearnerGroupError(
                detail or f"learner {self.rank}: the learner group broke ({reason})"
            ) from exc

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the learners in place (through the host for gloo on a GPU)."""
        if t.is_cuda and self.backend == "gloo":
            host = t.cpu()
            self._collective(lambda: dist.all_reduce(host))
            t.copy_(host)
        else:
            self._collective(lambda: dist.all_reduce(t))
        return t

    def average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace every gradient with its mean over the learners, in one all-reduce.

        A parameter without a gradient on this learner (a step key absent from its batch)
        counts as zero; it keeps no gradient only where no learner has one, so every learner
        gives the optimizer the same parameters."""
        if not params:
            return
        device = params[0].device
        flat = torch.cat(
            [
                p.grad.reshape(-1).float() if p.grad is not None else p.new_zeros(p.numel())
                for p in params
            ]
            + [torch.tensor([float(p.grad is not None) for p in params], device=device)]
        )
        self._all_reduce(flat)
        has_grad = flat[flat.numel() - len(params) :].tolist()
        flat[: flat.numel() - len(params)].div_(self.world_size)
        offset = 0
        for p, anyone in zip(params, has_grad, strict=True):
            if anyone > 0:
                grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = grad.clone()
                else:
                    p.grad.copy_(grad)
            offset += p.numel()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the learners (a new tensor)."""
        return self._all_reduce(t.clone())

    def combine_moments(
        self, n: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count, mean and population variance of every learner's rows together, from each
        learner's own (Chan et al.'s pairwise merge, in rank order, so all learners agree)."""
        local = torch.cat([n.reshape(1).to(mean), mean.reshape(-1), var.reshape(-1)])
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        if local.is_cuda and self.backend == "gloo":
            host = [g.cpu() for g in gathered]
            self._collective(lambda: dist.all_gather(host, local.cpu()))
            gathered = [h.to(local.device) for h in host]
        else:
            self._collective(lambda: dist.all_gather(gathered, local))
        size = mean.numel()
        total_n = torch.zeros((), dtype=local.dtype, device=local.device)
        total_mean = torch.zeros_like(mean.reshape(-1))
        total_m2 = torch.zeros_like(mean.reshape(-1))
        for g in gathered:
            gn, gmean, gvar = g[0], g[1 : 1 + size], g[1 + size :]
            if gn <= 0:
                continue
            both = total_n + gn
            delta = gmean - total_mean
            total_m2 = total_m2 + gvar * gn + delta.pow(2) * total_n * gn / both
            total_mean = total_mean + delta * gn / both
            total_n = both
        var_out = total_m2 / total_n if total_n > 0 else torch.zeros_like(total_m2)
        return total_n, total_mean.view_as(mean), var_out.view_as(var)

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Every tensor of ``module``'s state (weights and buffers) from the leader."""
        for t in module.state_dict().values():
            self._broadcast_tensor(t)

    def _broadcast_tensor(self, t: torch.Tensor) -> None:
        if t.is_cuda and self.backend == "gloo":
            host = t.cpu()
            self._collective(lambda: dist.broadcast(host, src=0))
            t.copy_(host)
        else:
            self._collective(lambda: dist.broadcast(t, src=0))

    def leader_decides(self, value: Any) -> Any:
        """The leader's ``value`` on every learner (others pass anything)."""
        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self._control))
        return box[0]

    def gather_to_leader(self, value: Any) -> list[Any] | None:
        """Every learner's ``value`` in rank order on the leader; ``None`` elsewhere."""
        out: list[Any] | None = [None] * self.world_size if self.is_leader else None
        self._collective(lambda: dist.gather_object(value, out, dst=0, group=self._control))
        return out

    def control_sum(self, values: Sequence[float]) -> list[float]:
        """Small per-update numbers (env steps, the leader's stop flags) summed on the host."""
        t = torch.tensor(list(values), dtype=torch.float64)
        self._collective(lambda: dist.all_reduce(t, group=self._control))
        return t.tolist()


# -- starting the other learners ------------------------------------------------------------------


GUARD = "if __name__ == '__main__':"


def _main_file() -> str:
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return f" ({path})" if path else ""


def main_file_missing() -> str | None:
    """The main module's path when it names no file (a script read from stdin), else None: a
    process started with ``spawn`` or ``forkserver`` imports the main module from its file and
    would fail there, so whoever starts one refuses first."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if path and not os.path.exists(path) else None


def check_not_importing_main() -> None:
    """Refuse to start a run in a process that ``multiprocessing`` is still starting.

    A process started with ``spawn`` or ``forkserver`` (a further learner, subprocess actors,
    central inference servers) first imports the main module; a script that calls
    ``impala_rl.train`` at module level would start another run there (another learner group,
    run directory, actors). This says what to do instead, before anything is built.
    """
    if getattr(mp.current_process(), "_inheriting", False):  # as multiprocessing's own check
        raise RuntimeError(
            f"impala_rl.train was called while a process started by the run imported the main "
            f"module{_main_file()}: a script that trains must call it under `{GUARD}`"
        )


def _run_learner_process(started: Any, target: Callable[..., None], args: tuple) -> None:
    """A further learner's process, past its start-up (the main module imported, the
    arguments unpickled): says so through ``started`` (a pipe's end), then runs the learner."""
    started.send_bytes(b"1")
    started.close()
    target(*args)


def _has_started(conn: Any) -> bool:
    """Whether a learner process wrote to its ``started`` pipe (EOF alone: it never did)."""
    try:
        return bool(conn.poll(0) and conn.recv_bytes())
    except (EOFError, OSError):
        return False


class PeerLearners:
    """The learners the leader started (ranks 1..N-1): liveness, failures, shutdown.

    ``started`` (processes only): per learner, the reading end of a pipe its process writes to
    once it runs the learner; one that exits without writing ended while importing the main
    module."""

    def __init__(self, handles: list[Any], kind: str, started: list[Any] | None = None):
        self.handles, self.kind = handles, kind
        self.started = started
        self._ran: set[int] = set()

    def exited(self) -> list[tuple[int, str]]:
        """``(rank, how)`` for every learner that is no longer running."""
        out = []
        for rank, h in enumerate(self.handles, start=1):
            if self.kind == "process":
                if h.exitcode is not None:
                    out.append((rank, f"pid {h.pid} exited with code {h.exitcode}"))
            else:
                import ray

                ready, _ = ray.wait([h[1]], timeout=0)
                if ready:
                    try:
                        ray.get(ready[0])
                        out.append((rank, "its Ray actor returned early"))
                    except Exception as exc:  # the actor died or raised
                        out.append((rank, f"its Ray actor failed: {type(exc).__name__}"))
        return out

    def wait_joined(self, store: dist.TCPStore, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Wait until every learner has reached the rendezvous; a learner that fails on its
        way there (a bad env, no GPU) stops the wait with its error instead of a timeout."""
        keys = [JOINED_KEY.format(rank=r) for r in range(1, len(self.handles) + 1)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if self.exited():
                raise LearnerGroupError(self.describe_failure(store) or "a learner exited")
            if time.monotonic() > deadline:
                raise LearnerGroupError(f"the learners did not start within {timeout_s:g} s")
            time.sleep(0.05)

    def describe_failure(self, store: dist.TCPStore, wait_s: float = 10.0) -> str | None:
        """Which learners exited, and the error each left in the store (``None`` if every
        learner still runs after ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while not (exited := self.exited()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not exited:
            return None
        parts = []
        for rank, how in exited:
            key, error = ERROR_KEY.format(rank=rank), None
            try:
                if store.check([key]):
                    error = store.get(key).decode(errors="replace")
            except Exception:
                pass
            if error is None and self._ended_while_starting(rank):
                error = (
                    "it ended while starting, before it ran: a learner process imports the "
                    f"main module{_main_file()} first, so a script that calls impala_rl.train "
                    f"must call it under `{GUARD}`"
                )
            parts.append(f"learner {rank} ({how}): {error or 'no error reported (killed?)'}")
        return "; ".join(parts)

    def _ended_while_starting(self, rank: int) -> bool:
        """Whether learner ``rank``'s process exited with an error before it ran the learner
        (not killed by a signal: its exit code is > 0)."""
        if self.kind != "process" or self.started is None:
            return False
        if rank not in self._ran and _has_started(self.started[rank - 1]):
            self._ran.add(rank)
        exitcode = self.handles[rank - 1].exitcode
        return exitcode is not None and exitcode > 0 and rank not in self._ran

    def join(self, timeout_s: float) -> None:
        """Wait for every learner to finish its run; stop those still running after
        ``timeout_s`` (SIGTERM twice, the first being notice, then kill), so that none is
        left."""
        deadline = time.monotonic() + timeout_s
        if self.kind == "process":
            for h in self.handles:
                h.join(max(0.0, deadline - time.monotonic()))
            end_learners([h for h in self.handles if h.is_alive()])
            return
        import ray

        refs = [ref for _, ref in self.handles]
        ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        for actor, _ in self.handles:
            try:
                ray.kill(actor)
            except Exception:
                pass


def start_peer_learners(
    target: Callable[..., None],
    args_of: Callable[[int], tuple],
    world_size: int,
    on_ray: bool = False,
    ray_num_gpus: float = 0.0,
    ray_num_cpus: float = 1.0,
) -> PeerLearners:
    """Start learners 1..world_size-1 running ``target(*args_of(rank))``: processes on this
    machine (spawned: a learner starts its own actor processes), or Ray actors placed with
    their GPUs on the running Ray cluster."""
    if on_ray:
        import ray

        remote = ray.remote(num_cpus=ray_num_cpus, num_gpus=ray_num_gpus, max_restarts=0)(
            _RayLearner
        )
        handles = []
        for rank in range(1, world_size):
            actor = remote.remote()
            handles.append((actor, actor.run.remote(target, args_of(rank))))
        return PeerLearners(handles, "ray")
    ctx = mp.get_context("spawn")
    procs, started = [], []
    for rank in range(1, world_size):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_run_learner_process,
            args=(writer, target, args_of(rank)),
            name=f"impala-learner-{rank}",
        )
        with hangup_blocked():  # until it ignores SIGHUP (the leader's, as Ctrl-C)
            ended_by_second_sigterm(p).start()
        writer.close()  # the learner's end: its exit closes the pipe
        procs.append(p)
        started.append(reader)
    return PeerLearners(procs, "process", started)


def ray_gpu_id(device: torch.device) -> str:
    """Ray's id of the GPU ``device`` names in this process (``CUDA_VISIBLE_DEVICES``
    renumbers them)."""
    index = device.index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids):
            return ids[index]
    return str(index)


class LeaderGpuHold:
    """The leader's GPU held by a placeholder Ray actor on the leader's node, so that Ray
    places the further learners (and GPU actors) on other GPUs: the leader is the driver
    process, whose GPU Ray does not count. Placeholders are asked for one after another
    until one holds that GPU (Ray hands out whichever is free); the others are released.
    Where none can (the node's GPUs are taken), the run goes on unreserved and the group's
    backend falls back to gloo if a learner lands on the leader's GPU."""

    def __init__(self, device: torch.device, num_gpus: float, wait_s: float = 30.0):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.gpu_id = ray_gpu_id(device)
        self.holder: Any = None
        placeholder = ray.remote(num_cpus=0, num_gpus=num_gpus)(_GpuPlaceholder)
        node = ray.get_runtime_context().get_node_id()
        here = NodeAffinitySchedulingStrategy(node, soft=False)
        spare = []
        try:
            for _ in range(max(1, int(ray.cluster_resources().get("GPU", 1)))):
                actor = placeholder.options(scheduling_strategy=here).remote()
                try:
                    ids = ray.get(actor.gpu_ids.remote(), timeout=wait_s)
                except Exception:  # no GPU left on this node: it would wait forever
                    ray.kill(actor)
                    break
                if self.gpu_id in ids:
                    self.holder = actor
                    break
                spare.append(actor)
        finally:
            for actor in spare:
                ray.kill(actor)
        if self.holder is None:
            log.warning(
                "could not reserve the leader's GPU %s on Ray: a further learner may share it",
                self.gpu_id,
            )

    def release(self) -> None:
        if self.holder is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(self.holder)
            self.holder = None


class _GpuPlaceholder:
    """Holds the GPUs Ray gave it until it is killed."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


class _RayLearner:
    """A Ray actor that runs one learner."""

    def run(self, target: Callable[..., None], args: tuple) -> None:
        target(*args)
