"""Central inference (``runner.inference=central``): actors step envs, server processes act.

Each actor process owns a row of every request and response field below (shared tensors
``[num_actors, M, ...]``, ``M = envs_per_actor * n_agents``: the most decisions one call
carries) and one pipe to the :class:`InferenceServer`, which runs in a process of its own
(:class:`InferenceProcess`; a thread of the learner process would share its interpreter lock
with the learner's update, and each would wait for the other at every switch). An
actor's :class:`CentralActing` writes a group's observations (and its first flags, core state
and last inputs when the model reads them) into its rows, sends ``(kind, step_key, n)`` and
waits; the server gathers every waiting actor's request, runs the policy once per
``(kind, step key)`` on its device, samples, writes actions and log-probs (or values) back
into the rows and answers each actor with the version of the weights it used (with
``runner.inference_servers`` above 1, each server does this for its share of the actors, on
the same fields and weights). The actor
stamps the oldest version of an unroll on its slot, so V-trace's behaviour policy and
``max_policy_lag`` refer to the weights that acted.

The LSTM state travels with each request and stays with the actor (its decision streams
carry it as with actor-side inference), so a restarted actor or server loses nothing. The
server's weights are its own copy on the device; the learner publishes them after every
update into the shared flat buffer that actor-side inference reads (``SharedWeights``), and
the server loads a newer version between two batches of requests. Actors need no weights.

``runner.inference=learner`` runs the same server as a thread of the learner's process
(:class:`InferenceThread`): one CUDA context instead of two taking turns on the GPU, and the
learner's weights copied on the device at each broadcast (:meth:`InferenceServer.load`)
instead of through shared memory. The price is the interpreter lock the thread shares with the
learner's update, which a captured update (one graph replay a step) mostly leaves free.

==================  ===================  ===================================================
field               shape (per actor)    meaning
==================  ===================  ===================================================
``obs`` (``_{k}``)  ``[M, *o_k]``        the deciding agents' observations (request)
``action_mask``     ``[M, n_k]``         their legal actions (keys with a mask)
``first``           ``[M]``              an agent's first decision of an episode (a core)
``core_h/_c``       ``[M, H]``           the core state before the decision; after it, in
                                         the response
``last_inputs``     ``[M, E]``           the agents' last action and reward, encoded
``action`` (``_k``) ``[M, *a_k]``        the sampled action (response)
``log_prob``        ``[M]``              its log-probability under the server's policy
``value``           ``[M]``              a ``value`` request's answer
==================  ===================  ===================================================
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import pickle
import threading
import time
import traceback
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch

from impala_rl.child_processes import leave_stopping_to_parent, start_child
from impala_rl.nn import Acted, Model
from impala_rl.nn.observations import any_tensor, read_obs, write_obs
from impala_rl.rollout import RolloutSpec, rollout_spec_for

POLL_S = 0.05
log = logging.getLogger(__name__)


def allocate_requests(spec: RolloutSpec, num_actors: int, rows: int) -> dict[str, torch.Tensor]:
    """The shared request and response fields of ``num_actors`` actors, ``rows`` each, laid
    out as ``spec``'s step keys (one tensor per field, so a process receives a fixed number
    of file descriptors)."""
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for k, key in enumerate(spec.keys):
        for name, (shape, dtype) in key.obs_fields(spec.key_field("obs", k)).items():
            fields[name] = ((rows, *shape), dtype)
        fields[spec.key_field("action", k)] = ((rows, *key.action_shape), key.action_dtype)
        if key.mask_size is not None:
            fields[spec.key_field("action_mask", k)] = ((rows, key.mask_size), torch.bool)
    fields["first"] = ((rows,), torch.bool)
    fields["log_prob"] = ((rows,), torch.float32)
    fields["value"] = ((rows,), torch.float32)
    if spec.core_state_size:
        for name in ("core_h", "core_c"):
            fields[name] = ((rows, spec.core_state_size), torch.float32)
    if spec.last_inputs_size:
        fields["last_inputs"] = ((rows, spec.last_inputs_size), torch.float32)
    return {
        name: torch.zeros((num_actors, *shape), dtype=dtype).share_memory_()
        for name, (shape, dtype) in fields.items()
    }


class CentralActing:
    """An actor's side of central inference: the actor loop's ``acting`` (see
    :class:`impala_rl.decisions.LocalActing`). ``buffers`` are this actor's rows of
    :func:`allocate_requests`; ``model`` is used only for ``to_env`` (its weights are never
    read)."""

    def __init__(self, conn: Connection, buffers: dict[str, torch.Tensor], model: Model):
        self.conn = conn
        self.buffers = buffers
        self.model = model
        self.key_field = rollout_spec_for(model, None, 1, 1).key_field  # the slot's field names
        self._oldest: int | None = None

    def _call(self, kind: str, step_key: int, n: int) -> None:
        self.conn.send((kind, step_key, n))
        version = self.conn.recv()
        self._oldest = version if self._oldest is None else min(self._oldest, version)

    def _request(
        self,
        step_key: int,
        obs: torch.Tensor,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: Any,
        extra: torch.Tensor | None,
    ) -> int:
        b, n = self.buffers, any_tensor(obs).shape[0]
        write_obs(b, self.key_field("obs", step_key), slice(0, n), obs)
        if action_mask is not None:
            b[self.key_field("action_mask", step_key)][:n].copy_(action_mask)
        if first is not None:
            b["first"][:n].copy_(first)
        if core_state is not None:
            b["core_h"][:n].copy_(core_state[0][0])
            b["core_c"][:n].copy_(core_state[1][0])
        if extra is not None:
            b["last_inputs"][:n].copy_(extra)
        return n

    def act(
        self,
        step_key: int,
        obs: torch.Tensor,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: Any,
        extra: torch.Tensor | None,
    ) -> Acted:
        n = self._request(step_key, obs, action_mask, first, core_state, extra)
        self._call("act", step_key, n)
        b = self.buffers
        action = b[self.key_field("action", step_key)][:n].clone()
        state = None
        if core_state is not None:
            state = (b["core_h"][:n].clone().unsqueeze(0), b["core_c"][:n].clone().unsqueeze(0))
        env_action = self.model.action_head(step_key).to_env(action)
        return Acted(action, b["log_prob"][:n].clone(), env_action, state)

    def value(
        self, step_key: int, obs: torch.Tensor, extra: torch.Tensor | None, core_state: Any
    ) -> torch.Tensor:
        n = self._request(step_key, obs, None, None, core_state, extra)
        self._call("value", step_key, n)
        return self.buffers["value"][:n].clone()

    def unroll_version(self, loaded_version: int) -> int:
        """The oldest server version that acted since the last call (the unroll's)."""
        version = loaded_version if self._oldest is None else self._oldest
        self._oldest = None
        return version


class InferenceServer:
    """What the inference process runs (see the module doc and :func:`_server_main`): batches
    of requests answered with its own copy of the policy on ``device``."""

    def __init__(
        self, model: Model, buffers: dict[str, torch.Tensor], device: torch.device | str, seed: int
    ):
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval()
        self.key_field = rollout_spec_for(model, None, 1, 1).key_field  # the slot's field names
        self.buffers = buffers
        self.version = 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._staging: dict[str, torch.Tensor] = {}  # pinned, for a GPU (see _gather)
        self.requests_served = 0
        self.batches = 0
        self.busy_s = 0.0  # serving, from the first request read to the last answer sent
        # In the learner's process (load): the weights are not copied while a batch is
        # served, and a batch after a copy on the learner's CUDA stream waits for it there.
        self.lock = threading.Lock()
        self._loaded: torch.cuda.Event | None = None
        self._own = self.model.state_dict()  # views of the server's weights

    def serve_round(
        self, conns: dict[int, Connection], timeout: float, also: list[Any] = ()
    ) -> list[Any]:
        """Wait up to ``timeout`` for requests on ``conns`` (``{actor: pipe}``) or for
        ``also``, serve every request that came in one batch; returns the ready ones of
        ``also``. A pipe that broke is closed and dropped from ``conns`` (the actor is gone:
        its death is the backend's business; a restart hands the server a new pipe)."""
        owner = {conn: index for index, conn in conns.items()}
        try:
            ready = wait([*owner, *also], timeout=timeout)
        except (OSError, ValueError):
            return []  # a pipe closed under us: an actor died, ask again
        requests, others = [], []
        start = time.perf_counter()
        for conn in ready:
            if conn not in owner:
                others.append(conn)
                continue
            try:
                kind, step_key, n = conn.recv()
            except (EOFError, OSError):
                conns.pop(owner[conn]).close()
                continue
            requests.append((owner[conn], conn, kind, step_key, n))
        if requests:
            self.serve(requests)
            self.busy_s += time.perf_counter() - start
        return others

    @torch.inference_mode()
    def serve(self, requests: list[tuple[int, Any, str, int, int]]) -> None:
        """Answer ``(actor, pipe, kind, step key, n)`` requests: one forward pass per
        ``(kind, step key)`` over all of their rows."""
        groups: dict[tuple[str, int], list[tuple[int, Any, int]]] = defaultdict(list)
        for actor, conn, kind, step_key, n in requests:
            groups[(kind, step_key)].append((actor, conn, n))
        with self.lock:
            if self._loaded is not None:  # weights copied on the learner's stream
                torch.cuda.current_stream(self.device).wait_event(self._loaded)
                self._loaded = None
            version = self.version
            for (kind, step_key), members in groups.items():
                self._serve_group(kind, step_key, members)
        for members in groups.values():
            for _, conn, _ in members:
                try:
                    conn.send(version)
                except (BrokenPipeError, OSError):
                    pass  # died while waiting: nothing to answer
        self.requests_served += len(requests)
        self.batches += 1

    @torch.no_grad()
    def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy the learner's ``state_dict`` (its live tensors, on any device) into the
        server's weights as ``version``, between two batches (a server in the learner's
        process). On a GPU the copies are queued on the caller's stream, after the update
        that made the weights; the next batch waits for them on its own."""
        with self.lock:  # a batch served holds it to its answers' download
            for name, own in self._own.items():
                own.copy_(state_dict[name], non_blocking=True)
            if self.device.type == "cuda":
                self._loaded = torch.cuda.Event()
                self._loaded.record(torch.cuda.current_stream(self.device))
            self.version = version

    def stats(self, wall_s: float, loading_s: float) -> dict[str, float]:
        """What the server did in ``wall_s`` seconds (``loading_s`` of them loading weights)."""
        return {
            "batches": self.batches,
            "requests_per_batch": self.requests_served / max(1, self.batches),
            "busy_share": self.busy_s / max(wall_s, 1e-9),
            "loading_share": loading_s / max(wall_s, 1e-9),
            "ms_per_batch": 1000.0 * self.busy_s / max(1, self.batches),
        }

    def _gather(self, name: str, members: list[tuple[int, Any, int]]) -> torch.Tensor:
        """The members' rows of ``name`` on the device: one indexed copy into a pinned staging
        buffer (reused: every group ends with a synchronising copy back), one async upload."""
        field = self.buffers[name]
        rows = sum(n for _, _, n in members)
        out = None
        if self.device.type == "cuda":
            if name not in self._staging:
                self._staging[name] = torch.empty(
                    (field.shape[0] * field.shape[1], *field.shape[2:]), dtype=field.dtype
                ).pin_memory()
            out = self._staging[name][:rows]
        if all(n == field.shape[1] for _, _, n in members):  # whole rows: one indexed copy
            index = torch.tensor([actor for actor, _, _ in members])
            if out is None:
                return field.index_select(0, index).flatten(0, 1)
            torch.index_select(field, 0, index, out=out.view(len(members), *field.shape[1:]))
        else:
            parts = [field[actor, :n] for actor, _, n in members]
            if out is None:
                return torch.cat(parts)
            torch.cat(parts, out=out)
        return out.to(self.device, non_blocking=True)

    def _scatter(self, members: list[tuple[int, Any, int]], values: dict[str, Any]) -> None:
        """Write ``{field: [rows, ...]}`` back into the members' rows, after one download."""
        if self.device.type == "cuda":
            values = {name: v.to("cpu", non_blocking=True) for name, v in values.items()}
            torch.cuda.current_stream(self.device).synchronize()
        whole = None
        for name, value in values.items():
            field = self.buffers[name]
            if all(n == field.shape[1] for _, _, n in members):
                if whole is None:
                    whole = torch.tensor([actor for actor, _, _ in members])
                field.index_copy_(0, whole, value.view(len(members), *field.shape[1:]))
                continue
            offset = 0
            for actor, _, n in members:
                field[actor, :n].copy_(value[offset : offset + n])
                offset += n

    def _serve_group(self, kind: str, step_key: int, members: list[tuple[int, Any, int]]) -> None:
        model, b = self.model, self.buffers
        obs = read_obs(b, self.key_field("obs", step_key), lambda n: self._gather(n, members))
        mask_field = self.key_field("action_mask", step_key)
        mask = self._gather(mask_field, members) if mask_field in b else None
        extra = self._gather("last_inputs", members) if model.use_last_action_reward else None
        state = None
        if model.core is not None:
            h = self._gather("core_h", members).unsqueeze(0)
            state = (h, self._gather("core_c", members).unsqueeze(0))
        if kind == "value":
            self._scatter(members, {"value": model.value(step_key, obs, extra, state)})
            return
        first = self._gather("first", members) if model.core is not None else None
        dist, after = model.act(step_key, obs, mask, first, state, extra)
        action = dist.sample(self.generator)
        log_prob = dist.log_prob(action).float()
        out = {self.key_field("action", step_key): action, "log_prob": log_prob}
        if after is not None:
            out["core_h"], out["core_c"] = after[0][0], after[1][0]
        self._scatter(members, out)


def _adopt(conns: dict[int, Connection], index: int, conn: Connection) -> None:
    """Serve ``conn`` as actor ``index``'s pipe (a restarted actor's: its old one closes)."""
    if index in conns:
        conns[index].close()
    conns[index] = conn


# -- the server's process -------------------------------------------------------------------------
def _server_main(
    model_bytes: bytes,
    buffers: dict[str, torch.Tensor],
    device: str,
    weights: Any,
    control: Connection,
    seed: int,
) -> None:
    """The inference process: serve the actors whose pipes arrive on ``control``
    (``("actor", index, pipe)``), load each newer version of ``weights`` between two batches,
    stop on ``None`` or when the learner is gone; an error is sent back as text."""
    leave_stopping_to_parent()  # the learner handles Ctrl-C and SIGTERM, then stops this
    torch.set_num_threads(1)  # see InferenceProcess
    conns: dict[int, Connection] = {}
    try:
        server = InferenceServer(pickle.loads(model_bytes), buffers, device, seed)
        server.version = weights.read_into(server.model, -1)
        control.send(("ready",))
        started, loading_s = time.perf_counter(), 0.0
        while True:
            if server.serve_round(conns, POLL_S, [control]):
                msg = control.recv()
                if msg is None:
                    break
                _adopt(conns, *msg[1:])
            t = time.perf_counter()
            version = weights.read_into(server.model, server.version)
            if version != server.version:
                server.version = version
                loading_s += time.perf_counter() - t
        wall = time.perf_counter() - started
        control.send(("stats", server.stats(wall, loading_s)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the learner is gone or stopping us
    except BaseException as exc:
        try:
            control.send(("error", "".join(traceback.format_exception(exc))))
        except (BrokenPipeError, OSError):
            pass
        raise SystemExit(1) from None
    finally:
        for conn in conns.values():
            conn.close()


class InferenceProcess:
    """The learner's handle on the inference server's process (see the module doc).

    ``ctx`` is the backend's multiprocessing context; ``weights`` its ``SharedWeights``
    (published after every update). The server keeps one torch thread: more would spin
    against the actor processes on their cores (on a CPU, batches of 16 Pong
    frames took 130-220 ms instead of 3-12 with two threads on two busy cores).
    :meth:`add_actor` hands the server an actor's end of its inference pipe (again after a
    restart); :meth:`check` raises the server's error, or that it died. ``index`` of ``count``
    servers (``runner.inference_servers``) names it in its messages.
    """

    def __init__(
        self,
        ctx: Any,
        model: Model,
        buffers: dict[str, torch.Tensor],
        device: torch.device | str,
        weights: Any,
        seed: int,
        start_timeout_s: float = 120.0,
        index: int = 0,
        count: int = 1,
    ):
        self.label = f" {index + 1} of {count}" if count > 1 else ""  # among several servers
        self._lock = threading.Lock()
        self._error: str | None = None
        self.stats: dict[str, float] | None = None  # the server's, once stopped
        self.control, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_server_main,
            name=f"impala-inference-{index}" if count > 1 else "impala-inference",
            args=(cloudpickle.dumps(model), buffers, str(device), weights, child, seed),
            daemon=True,
        )
        start_child(self.process)
        child.close()
        self._expect_ready(start_timeout_s)

    def _expect_ready(self, timeout: float) -> None:
        if not self.control.poll(timeout):
            self.stop()
            raise RuntimeError(
                f"the inference process{self.label} did not start within {timeout:.0f} s"
            )
        self.check()

    def _read(self) -> None:
        """Take the server's messages (``ready``, or its error)."""
        try:
            while self.control.poll():
                msg = self.control.recv()
                if msg[0] == "error":
                    self._error = msg[1]
                elif msg[0] == "stats":
                    self.stats = msg[1]
        except (EOFError, OSError):
            pass

    def add_actor(self, index: int, conn: Connection) -> None:
        """Give the server ``conn`` (this process's copy is closed: the server owns it)."""
        with self._lock:
            try:
                self.control.send(("actor", index, conn))
            except (BrokenPipeError, OSError):
                pass  # the server is gone: check() says so
        conn.close()

    def check(self, wait_s: float = 0.0) -> None:
        """Raise if the server failed or its process is gone (waiting up to ``wait_s`` for
        it to end: an actor can see its pipe break before the exit code is there)."""
        with self._lock:
            if wait_s:
                self.process.join(timeout=wait_s)
            self._read()
            if self._error is not None:
                raise RuntimeError(f"the inference process{self.label} failed:\n{self._error}")
            if self.process.exitcode is not None:
                raise RuntimeError(
                    f"the inference process{self.label} exited with code {self.process.exitcode}"
                )

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            try:
                self.control.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=timeout)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join(timeout=timeout)
            self._read()
            self.control.close()
        if self.stats:
            log_server_stats(self.label, self.stats)


def log_server_stats(label: str, st: dict[str, float]) -> None:
    """A server's closing line (``benchmarks/gpu_box.py`` reads it)."""
    log.info(
        "inference server%s: %d batches of %.1f requests, %.2f ms each; busy %.0f%% of "
        "the time, loading weights %.0f%%",
        label,
        st["batches"],
        st["requests_per_batch"],
        st["ms_per_batch"],
        100 * st["busy_share"],
        100 * st["loading_share"],
    )


class InferenceThread:
    """``runner.inference=learner``: the server as a thread of the learner's process, with
    :class:`InferenceProcess`'s face (``add_actor``, ``check``, ``stop``, ``stats``) and
    :meth:`load` in place of the shared weights: the learner's broadcast copies its weights
    into the server's on the device. ``version``: the weights ``model`` holds."""

    def __init__(
        self,
        model: Model,
        buffers: dict[str, torch.Tensor],
        device: torch.device | str,
        seed: int,
        version: int,
    ):
        self.label = " (in the learner's process)"
        self.server = InferenceServer(model, buffers, device, seed)
        self.server.version = version
        self.stats: dict[str, float] | None = None  # the server's, once stopped
        self.loading_s = 0.0
        self._error: str | None = None
        self._incoming: list[tuple[int, Connection]] = []  # actors' pipes for the thread
        self._inbox = threading.Lock()
        self._wake, self._waker = mp.Pipe(duplex=False)  # new pipes, or stop: read at once
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="impala-inference", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conns: dict[int, Connection] = {}
        started = time.perf_counter()
        try:
            while not self._stopping.is_set():
                if self.server.serve_round(conns, POLL_S, [self._wake]):
                    while self._wake.poll():
                        self._wake.recv()
                    with self._inbox:
                        incoming, self._incoming = self._incoming, []
                    for index, conn in incoming:
                        _adopt(conns, index, conn)
        except BaseException as exc:
            self._error = "".join(traceback.format_exception(exc))
        finally:
            for conn in conns.values():
                conn.close()
            self.stats = self.server.stats(time.perf_counter() - started, self.loading_s)

    def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The learner's broadcast: ``state_dict`` as ``version`` (:meth:`InferenceServer.load`)."""
        start = time.perf_counter()
        self.server.load(state_dict, version)
        self.loading_s += time.perf_counter() - start

    def add_actor(self, index: int, conn: Connection) -> None:
        """Serve ``conn`` as actor ``index``'s (again after a restart: the old pipe closes)."""
        with self._inbox:
            self._incoming.append((index, conn))
        self._waker.send(None)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise if the thread failed or ended before :meth:`stop`."""
        if self._error is not None:
            raise RuntimeError(f"the inference thread failed:\n{self._error}")
        if not self._thread.is_alive() and not self._stopping.is_set():
            raise RuntimeError("the inference thread stopped")

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        try:
            self._waker.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._thread.join(timeout=timeout)
        self._waker.close()
        self._wake.close()
        if self.stats:
            log_server_stats(self.label, self.stats)
