"""Ray actors: the same actor loop on a Ray cluster (or a local Ray), rollouts via the object store.

Layout
------
- Each actor is a Ray actor (:class:`RolloutWorker`) holding one :class:`ActorLoop` and one
  slot. Its ``unroll`` call runs one unroll and returns the slot as numpy arrays (serialised
  into the object store, read back zero-copy where Ray allows) plus the episode statistics.
- The supervisor's dispatcher thread (:class:`impala_rl.actors.supervisor.ActorSupervisor`:
  the queue and its bound, stale drops, prefetch, restarts, errors and the collect loop are its)
  keeps ``PIPELINE`` (two) ``unroll`` calls queued per actor, so that an actor starts its next
  unroll as soon as it returns one instead of idling for a round trip, and takes finished ones
  in completion order (``ray.wait``). An actor whose rollout finds the queue full gets no new
  call until the learner takes a batch, so at most ``max_waiting + 2 * PIPELINE * num_actors``
  rollouts exist at once and the object store never fills.
- Weights: one ``ray.put`` of the state dict (numpy) per broadcast. An actor's next ``unroll``
  call carries the newest reference when its weights are older, and the actor loads them
  before it starts the unroll, so weights change between unrolls only.
- Faults: a call that fails because its actor (or the actor's node) died drops the rollout
  (``lost_rollouts``), kills what is left of the actor, and the supervisor starts a new one
  with the same resources (``actor_restarts``); it is placed wherever resources allow and
  starts working when it is, while the other actors go on. (An actor with no call, its
  rollouts waiting for queue room, is found dead when it gets its next call.) No rollout for
  ``STALL_TIMEOUT_S`` while an actor has a call in flight ends collection: no node can host it?
- ``runner.ray_address``: ``null`` starts a local Ray (dashboard off unless asked, bound to
  this machine) and stops it in :meth:`stop`, with a watchdog process that stops it if the
  trainer is killed (:mod:`impala_rl.actors.ray_watchdog`); ``auto`` / ``host:port`` joins a
  cluster and only disconnects. A Ray the caller initialised already is used as it is and
  left running.

Ray is an optional dependency (``pip install 'impala-rl[ray]'``), imported only here and only
when the backend is created.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from impala_rl.actors.base import ActorError
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
from impala_rl.config import ConfigError
from impala_rl.group_signals import hangup_blocked
from impala_rl.machine import available_cores
from impala_rl.rollout import ActorLoop, RolloutSpec, UnrollResult, rollout_spec_for

INSTALL_HINT = "pip install 'impala-rl[ray]'"
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


class _Actor(Actor):
    """The learner's view of one Ray actor."""

    def __init__(self, index: int):
        super().__init__(index)
        self.handle: Any = None
        self.refs: list[Any] = []  # unroll calls in flight, oldest first (or the start-up probe)
        self.starting = False  # ``refs[0]`` is the start-up probe, not an unroll
        self.known_version = -1  # weights version the actor has (or gets with its call)


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


class RayDistributedActors(ActorSupervisor[_Actor, dict[str, np.ndarray]]):
    """``num_actors`` Ray actors returning rollouts through the object store: the transport of
    the supervisor."""

    dispatcher_name = "impala-ray-dispatcher"

    def __init__(self, *args: Any, runner: Any = None, **kwargs: Any):
        super().__init__(*args, runner=runner, **kwargs)
        self.ray = import_ray()
        self.address = getattr(runner, "ray_address", None)
        self.num_cpus = float(getattr(runner, "ray_num_cpus_per_actor", 1.0))
        self.num_gpus = float(getattr(runner, "ray_num_gpus_per_actor", 0.0))
        self.resources = dict(getattr(runner, "ray_resources_per_actor", {}) or {})
        self.include_dashboard = bool(getattr(runner, "ray_include_dashboard", False))
        self.lost = 0
        self._owns_ray = False
        self._weights_ref: Any = None
        self._weights_version = 0  # the version _weights_ref holds
        # last rollout delivered, or last time an idle actor was given work
        self._last_progress = time.monotonic()
        self._watchdog: subprocess.Popen | None = None

    # -- life cycle ----------------------------------------------------------------------------
    def _prepare(self) -> None:
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
            # One machine: the cores this run may use (Ray starts a worker per CPU it is
            # told of), or what the actors ask for where that is more, so that all of them fit.
            kwargs.update(
                num_cpus=max(available_cores(), math.ceil(n * self.num_cpus + learner_cpus)),
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
        # ray.init puts its own SIGTERM handler (a sys.exit) in place of the run's, which stops
        # after the update in flight with a checkpoint (impala_rl.stopping): keep the run's.
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            with hangup_blocked():  # Ray's processes: see impala_rl.group_signals
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
            if sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, sigterm)
        self._owns_ray = True
        if self.address is None:
            self._watchdog = start_watchdog()

    def _open(self, spec: RolloutSpec) -> None:
        self._remote_class = self.ray.remote(RolloutWorker)
        self._weights_ref = self.ray.put(_numpy_state(self._template.state_dict()))
        self._weights_version = self.policy_version

    def _new_actor(self, index: int) -> _Actor:
        return _Actor(index)

    def _spawn(self, actor: _Actor, seed: int) -> None:
        cfg = self.cfg
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
        # The first unroll is sent once the actor is up (it may wait for resources, or for its
        # process to start), so that it carries the weights current then, not at spawn time.
        actor.refs = [actor.handle.pid.remote()]
        actor.starting = True
        self._last_progress = time.monotonic()

    def _give_work(self, actor: _Actor) -> None:
        """Queue the actor's next unrolls, each with the newest weights if it lacks them."""
        if actor.starting:
            return
        if not actor.refs:  # idle until now (e.g. waiting for queue room): the stall clock restarts
            self._last_progress = time.monotonic()
        version = self._weights_version
        while len(actor.refs) < PIPELINE:
            weights = self._weights_ref if actor.known_version != version else None
            actor.refs.append(actor.handle.unroll.remote(weights, version))
            actor.known_version = version

    def _alive(self, actor: _Actor) -> bool:
        return actor.handle is not None

    def _kill(self, actor: _Actor) -> None:
        """Kill what is left of ``actor`` (restarts are the supervisor's, not Ray's)."""
        if actor.handle is not None:
            try:
                self.ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass
        actor.handle = None
        actor.refs = []

    def _close(self) -> None:
        for actor in self.actors:
            self._kill(actor)
        self._weights_ref = None
        if self._owns_ray:
            self._owns_ray = False
            self.ray.shutdown()
            if self._watchdog is not None:
                stop_watchdog(self._watchdog)
                self._watchdog = None

    # -- the dispatcher's side -----------------------------------------------------------------
    def _waitables(self) -> dict[Any, tuple[_Actor, int]]:
        return {ref: (a, a.starts) for a in self.actors for ref in a.refs}

    def _events(
        self, waitables: dict[Any, tuple[_Actor, int]], timeout: float
    ) -> Iterator[ActorEvent[dict[str, np.ndarray]]]:
        ray = self.ray
        if not waitables:
            time.sleep(timeout)
            return
        refs = list(waitables)
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready and rest:  # more may have finished meanwhile
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        order = {ref: i for i, ref in enumerate(refs)}  # an actor's oldest call first
        for ref in sorted(ready, key=order.__getitem__):
            actor, generation = waitables[ref]
            yield self._event(actor, generation, ref)

    def _event(self, actor: _Actor, generation: int, ref: Any) -> ActorEvent:
        exceptions = self.ray.exceptions
        try:
            value = self.ray.get(ref, timeout=max(60.0, self.shutdown_timeout_s))
        except exceptions.RayActorError as exc:
            if getattr(exc, "actor_init_failed", False):
                error = ActorError(f"actor {actor.index} failed to start: {_plain(exc)}")
                return ActorEvent(actor, generation, ERROR, error=error, token=ref)
            return ActorEvent(actor, generation, DEATH, cause=_cause(exc), token=ref)
        except exceptions.RayTaskError as exc:  # an exception in the env or the policy
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            error = ActorError(f"actor {actor.index} failed: {type(cause).__name__}: {_plain(exc)}")
            return ActorEvent(actor, generation, ERROR, error=error, token=ref)
        except (exceptions.ObjectLostError, exceptions.GetTimeoutError) as exc:
            # its node went away with the rollout
            return ActorEvent(actor, generation, DEATH, cause=_cause(exc), token=ref)
        if actor.starting and actor.refs and ref == actor.refs[0]:
            return ActorEvent(actor, generation, READY, token=ref)
        arrays, result = value
        rollout = Rollout(arrays, int(arrays["policy_version"][0]), result)
        return ActorEvent(actor, generation, ROLLOUT, rollout, token=ref)

    def _accept(self, actor: _Actor, event: ActorEvent) -> bool:
        if event.token not in actor.refs:
            return False
        actor.refs.remove(event.token)
        if event.kind == READY:
            actor.starting = False  # up and running: send the first unroll
        else:
            self._last_progress = time.monotonic()
        return True

    def _bury(self, actor: _Actor, cause: str) -> str:
        if not actor.starting:
            self.lost += len(actor.refs)
            self.events.lost_rollouts(len(actor.refs))
        actor.starting = False
        self._kill(actor)
        return cause

    def _copy_rollout(self, block: dict[str, torch.Tensor], payload: dict[str, np.ndarray]) -> None:
        for key, src in payload.items():
            block[key].numpy()[...] = src  # a numpy copy: the store's arrays are read-only

    def _publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = self.ray.put(_numpy_state(state_dict))
        with self._lock:  # versions only grow, whichever broadcast puts its weights last
            if version > self._weights_version:
                self._weights_ref, self._weights_version = ref, version

    def _failure(self, actor: _Actor | None = None) -> ActorError | None:
        """No rollout for ``STALL_TIMEOUT_S`` while an actor has work: nowhere to run?"""
        if actor is not None or not any(a.refs for a in self.actors):
            return None
        stalled = time.monotonic() - self._last_progress
        if stalled <= STALL_TIMEOUT_S:
            return None
        return ActorError(
            f"no rollout from any Ray actor for {stalled:.0f} s: are there nodes "
            f"with the resources one actor asks for (num_cpus={self.num_cpus}, "
            f"num_gpus={self.num_gpus}, resources={self.resources})? "
            f"See `ray status`."
        )

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


def _cause(exc: BaseException) -> str:
    """The exception type and its first line, for the restart messages."""
    summary = _plain(exc).strip().splitlines()[0] if _plain(exc).strip() else ""
    return f"{type(exc).__name__}: {summary}"


def _plain(exc: BaseException) -> str:
    """An exception's text without the terminal colours Ray adds."""
    return ANSI_ESCAPE.sub("", str(exc))


def _numpy_state(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in state_dict.items()}
