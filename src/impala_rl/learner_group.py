"""One learner's part in a run with several learners, held by its ``Trainer``.

The leader (rank 0) starts the other learners and forms the group with them; at every update
the learners sum their env steps and take the leader's stop flags, at an epoch's end the
leader gathers the others' actor events and episode returns and its stop decision goes to
every learner, and at the run's end the leader waits for the others. The ``Trainer`` decides
when each of these happens; :mod:`impala_rl.distributed` moves the bytes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, MutableSequence
from pathlib import Path
from typing import Any, Protocol

import torch

from impala_rl.actors import DistributedActors
from impala_rl.config import RunConfig, to_dict
from impala_rl.distributed import (
    LeaderGpuHold,
    LearnerGroup,
    PeerLearners,
    Rendezvous,
    make_store,
    report_error,
    start_peer_learners,
)
from impala_rl.envs.factory import carry_session_callables, session_callables
from impala_rl.group_signals import ignore_group_signals
from impala_rl.learner import Learner


class Trains(Protocol):
    """A run that a further learner trains (a ``Trainer``)."""

    def train(self) -> Any: ...


# How a further learner's run is built: the Trainer class, handed down so that this module
# does not import the layer above it.
MakeTrainer = Callable[..., Trains]


class LearnerGroupMember:
    """This learner's roles in the group: joining it (the leader first starts the others),
    sharing each update's progress and the leader's stop flags, gathering the epoch's events
    on the leader, the leader's decisions, and leaving it so that no learner is left running.

    ``make_trainer`` and ``user_errors`` are the leader's, for the learners it starts (see
    :func:`run_peer_learner`); ``rendezvous`` is a further learner's, where it joins.
    """

    def __init__(
        self,
        cfg: RunConfig,
        rank: int,
        device: torch.device,
        run_dir: Path,
        resume: bool,
        make_trainer: MakeTrainer,
        user_errors: tuple[type[BaseException], ...],
        rendezvous: Rendezvous | None = None,
    ):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.is_leader = rank == 0
        self._run_dir, self._resume = run_dir, resume
        self._make_trainer, self._user_errors = make_trainer, user_errors
        self._rendezvous = rendezvous
        self.group: LearnerGroup | None = None
        self.peers: PeerLearners | None = None
        self._gpu_hold: LeaderGpuHold | None = None  # Ray: the leader's GPU, held
        self.wall_over = False  # the leader's max_wall_time_s verdict
        self.stop = False  # the stop flag the group agreed on
        self._unsent_returns: list[float] = []  # a further learner's, until the epoch's end

    def join(self, learner: Learner) -> None:
        """Form the learner group (the leader first starts the others) and take the leader's
        weights, so every learner starts from the same model."""
        cfg, n = self.cfg, self.cfg.algorithm.num_learners
        if self.is_leader:
            host = "127.0.0.1"
            on_ray = cfg.runner.backend == "ray"
            if on_ray and cfg.runner.ray_address is not None:
                import ray

                host = ray.util.get_node_ip_address()
            store = make_store(host, n)
            rendezvous = Rendezvous(host, store.port, n)
            # a notebook's env or encoder: the other learners build the run from the config
            session = session_callables(to_dict(cfg))
            run = (self._make_trainer, self._user_errors, cfg, str(self._run_dir), self._resume)
            if on_ray and cfg.runner.ray_num_gpus_per_learner > 0 and self.device.type == "cuda":
                self._gpu_hold = LeaderGpuHold(self.device, cfg.runner.ray_num_gpus_per_learner)
            self.peers = start_peer_learners(
                run_peer_learner,
                lambda rank: (*run, rank, rendezvous, session),
                n,
                on_ray=on_ray,
                ray_num_gpus=cfg.runner.ray_num_gpus_per_learner,
                ray_num_cpus=cfg.runner.ray_num_cpus_per_learner,
            )
            self.peers.wait_joined(store)
            self.group = LearnerGroup(
                0, rendezvous, self.device, store, lambda: self.peers.describe_failure(store)
            )
        else:
            assert self._rendezvous is not None
            self.group = LearnerGroup(self.rank, self._rendezvous, self.device)
        learner.group = self.group
        self.group.broadcast_module(learner.model)
        if learner.target_model is not None:
            self.group.broadcast_module(learner.target_model)

    def share_progress(self, env_steps: int, stop_requested: bool, elapsed_s: float) -> int:
        """Every learner's env steps of this update, and the leader's stop flags (a signal,
        ``max_wall_time_s`` after ``elapsed_s``) on every learner: :attr:`stop`,
        :attr:`wall_over`."""
        assert self.group is not None
        stop = wall_over = 0.0
        if self.is_leader:
            stop = float(stop_requested)
            limit = self.cfg.max_wall_time_s
            wall_over = float(limit is not None and elapsed_s >= limit)
        total, stop, wall_over = self.group.control_sum([env_steps, stop, wall_over])
        # Decisions read this, never the leader's own flag: a signal that lands during the
        # call sets that flag on the leader alone, and reaches the group at the next update.
        self.stop = self.stop or stop > 0
        self.wall_over = wall_over > 0
        return int(total)

    def hold_returns(self, returns: list[float]) -> None:
        """A further learner's episode returns, sent to the leader at the epoch's end."""
        self._unsent_returns.extend(returns)

    def gather_events(
        self, actors: DistributedActors, recent_returns: MutableSequence[float]
    ) -> None:
        """At an epoch's end the leader takes the other learners' actor events and episode
        returns (into ``actors``' recorder and ``recent_returns``), so its statistics cover
        every actor."""
        assert self.group is not None
        if self.is_leader:
            gathered = self.group.gather_to_leader(None) or []
            for values, returns in gathered[1:]:
                actors.recorder.merge_raw({}, values)
                recent_returns.extend(returns)
            return
        _, values = actors.recorder.drain()
        self.group.gather_to_leader((dict(values), self._unsent_returns))
        self._unsent_returns = []

    def leader_decides(self, value: Any) -> Any:
        """The leader's ``value`` (its stop reason) on every learner."""
        assert self.group is not None
        return self.group.leader_decides(value)

    def leave(self, failed: bool) -> None:
        """Close this learner's part of the group; the leader then waits for the others to
        finish their run and stop their actors (stopping those that do not), so that no
        learner is left running."""
        if self.group is not None and (failed or not self.is_leader):
            self.group.close()  # after a failure, a learner blocked in a collective fails at once
        if self.peers is not None:
            self.peers.join(10.0 + 2 * self.cfg.runner.shutdown_timeout_s)
        if self._gpu_hold is not None:
            self._gpu_hold.release()
        if self.group is not None:
            self.group.close()


def run_peer_learner(
    make_trainer: MakeTrainer,
    user_errors: tuple[type[BaseException], ...],
    cfg: RunConfig,
    run_dir: str,
    resume: bool,
    rank: int,
    rendezvous: Rendezvous,
    session: bytes | None = None,
) -> None:
    """A further learner's process (or Ray actor): its own actors, the leader's decisions.
    Ctrl-C or a hangup reaches the leader, which stops every learner at the same update;
    SIGTERM (the leader stopping a learner that did not finish) stops its actors and ends it,
    even while it waits in a collective (see ``Trainer._signal_watch``). An error in
    ``user_errors`` ends it with exit code 1: the leader's one line names it. ``session``: the
    callables of the leader's interactive session that the config names
    (:func:`session_callables`)."""
    if threading.current_thread() is threading.main_thread():
        ignore_group_signals()  # the leader's: Ctrl-C, the terminal's hangup
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        carry_session_callables(session)
        make_trainer(cfg, run_dir=run_dir, resume=resume, rank=rank, rendezvous=rendezvous).train()
    except BaseException as exc:  # for the leader's error message
        report_error(rendezvous, rank, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, user_errors):
            raise SystemExit(1) from None
        raise  # anything else keeps its traceback


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
