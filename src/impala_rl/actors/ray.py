"""Ray actors: the same actor loop on a Ray cluster (or a local Ray), rollouts via the object store.

Layout
------
- Each actor is a Ray actor (:class:`RolloutWorker`) holding one :class:`ActorLoop` and one
  slot. Its ``unroll`` call runs one unroll and returns the slot as numpy arrays (serialised
  into the object store, read back zero-copy where Ray allows) plus the episode statistics.
- A dispatcher thread in the learner process keeps ``PIPELINE`` (two) ``unroll`` calls queued
  per actor, so that an actor starts its next unroll as soon as it returns one instead of
  idling for a round trip, and takes finished ones in completion order (``ray.wait``). At most
  ``max_waiting = ceil(queue_out_of_sync_factor * actors_batch_size)`` finished rollouts wait
  for the learner; an actor whose rollout finds the queue full gets no new call until the
  learner takes a batch, so at most ``max_waiting + 2 * PIPELINE * num_actors`` rollouts exist
  at once and the object store never fills.
- Weights: one ``ray.put`` of the state dict (numpy) per broadcast. An actor's next ``unroll``
  call carries the newest reference when its weights are older, and the actor loads them
  before it starts the unroll, so weights change between unrolls only.
- ``max_policy_lag`` is checked when a batch is handed out, where the learner measures it. A
  rollout's episode statistics are recorded when it leaves the queue, taken or dropped, together
  with its env steps (see :class:`CollectedOutputs`). The queue, its stale drops and their
  accounting are :class:`impala_rl.actors.rollout_queue.RolloutQueue`'s, as for the subprocess
  backend.
- Faults: a call that fails because its actor (or the actor's node) died drops the rollout
  (``lost_rollouts``), kills what is left of the actor and starts a new one with the same
  resources (``actor_restarts``); it is placed wherever resources allow and starts working when
  it is, while the other actors go on. (An actor with no call, its rollouts waiting for queue
  room, is found dead when it gets its next call.) Past ``runner.max_actor_restarts``
  restarts, or on an exception in an env or the policy, :meth:`collect_outputs` raises
  :class:`ActorError`.
- ``runner.ray_address``: ``null`` starts a local Ray (dashboard off unless asked, bound to
  this machine) and stops it in :meth:`stop`, with a watchdog process that stops it if the
  trainer is killed (:mod:`impala_rl.actors.ray_watchdog`); ``auto`` / ``host:port`` joins a
  cluster and only disconnects. A Ray the caller initialised already is used as it is and
  left running.

Ray is an optional dependency (``pip install 'impala-rl[ray]'``), imported only here and only
when the backend is created.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from impala_rl.actors.base import ActorError, CollectedOutputs, DistributedActors, actor_seed
from impala_rl.actors.rollout_queue import Rollout, RolloutQueue
from impala_rl.config import ConfigError
from impala_rl.rollout import ActorLoop, RolloutSpec, UnrollResult, column_block, rollout_spec_for

INSTALL_HINT = "pip install 'impala-rl[ray]'"
POLL_S = 0.05
PIPELINE = 2  # unroll calls queued per actor: one running, one ready to start at once
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
STALL_TIMEOUT_S = 600.0  # no rollout for this long while actors have work (no node can host one?)


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"runner.backend=ray needs Ray, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray


class RolloutWorker:
    """The body of one Ray actor: an :class:`ActorLoop` filling its own slot.

    A plain class so that it is importable on every node; :func:`ray.remote` wraps it.
    """

    def __init__(
        self,
        env_factory: Any,
        model: torch.nn.Module,
        num_envs: int,
        unroll_length: int,
        seed: int,
        actor_index: int,
    ):
        torch.set_num_threads(1)
        self.loop = ActorLoop(env_factory, num_envs, model, seed, unroll_length, actor_index)
        spec = rollout_spec_for(
            model, self.loop.envs.single_observation_space, unroll_length, num_envs
        )
        self.slot = spec.allocate()
        self.arrays = {k: v.numpy() for k, v in self.slot.items()}  # views of the slot

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def unroll(
        self, weights: dict[str, np.ndarray] | None, version: int
    ) -> tuple[dict[str, np.ndarray], UnrollResult]:
        """Load ``weights`` (when given) as ``version``, then run one unroll."""
        if weights is not None:
            # Arrays from the object store are read-only views: copy them into tensors.
            state = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
            self.loop.load_policy(state, version)
        result = self.loop.unroll(self.slot)
        return self.arrays, result  # serialised when the call returns: the slot can be reused

    def close(self) -> None:
        self.loop.close()


class _Actor:
    """The learner's view of one Ray actor."""

    def __init__(self, index: int):
        self.index = index
        self.handle: Any = None
        self.refs: list[Any] = []  # unroll calls in flight, oldest first (or the start-up probe)
        self.starting = False  # ``refs[0]`` is the start-up probe, not an unroll
        self.known_version = -1  # weights version the actor has (or gets with its call)
        self.starts = 0
        self.delivered = 0  # rollouts delivered since the last (re)start


def start_watchdog() -> subprocess.Popen:
    """The process that stops this trainer's local Ray if the trainer dies without doing it
    (see :mod:`impala_rl.actors.ray_watchdog`; run as a script, so it imports no torch)."""
    script = Path(__file__).with_name("ray_watchdog.py")
    return subprocess.Popen([sys.executable, str(script), str(os.getpid())], stdin=subprocess.PIPE)


def stop_watchdog(watchdog: subprocess.Popen) -> None:
    """Tell the watchdog Ray was stopped cleanly, and join it."""
    try:
        watchdog.stdin.write(b"stop")  # type: ignore[union-attr]
        watchdog.stdin.close()  # type: ignore[union-attr]
    except OSError:
        pass
    try:
        watchdog.wait(timeout=10)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


class RayDistributedActors(DistributedActors):
    """``num_actors`` Ray actors, a bounded queue of finished rollouts, restarts on failures."""

    def __init__(self, *args: Any, runner: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ray = import_ray()
        self.runner = runner
        self.address = getattr(runner, "ray_address", None)
        self.num_cpus = float(getattr(runner, "ray_num_cpus_per_actor", 1.0))
        self.num_gpus = float(getattr(runner, "ray_num_gpus_per_actor", 0.0))
        self.resources = dict(getattr(runner, "ray_resources_per_actor", {}) or {})
        self.include_dashboard = bool(getattr(runner, "ray_include_dashboard", False))
        self.max_restarts = getattr(runner, "max_actor_restarts", 3)
        self.shutdown_timeout_s = getattr(runner, "shutdown_timeout_s", 10.0)
        self.restarts = 0
        self.lost = 0
        self._started = False
        self._owns_ray = False
        self._watchdog: subprocess.Popen | None = None

    # -- life cycle ----------------------------------------------------------------------------
    def _init_ray(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return  # the caller's Ray: use it, leave it running
        # every learner's actors (cfg.num_actors is one learner's share), and the further
        # learners' own reservations
        n = self.cfg.num_actors * self.cfg.num_learners
        learner_cpus = (self.cfg.num_learners - 1) * getattr(
            self.runner, "ray_num_cpus_per_learner", 1.0
        )
        kwargs: dict[str, Any] = {
            "log_to_driver": False,
            "configure_logging": False,
            "include_dashboard": self.include_dashboard,
        }
        if self.address is None:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            # One machine: advertise what the actors ask for, so that all of them fit.
            kwargs.update(
                num_cpus=max(os.cpu_count() or 1, math.ceil(n * self.num_cpus + learner_cpus)),
                resources={k: v * n for k, v in self.resources.items()},
                _node_ip_address="127.0.0.1",
            )
            if self.include_dashboard:
                kwargs["dashboard_host"] = "127.0.0.1"
        else:
            kwargs["address"] = self.address
            kwargs.pop("include_dashboard")
        # A local Ray's workers import what this process can (e.g. an env factory's module on
        # a sys.path entry added at run time), as subprocess actors do: Ray's processes inherit
        # the environment they are started with.
        saved = os.environ.get("PYTHONPATH")
        if self.address is None:
            paths = [p for p in sys.path if p and os.path.isdir(p)]
            os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        try:
            ray.init(**kwargs)
        except ConnectionError as exc:
            raise ActorError(
                f"cannot connect to the Ray cluster at runner.ray_address={self.address!r}: {exc}"
            ) from None
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        self._owns_ray = True
        if self.address is None:
            self._watchdog = start_watchdog()

    def start(self) -> None:
        cfg = self.cfg
        self._init_ray()
        ray = self.ray
        self._started = True
        try:
            probe = self.env_factory()
            spec: RolloutSpec = self.spec(probe.observation_space)
            probe.close()
            self._batch_spec = dataclasses.replace(spec, N=spec.N * cfg.actors_batch_size)
            self._batch = self._batch_spec.allocate()
            # finished rollouts (arrays): queued, blocked with their actor, or dropped as stale
            self.queue: RolloutQueue[dict[str, np.ndarray]] = RolloutQueue(cfg)
            self.max_waiting = self.queue.max_waiting
            self._remote_class = ray.remote(RolloutWorker)
            self._weights_ref = ray.put(_numpy_state(self._template.state_dict()))
            self._lock = threading.Condition()
            self._error: BaseException | None = None
            self._stopping = False
            # last rollout delivered, or last time an idle actor was given work
            self._last_progress = time.monotonic()
            self.actors = [_Actor(i) for i in range(cfg.num_actors)]
            with self._lock:
                for actor in self.actors:
                    self._spawn(actor)
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop, name="impala-ray-dispatcher", daemon=True
            )
            self._dispatcher.start()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, actor: _Actor) -> None:
        cfg = self.cfg
        seed = actor_seed(self.seed, actor.index)
        if actor.starts:
            seed = actor_seed(self.seed + 7919 * actor.starts, actor.index)
        actor.handle = self._remote_class.options(
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            resources=self.resources or None,
            max_restarts=0,  # restarts are ours: counted against runner.max_actor_restarts
            max_task_retries=0,
            name=None,
        ).remote(
            self.env_factory,
            self._template,
            cfg.envs_per_actor,
            cfg.n_rollout_steps,
            seed,
            actor.index,
        )
        actor.known_version = -1
        actor.delivered = 0
        actor.starts += 1
        # The first unroll is sent once the actor is up (it may wait for resources, or for its
        # process to start), so that it carries the weights current then, not at spawn time.
        actor.refs = [actor.handle.pid.remote()]
        actor.starting = True
        self._last_progress = time.monotonic()

    def _submit(self, actor: _Actor) -> None:
        """Queue the actor's next unrolls, each with the newest weights if it lacks them."""
        if actor.handle is None or actor.starting or self.queue.is_blocked(actor.index):
            return
        if not actor.refs:  # idle until now (e.g. waiting for queue room): the stall clock restarts
            self._last_progress = time.monotonic()
        while len(actor.refs) < PIPELINE:
            fresh = actor.known_version != self.policy_version
            weights = self._weights_ref if fresh else None
            actor.refs.append(actor.handle.unroll.remote(weights, self.policy_version))
            actor.known_version = self.policy_version

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._stopping = True
                lock.notify_all()
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.join(timeout=self.shutdown_timeout_s)
        for actor in getattr(self, "actors", []):
            if actor.handle is not None:
                try:
                    self.ray.kill(actor.handle, no_restart=True)
                except Exception:
                    pass
            actor.handle = None
            actor.refs = []
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.clear()
        self._weights_ref = None
        if self._owns_ray:
            self._owns_ray = False
            self.ray.shutdown()
            if self._watchdog is not None:
                stop_watchdog(self._watchdog)
                self._watchdog = None

    # -- the dispatcher thread ------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        ray = self.ray
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    owner = {ref: a for a in self.actors for ref in a.refs}
                if not owner:
                    time.sleep(POLL_S)
                    continue
                refs = list(owner)
                ready, rest = ray.wait(refs, num_returns=1, timeout=POLL_S)
                if ready and rest:  # more may have finished meanwhile
                    ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
                order = {ref: i for i, ref in enumerate(refs)}  # an actor's oldest call first
                for ref in sorted(ready, key=order.__getitem__):
                    self._on_done(owner[ref], ref)
        except BaseException as exc:  # surfaces in collect_outputs
            with self._lock:
                self._error = self._error or exc
                self._lock.notify_all()

    def _on_done(self, actor: _Actor, ref: Any) -> None:
        ray = self.ray
        exceptions = ray.exceptions
        try:
            value = ray.get(ref, timeout=max(60.0, self.shutdown_timeout_s))
        except exceptions.RayActorError as exc:
            if getattr(exc, "actor_init_failed", False):
                self._fail(ActorError(f"actor {actor.index} failed to start: {_plain(exc)}"))
            else:
                self._on_death(actor, exc, ref)
            return
        except exceptions.RayTaskError as exc:  # an exception in the env or the policy
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            self._fail(
                ActorError(f"actor {actor.index} failed: {type(cause).__name__}: {_plain(exc)}")
            )
            return
        except (exceptions.ObjectLostError, exceptions.GetTimeoutError) as exc:
            self._on_death(actor, exc, ref)  # its node went away with the rollout
            return
        with self._lock:
            if ref not in actor.refs or self._stopping:
                return
            actor.refs.remove(ref)
            if actor.starting:  # up and running: send the first unroll
                actor.starting = False
                self._submit(actor)
                return
            arrays, result = value
            result: UnrollResult
            actor.delivered += 1
            self._last_progress = time.monotonic()
            rollout = Rollout(arrays, int(arrays["policy_version"][0]), result)
            if self.queue.put(actor.index, rollout):
                self._submit(actor)
            self._lock.notify_all()

    def _fail(self, error: ActorError) -> None:
        with self._lock:
            self._error = self._error or error
            self._lock.notify_all()

    def _on_death(self, actor: _Actor, exc: BaseException, ref: Any) -> None:
        with self._lock:
            if self._stopping or self._error is not None or ref not in actor.refs:
                return  # (a later call of an actor whose death was handled already)
            if not actor.starting:
                self.lost += len(actor.refs)
                self.events.lost_rollouts(len(actor.refs))
            actor.refs = []
            actor.starting = False
            try:
                self.ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass
            actor.handle = None
            if self.restarts >= self.max_restarts:
                summary = _plain(exc).strip().splitlines()[0] if _plain(exc).strip() else ""
                self._error = ActorError(
                    f"actor {actor.index} died ({type(exc).__name__}: {summary}) and the restart "
                    f"limit runner.max_actor_restarts={self.max_restarts} is reached"
                )
                self._lock.notify_all()
                return
            self._spawn(actor)  # placed wherever resources allow; works once it is
            self.restarts += 1  # counted once the new actor has a handle
            self.events.actor_restarts(1)

    # -- the learner's side -----------------------------------------------------------------------
    def _drop_stale(self) -> None:
        """Drop rollouts more than ``max_policy_lag`` behind the current version."""
        self.queue.drop_stale(self.policy_version)
        self._unblock()

    def _unblock(self) -> None:
        """Move blocked rollouts into the queue while there is room; give their actors work."""
        self.queue.unblock()
        for actor in self.actors:
            self._submit(actor)

    def broadcast_updated_policy(self, state_dict: dict[str, torch.Tensor]) -> None:
        ref = self.ray.put(_numpy_state(state_dict))
        with self._lock:
            self.policy_version += 1
            self._weights_ref = ref

    def collect_outputs(self, learner_device: torch.device | str) -> CollectedOutputs:
        device = torch.device(learner_device)
        cfg = self.cfg
        with self._lock:
            while True:
                if self._error is not None:
                    raise self._error
                if not self._dispatcher.is_alive():
                    raise ActorError("the Ray dispatcher thread stopped unexpectedly")
                self._drop_stale()
                if len(self.queue) >= cfg.actors_batch_size:
                    break
                stalled = time.monotonic() - self._last_progress
                if stalled > STALL_TIMEOUT_S:
                    raise ActorError(
                        f"no rollout from any Ray actor for {stalled:.0f} s: are there nodes "
                        f"with the resources one actor asks for (num_cpus={self.num_cpus}, "
                        f"num_gpus={self.num_gpus}, resources={self.resources})? "
                        f"See `ray status`."
                    )
                self._lock.wait(timeout=POLL_S)
            t0 = time.perf_counter()
            queue_before = len(self.queue)
            taken = self.queue.take(cfg.actors_batch_size)
            self._unblock()
            queue_after = len(self.queue)
            dropped = self.queue.take_dropped()
            results = [rollout.result for rollout in taken] + dropped
            for result in results:
                self.record_unroll(result)
        n = self._batch_spec.N // cfg.actors_batch_size
        for b, rollout in enumerate(taken):
            block = column_block(self._batch, b * n, (b + 1) * n)
            for key, src in rollout.payload.items():
                block[key].numpy()[...] = src  # a numpy copy: the store's arrays are read-only
        del taken  # releases the object store's copies
        batch = self._batch
        if device.type != "cpu":
            batch = {k: v.to(device, copy=True) for k, v in batch.items()}
        return CollectedOutputs(
            batch,
            queue_before,
            queue_after,
            time.perf_counter() - t0,
            sum(r.env_steps for r in results),
            len(dropped),
        )

    def queue_size(self) -> int:
        with self._lock:
            return len(self.queue)

    def actor_node_ids(self, timeout: float = 60.0) -> list[str | None]:
        """The Ray node each actor runs on (``None`` while one waits for resources)."""
        refs = [a.handle.node_id.remote() if a.handle is not None else None for a in self.actors]
        out: list[str | None] = []
        for ref in refs:
            if ref is None:
                out.append(None)
                continue
            ready, _ = self.ray.wait([ref], timeout=timeout)
            out.append(self.ray.get(ready[0]) if ready else None)
        return out


def _plain(exc: BaseException) -> str:
    """An exception's text without the terminal colours Ray adds."""
    return ANSI_ESCAPE.sub("", str(exc))


def _numpy_state(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in state_dict.items()}
