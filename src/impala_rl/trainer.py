"""The training run: epochs of updates, evaluation, model selection, stopping, checkpoints.

A run directory holds ``config.yaml`` (the resolved config), ``checkpoints/last.pt`` (every
epoch, atomic), ``checkpoints/best.pt`` (the best evaluation so far), ``metrics.jsonl``,
TensorBoard files under ``tb/`` and, at the end, ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from impala_rl import checkpoint
from impala_rl.actors import ActorError, CollectedOutputs, DistributedActors, make_actors
from impala_rl.checkpoint import CheckpointError
from impala_rl.child_processes import PARENT_STOP_GRACE_S
from impala_rl.config import (
    ConfigError,
    RunConfig,
    broadcasts_after,
    check_num_minibatches,
    planned_optimizer_steps,
    steps_per_batch,
    to_dict,
    to_yaml,
)
from impala_rl.distributed import LearnerGroupError, Rendezvous, learner_device
from impala_rl.envs import EnvError
from impala_rl.envs.factory import user_module_dirs
from impala_rl.evaluation import (
    BackgroundEvaluator,
    EvaluationResult,
    ProcessEvaluator,
    evaluate,
)
from impala_rl.events import ImpalaEvents, RunEvents
from impala_rl.group_signals import stop_signals
from impala_rl.learner import (
    Learner,
    NonFiniteError,
    UpdateStats,
    load_optimizer_state,
    scheduled_entropy_coef,
    scheduled_lr,
)
from impala_rl.learner_group import LearnerGroupMember
from impala_rl.rundir import RunDirError, lock_run_dir
from impala_rl.startup import prepare_process, probe_env, resolve_device, seed_everything
from impala_rl.stats import EpochStatsAggregator, EventRecorder
from impala_rl.stopping import SECOND_SIGNAL_GRACE_S, SignalWatch, end_process, notice_stop
from impala_rl.writers import make_writers

log = logging.getLogger(__name__)

# What a user's settings, env or files can cause: one line for the user, no traceback.
TRAINING_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    RunDirError,
    EnvError,
    CheckpointError,
    ActorError,
    NonFiniteError,
    LearnerGroupError,
)


@dataclass
class Counters:
    """Progress that survives a resume."""

    epoch: int = 0
    updates: int = 0
    env_steps: int = 0
    episodes: int = 0
    wall_time_s: float = 0.0
    best_eval_return: float = float("-inf")
    epochs_without_improvement: int = 0
    last_eval_return: float | None = None


def evaluation_due(share: float | None, spent_s: float, last_s: float, elapsed_s: float) -> bool:
    """Whether an epoch's end evaluates under ``rollout_evaluator.max_time_share``: the time
    spent evaluating so far plus one more evaluation as long as the last stays within ``share``
    of the elapsed wall time (``None``: always; the first evaluation always runs)."""
    return share is None or spent_s + last_s <= share * elapsed_s


def default_run_dir(cfg: RunConfig) -> Path:
    env = cfg.env.id.replace(":", "_").replace("/", "_")
    return Path("runs") / f"{env}-{time.strftime('%Y%m%d-%H%M%S')}"


class Trainer:
    """Runs one training run as the config describes; :meth:`train` returns the summary.

    With ``algorithm.num_learners`` > 1 this is learner 0 (the leader): it starts the other
    learners (``rank`` > 0, each a :class:`Trainer` of its own that writes nothing) and
    makes every decision for the group; :attr:`group_member` plays this learner's part in
    it (see :mod:`impala_rl.learner_group`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path | None = None,
        resume: bool = False,
        rank: int = 0,
        rendezvous: Rendezvous | None = None,
    ):
        self.cfg = cfg
        self._config_dict = to_dict(cfg)  # written into every checkpoint; converting costs ms
        self.run_dir = Path(run_dir or cfg.log.run_dir or default_run_dir(cfg))
        self.resume = resume
        self._restored_recent_returns: list[float] = []
        self.counters = Counters()
        self.rank = rank
        self.is_leader = rank == 0
        self.device = learner_device(resolve_device(cfg.algorithm.device), rank)
        self.group_member: LearnerGroupMember | None = None
        if cfg.algorithm.num_learners > 1:
            self.group_member = LearnerGroupMember(
                cfg, rank, self.device, self.run_dir, resume, Trainer, TRAINING_ERRORS, rendezvous
            )
        self._saving = threading.Lock()  # held while a checkpoint is written

    # -- set-up --------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.cfg
        prepare_process(cfg)
        probe = probe_env(cfg)
        self.env_factory, self.eval_env_factory = probe.env_factory, probe.eval_env_factory
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        model = probe.model
        self._module_dirs = user_module_dirs(self._config_dict)  # imported by the probe
        alg = cfg.algorithm
        check_num_minibatches(alg, alg.actors_batch_size * alg.envs_per_actor * model.n_agents)
        self.learner = Learner(model, alg, self.device, planned_steps=planned_optimizer_steps(cfg))
        self.checkpoint_dir = self.run_dir / "checkpoints"
        if self.resume:
            self._load_last()
        if not self.is_leader:  # same initial weights as the leader; its own random streams
            seed_everything(int(np.random.SeedSequence([cfg.seed, self.rank]).generate_state(1)[0]))
            self.recorder = EventRecorder()
            self.run_events = self.recorder.interface(RunEvents)
            self.impala_events = self.recorder.interface(ImpalaEvents)
            self.aggregator = EpochStatsAggregator(self.recorder)
            self.writers = []
            self.console = None
            return
        if not self.resume:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.run_dir)
        if stale := checkpoint.remove_temporaries(self.checkpoint_dir):  # a killed write's
            log.info("removed unfinished checkpoint writes: %s", ", ".join(stale))
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.recorder = EventRecorder()
        self.impala_events = self.recorder.interface(ImpalaEvents)
        self.run_events = self.recorder.interface(RunEvents)
        self.aggregator = EpochStatsAggregator(self.recorder)
        self.writers, self.console = make_writers(cfg, self.run_dir, append=self.resume)

    def _release_run_dir(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()
            self._lock = None

    def _load_last(self) -> None:
        data = checkpoint.load(self.checkpoint_dir / "last.pt")
        trained_with = data["config"]["algorithm"]["optimizer"]
        if trained_with != self.cfg.algorithm.optimizer:
            raise ConfigError(
                f"algorithm.optimizer={self.cfg.algorithm.optimizer!r} on resume, but the run "
                f"was trained with {trained_with!r}: its optimizer state cannot carry over; "
                "resume without this override or start a new run"
            )
        try:
            self.learner.model.load_state_dict(data["model"])
        except RuntimeError as exc:  # e.g. an env.kwargs override that changed the spaces
            first = str(exc).strip().splitlines()
            raise ConfigError(
                "the run's saved weights do not fit the model this config builds (an override "
                "changed the env's spaces or the model; resume without it or start a new run): "
                + " ".join(line.strip() for line in first[1:3])
            ) from None
        if self.learner.target_model is not None:  # appo: the saved target network, or the
            # trained weights when the run was not appo before
            self.learner.target_model.load_state_dict(data.get("target_model", data["model"]))
            self.learner.steps_since_target = data.get("target_steps", 0)
        model = self.learner.model
        load_optimizer_state(
            self.learner.optimizer,
            data["optimizer"],
            self.cfg.algorithm,
            saved_order=model.saved_parameter_order(list(data["model"])),
            order=[name for name, _ in model.named_parameters()],
        )
        self.counters = Counters(**data["counters"])
        # the training return's window carries over, so the first resumed epoch reports the
        # same "last 100 episodes" mean as the run would have without the interruption
        self._restored_recent_returns = list(data.get("recent_returns", []))
        self.learner.num_updates = self.counters.updates
        checkpoint.set_rng_state(data["rng"])
        # best.pt can be newer than last.pt (a hard kill between the two): its return is the
        # one a later model must beat, else a worse model would overwrite the true best.
        best_path = self.checkpoint_dir / "best.pt"
        if best_path.is_file():
            best = checkpoint.load(best_path)["counters"]
            self.counters.best_eval_return = best["best_eval_return"]
            if best["epoch"] > self.counters.epoch:
                self.counters.epochs_without_improvement = 0

    def _finite_model_state(self, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The (learner's) model's state dict; refuses to hand out non-finite weights for saving."""
        state = (model or self.learner.model).state_dict()
        if not all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point()):
            raise NonFiniteError(
                "the model's weights are not finite; the last good checkpoint is kept"
            )
        return state

    def _actor_seed(self) -> int:
        """The actors' seed: ``seed`` for a new run; on resume also the progress, so a resumed
        run does not replay the first run's env and sampling streams; a further learner's
        actors also draw from its rank."""
        if self.counters.env_steps == 0 and self.rank == 0:
            return self.cfg.seed
        entropy = [self.cfg.seed, self.counters.env_steps]
        seq = np.random.SeedSequence(entropy + [self.rank] if self.rank else entropy)
        return int(seq.generate_state(1)[0])

    def _actors_config(self) -> RunConfig:
        """The config this learner's actors get: its share of ``num_actors``."""
        alg = self.cfg.algorithm
        if alg.num_learners == 1:
            return self.cfg
        share = replace(alg, num_actors=alg.num_actors // alg.num_learners)
        return replace(self.cfg, algorithm=share)

    def _checkpoint_payload(self) -> dict[str, Any]:
        self.learner.settle()  # a step still unread (an error mid-batch) is checked first
        payload = {
            "format": checkpoint.CHECKPOINT_FORMAT,
            "model": self._finite_model_state(),
            "optimizer": self.learner.optimizer.state_dict(),
            "counters": dict(self.counters.__dict__),
            "recent_returns": list(self.recent_returns),
            "rng": checkpoint.rng_state(),
            "config": self._config_dict,
            "module_dirs": self._module_dirs,
        }
        if self.learner.target_model is not None:  # appo's target network
            payload["target_model"] = self._finite_model_state(self.learner.target_model)
            payload["target_steps"] = self.learner.steps_since_target
        return payload

    def save_checkpoint(self) -> None:
        payload = self._checkpoint_payload()
        with self._saving:
            checkpoint.save_atomic(payload, self.checkpoint_dir / "last.pt")

    def _save_best(self, model: torch.nn.Module, epoch: int) -> None:
        """best.pt: the evaluated weights, with the counters and the epoch they are from."""
        payload = {
            "format": checkpoint.CHECKPOINT_FORMAT,
            "model": self._finite_model_state(model),
            "config": self._config_dict,
            "module_dirs": self._module_dirs,
            "counters": {**self.counters.__dict__, "epoch": epoch},
        }
        with self._saving:
            checkpoint.save_atomic(payload, self.checkpoint_dir / "best.pt")

    # -- the run -------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        try:
            self._build()
        except BaseException:
            self._release_run_dir()
            raise
        c = self.counters
        self._stop_flag = {"stop": False, "in_step": False, "abort": False, "closing": False}
        stopped_because: str | None = None
        error: BaseException | None = None
        member = self.group_member
        if member is not None and not self.is_leader:  # its actors start from the leader's weights
            member.join(self.learner)
        # evaluated meanwhile (leader only); a process is started first: its imports overlap
        self.evaluator = self._background_evaluator()
        try:
            actors = make_actors(
                self._actors_config(),
                self.env_factory,
                self.learner.model,
                self._actor_seed(),
                self.device,
            )
        except BaseException:
            if self.evaluator is not None:
                self.evaluator.close()
            raise
        actors.policy_version = self.learner.num_updates
        self.recent_returns: deque[float] = deque(self._restored_recent_returns, maxlen=100)
        self._start_wall = time.perf_counter() - c.wall_time_s
        self._follow_schedules()
        self._background_epoch = -1  # the epoch whose weights were last sent to be evaluated
        self._last_epoch_stats: dict[str, float] = {}
        # max_time_share: seconds spent evaluating since this process started the run, and the
        # last evaluation's length (a thread's, in the background)
        self._session_start = time.perf_counter()
        self._eval_time_s = self._last_eval_s = 0.0
        watch = self._signal_watch(actors)
        with watch:  # until every process this learner started is stopped
            try:
                stopped_because = self._run(actors, watch)
            except KeyboardInterrupt:  # a second Ctrl-C
                stopped_because = "interrupted"
                self.save_checkpoint()
            except NonFiniteError as exc:  # the model may be corrupt: keep the last good one
                stopped_because, error = "error", exc
            except Exception as exc:  # e.g. actors failed: the model is fine, save it
                stopped_because, error = "error", exc
                if isinstance(exc, LearnerGroupError) or not self.is_leader:
                    pass  # a broken group: the weights may be one step apart; keep the last
                else:
                    self._try_final_checkpoint()
            finally:
                if self.evaluator is not None:
                    self.evaluator.close()
                try:  # the other learners first: their actors may need this learner's Ray
                    if member is not None:
                        member.leave(error is not None or stopped_because == "interrupted")
                finally:
                    actors.stop()
                    for writer in self.writers:
                        writer.close()
        c.wall_time_s = time.perf_counter() - self._start_wall
        try:
            summary = self._write_summary(stopped_because or "error", self.recent_returns, error)
        finally:
            self._release_run_dir()
        if error is not None:  # a caller can read what the run did: error.summary
            error.summary = summary  # type: ignore[attr-defined]
            raise error
        return summary

    def _run(self, actors: DistributedActors, watch: SignalWatch) -> str:
        """Start the actors (and the group), then epochs until a stop reason."""
        cfg, c = self.cfg, self.counters
        try:
            actors.start()
            watch.arm()
            if self.group_member is not None and self.is_leader:
                self.group_member.join(self.learner)
            stopped_because = None
            while stopped_because is None:
                stopped_because = self._run_epoch(actors)
                if not self.is_leader:
                    continue
                if stopped_because and stopped_because != "interrupted":
                    self._finish_background_evaluation(stopped_because)
                c.wall_time_s = time.perf_counter() - self._start_wall
                if c.epoch % cfg.log.checkpoint_every_epochs == 0 or stopped_because:
                    self.save_checkpoint()
            return stopped_because
        finally:  # shutting down must not be cut short: a signal no longer raises
            self._stop_flag["closing"] = True

    def _signal_watch(self, actors: DistributedActors) -> SignalWatch:
        """The leader's: Ctrl-C, SIGTERM or a hangup (``stop_signals``) stops after the
        update, a second aborts (see :meth:`_on_signal`) and ends the process if the run has
        not ended :data:`SECOND_SIGNAL_GRACE_S` later, a third at once. A further learner's:
        Ctrl-C and a hangup are the leader's (ignored); a first SIGTERM is notice (one sent to
        the whole group or job reached the leader too, which stops every learner at the same
        update), a second one (the leader stopping a learner that did not finish) or
        :data:`PARENT_STOP_GRACE_S` end it, with the processes it started: it writes nothing
        that could be cut short."""
        if self.is_leader:
            return SignalWatch(
                self._on_signal,
                stop_signals(),
                end_after=2,
                grace_s=SECOND_SIGNAL_GRACE_S,
                end=lambda: self._abort(actors),
                notice=notice_stop,
            )
        return SignalWatch(
            lambda signum, frame: None,
            (signal.SIGTERM,),
            end_after=1,
            grace_s=PARENT_STOP_GRACE_S,
            end=lambda: end_process(128 + signal.SIGTERM, actors),
        )

    def _abort(self, actors: DistributedActors) -> NoReturn:
        log.warning(
            "ending the process now: the run has not ended (its main thread may wait for a "
            "learner that stalled); its processes are stopped, the checkpoints keep their "
            "last state"
        )
        end_process(128 + signal.SIGINT, actors, self._saving)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """A first signal asks every learner to stop after the update the group agrees on; a
        second aborts once the step's state is consistent (see :meth:`_one_step`)."""
        flag = self._stop_flag
        if not flag["stop"]:
            flag["stop"] = True
        elif not (flag["abort"] or flag["closing"]):
            flag["abort"] = True
            if not flag["in_step"]:
                raise KeyboardInterrupt

    def _run_epoch(self, actors: DistributedActors) -> str | None:
        """``epoch_length`` updates, then evaluation and statistics; returns a stop reason."""
        c = self.counters
        c.epoch += 1
        epoch_start = time.perf_counter()
        epoch_steps = 0
        train_policy = c.epoch > self.cfg.algorithm.critic_burn_in_epochs
        stopped_because = None
        for _ in range(self.cfg.algorithm.epoch_length):
            epoch_steps += self._update(actors, train_policy, epoch_start, epoch_steps)
            stopped_because = self._budget_or_signal_stop()
            if stopped_because:
                break
        member = self.group_member
        if member is not None:
            member.gather_events(actors, self.recent_returns)
        if stopped_because == "interrupted":  # stop soon: no evaluation
            if self.is_leader:
                self._write_epoch_stats(actors, epoch_start, epoch_steps)
            return stopped_because
        n_epochs = self.cfg.algorithm.n_epochs
        final = stopped_because is not None or 0 < n_epochs <= c.epoch
        reason = None
        if self.is_leader:
            reason = self._end_epoch(actors, epoch_start, epoch_steps, final)
        reason = stopped_because or reason or self._budget_or_signal_stop(signal_only=True)
        if member is not None:  # evaluation and signals are the leader's
            reason = member.leader_decides(reason)
        return reason

    def _update(
        self, actors: DistributedActors, train_policy: bool, epoch_start: float, epoch_steps: int
    ) -> int:
        """Collect a batch, update, broadcast, record; returns the env steps it consumed."""
        cfg, c = self.cfg, self.counters
        t0 = time.perf_counter()
        collected = actors.collect_outputs(self.device)
        t_collected = time.perf_counter()
        with self._one_step():
            passes: list[UpdateStats] = []
            # Sample reuse: each pass (of num_minibatches blocks of columns or of decisions,
            # one optimizer step each) recomputes V-trace against the current weights. Every
            # broadcast_every-th step and the batch's last are broadcast, stamped with the
            # optimizer steps so far, so versions (and policy lag) keep counting optimizer
            # steps; actors that act only between batches get the last alone. A captured
            # update's figures are read at the next step or broadcast (settle_later), so the
            # next minibatch is prepared while the GPU runs the step.
            steps, taken = steps_per_batch(cfg.algorithm), 0
            for n in range(cfg.algorithm.num_passes):
                for block in self.learner.minibatches(collected.batch, fresh=n == 0):
                    stats = self.learner.update(
                        block, train_policy=train_policy, fresh=n == 0, settle_later=True
                    )
                    if stats is not None:  # else read with the next settle()
                        passes.append(stats)
                    taken += 1
                    if broadcasts_after(cfg.algorithm, taken) and (
                        taken == steps or not actors.acts_between_batches
                    ):
                        passes += self.learner.settle()  # only checked weights go out
                        actors.broadcast_updated_policy(
                            self.learner.model.state_dict(), self.learner.num_updates
                        )
            passes += self.learner.settle()
            c.updates = self.learner.num_updates
            env_steps = collected.env_steps
            if self.group_member is not None:
                env_steps = self.group_member.share_progress(
                    env_steps, self._stop_flag["stop"], time.perf_counter() - self._start_wall
                )
            c.env_steps += env_steps
            self._follow_schedules()
        t_end = time.perf_counter()
        for stats in passes[1:]:
            self._record_learner(stats)
        stats = passes[0]
        if len(passes) > 1:  # the update's time is every pass's
            stats.timings = {k: sum(p.timings[k] for p in passes) for k in stats.timings}
        self._record_update(stats, collected, t_collected - t0, t_end - t0)
        returns = actors.recent_returns_since_last_call()
        if self.group_member is not None and not self.is_leader:
            self.group_member.hold_returns(returns)  # the leader's statistics take them
        else:
            self.recent_returns.extend(returns)
        c.wall_time_s = time.perf_counter() - self._start_wall
        if self.console is not None:
            recent = self.recent_returns
            self.console.on_update(
                c.env_steps,
                (epoch_steps + env_steps) / max(1e-9, t_end - epoch_start),
                float(np.mean(recent)) if recent else None,
                float(np.mean(stats.policy_lag)),
                c.epoch,
            )
        return env_steps

    @contextmanager
    def _one_step(self) -> Iterator[None]:
        """The optimizer step and the counters move together: a second Ctrl-C landing in
        between is held until both have moved, so the final checkpoint is never torn."""
        flag = self._stop_flag
        flag["in_step"] = True
        try:
            yield
        finally:
            flag["in_step"] = False
        if flag["abort"]:
            raise KeyboardInterrupt

    def _budget_or_signal_stop(self, signal_only: bool = False) -> str | None:
        cfg, c, member = self.cfg, self.counters, self.group_member
        if not signal_only:
            if cfg.max_env_steps is not None and c.env_steps >= cfg.max_env_steps:
                return "max_env_steps"
            if member is not None:  # the leader's clock decides for every learner
                if member.wall_over:
                    return "max_wall_time_s"
            elif cfg.max_wall_time_s is not None and c.wall_time_s >= cfg.max_wall_time_s:
                return "max_wall_time_s"
        signalled = member.stop if member is not None else self._stop_flag["stop"]
        return "interrupted" if signalled else None

    def _try_final_checkpoint(self) -> None:
        try:
            self.save_checkpoint()
        except Exception as exc:  # the original error matters more
            log.warning("could not write the final checkpoint: %s", exc)

    def _record_update(
        self,
        stats: UpdateStats,
        collected: CollectedOutputs,
        collect_time: float,
        total_time: float,
    ) -> None:
        self._record_learner(stats)
        ev = self.impala_events
        ev.estimated_queue_sizes(collected.queue_size_before, collected.queue_size_after)
        total = max(total_time, 1e-12)
        t = stats.timings
        waiting = max(0.0, collect_time - collected.dequeue_time)  # the two phases don't overlap
        ev.time_collecting_actors(waiting, 100.0 * waiting / total)
        ev.time_dequeuing_actors(collected.dequeue_time, 100.0 * collected.dequeue_time / total)
        ev.time_learner_rollout(t["learner_rollout"], 100.0 * t["learner_rollout"] / total)
        ev.time_loss_computation(t["loss_computation"], 100.0 * t["loss_computation"] / total)
        ev.time_backprob(t["backprob"], 100.0 * t["backprob"] / total)
        ev.time_update(total_time)
        ev.dropped_stale_rollouts(collected.dropped_stale)

    def _follow_schedules(self) -> None:
        """The learning rate and entropy weight scheduled for the env steps so far."""
        alg, steps, horizon = self.cfg.algorithm, self.counters.env_steps, self.cfg.max_env_steps
        self.learner.set_learning_rate(scheduled_lr(alg, steps, horizon))
        self.learner.entropy_coef = scheduled_entropy_coef(alg, steps, horizon)

    def _record_learner(self, stats: UpdateStats) -> None:
        """One optimizer step's events (one per pass over a batch)."""
        ev = self.impala_events
        for key, value in stats.policy_loss.items():
            ev.policy_loss(key, value)
            ev.policy_entropy(key, stats.policy_entropy[key])
            ev.policy_grad_norm(key, stats.policy_grad_norm[key])
            ev.vtrace_mean_rho(key, stats.vtrace_mean_rho[key])
            ev.vtrace_clipped_fraction(key, stats.vtrace_clipped_fraction[key])
            if key in stats.policy_below_entropy_floor:
                ev.policy_below_entropy_floor(key, stats.policy_below_entropy_floor[key])
        for key, value in stats.critic_value_loss.items():
            ev.critic_value_loss(key, value)
            ev.critic_value(key, stats.critic_value[key])
            ev.critic_grad_norm(key, stats.critic_grad_norm[key])
            if key in stats.critic_popart_sigma:
                ev.critic_popart_mu(key, stats.critic_popart_mu[key])
                ev.critic_popart_sigma(key, stats.critic_popart_sigma[key])
        ev.total_loss(stats.total_loss)
        ev.grad_norm(stats.grad_norm)
        ev.learning_rate(stats.learning_rate)
        ev.entropy_coef(stats.entropy_coef)
        self.recorder.record_each(ImpalaEvents.policy_lag, stats.policy_lag)

    def _background_evaluator(self) -> BackgroundEvaluator | ProcessEvaluator | None:
        """The leader's evaluator under ``rollout_evaluator.background`` (None: in the pause)."""
        ev_cfg = self.cfg.algorithm.rollout_evaluator
        if not ev_cfg.background or not self.is_leader:
            return None
        if ev_cfg.background == "process":
            return ProcessEvaluator(
                self.learner.model,
                self.eval_env_factory,
                self._eval_seed,
                self._count_eval_time,
                n_episodes=ev_cfg.n_episodes,
                deterministic=ev_cfg.deterministic,
                max_episode_steps=ev_cfg.max_episode_steps,
            )
        return BackgroundEvaluator(self._timed_evaluate)

    def _eval_seed(self, epoch: int) -> int:
        """The evaluation seed of the weights of ``epoch``: drawn from the run's seed."""
        return int(np.random.SeedSequence([self.cfg.seed, 1, epoch]).generate_state(1)[0])

    def _evaluate(self, model: torch.nn.Module, epoch: int) -> EvaluationResult:
        """Evaluate ``model``, with evaluation seeds drawn from the epoch it is from."""
        ev_cfg = self.cfg.algorithm.rollout_evaluator
        return evaluate(
            model,  # type: ignore[arg-type]
            self.eval_env_factory,
            ev_cfg.n_episodes,
            deterministic=ev_cfg.deterministic,
            seed=self._eval_seed(epoch),
            max_episode_steps=ev_cfg.max_episode_steps,
        )

    def _count_eval_time(self, seconds: float) -> None:
        """An evaluation's length, counted for ``rollout_evaluator.max_time_share``."""
        self._last_eval_s = seconds
        self._eval_time_s += seconds

    def _timed_evaluate(self, model: torch.nn.Module, epoch: int) -> EvaluationResult:
        """:meth:`_evaluate`, its time counted for ``rollout_evaluator.max_time_share``."""
        t0 = time.perf_counter()
        try:
            return self._evaluate(model, epoch)
        finally:
            self._count_eval_time(time.perf_counter() - t0)

    def _evaluation_due(self, final: bool) -> bool:
        share = self.cfg.algorithm.rollout_evaluator.max_time_share
        elapsed = time.perf_counter() - self._session_start
        return final or evaluation_due(share, self._eval_time_s, self._last_eval_s, elapsed)

    def _end_epoch(
        self, actors: DistributedActors, epoch_start: float, epoch_steps: int, final: bool
    ) -> str | None:
        """Evaluate, select the best model, write statistics; returns a stop reason or None.

        In the background the result of an earlier epoch's snapshot may arrive (or none), and a
        new evaluation of this epoch's weights starts if none is running. Under
        ``rollout_evaluator.max_time_share`` an epoch's end may not evaluate; the ``final``
        epoch's does (in the background: :meth:`_finish_background_evaluation`).
        """
        alg, c = self.cfg.algorithm, self.counters
        t0 = time.perf_counter()
        reason = None
        if self.evaluator is None:
            if self._evaluation_due(final):
                result = self._timed_evaluate(self.learner.model, c.epoch)
                reason = self._select(result, c.epoch, self.learner.model)
        else:
            done = self.evaluator.poll()
            if done is not None:
                reason = self._select(done[2], done[0], done[1])
            if reason is None and not self.evaluator.busy and self._evaluation_due(False):
                self.evaluator.start(self.learner.model, c.epoch)
                self._background_epoch = c.epoch
        self.run_events.time_evaluation(time.perf_counter() - t0)
        self._write_epoch_stats(actors, epoch_start, epoch_steps)
        if reason != "target_return" and alg.n_epochs > 0 and c.epoch >= alg.n_epochs:
            return "n_epochs"
        return reason

    def _select(self, result: EvaluationResult, epoch: int, model: torch.nn.Module) -> str | None:
        """Record an evaluation of ``model`` (the weights of ``epoch``), keep it as best.pt if it
        is the best so far, count patience; returns ``target_return``, ``patience`` or None."""
        cfg, alg, c = self.cfg, self.cfg.algorithm, self.counters
        for ret, length in zip(result.returns, result.lengths, strict=True):
            self.run_events.eval_return(ret)
            self.run_events.eval_length(length)
        if result.wins is not None:
            for win in result.wins:
                self.run_events.eval_win_rate(float(win))
        c.last_eval_return = mean_return = result.mean_return
        # Burn-in epochs evaluate an untrained policy: no best model, no patience, no target.
        if epoch <= alg.critic_burn_in_epochs:
            return None
        if mean_return > c.best_eval_return:
            c.best_eval_return = mean_return
            c.epochs_without_improvement = 0
            self._save_best(model, epoch)
        else:
            c.epochs_without_improvement += 1
        if cfg.target_return is not None and mean_return >= cfg.target_return:
            return "target_return"
        if alg.patience > 0 and c.epochs_without_improvement >= alg.patience:
            return "patience"
        return None

    def _finish_background_evaluation(self, stopped_because: str) -> None:
        """At a stop: wait for the running evaluation and select on its result; at a budget's
        end also evaluate the final weights if no evaluation had started on them."""
        if self.evaluator is None:
            return
        done = self.evaluator.poll(wait=True)
        if done is not None:
            self._select(done[2], done[0], done[1])
            self._rewrite_last_epoch()
        budget = stopped_because not in ("patience", "target_return")
        if budget and self._background_epoch != self.counters.epoch:
            epoch, model = self.counters.epoch, self.learner.model
            self._select(self._timed_evaluate(model, epoch), epoch, model)
            self._rewrite_last_epoch()

    def _rewrite_last_epoch(self) -> None:
        """Write the last epoch's row again with an evaluation that finished after it, so the
        run's final evaluations reach every writer (readers keep an epoch's latest row)."""
        stats = {**self._last_epoch_stats, **self.aggregator.reduce()}
        for writer in self.writers:
            writer.on_epoch(self.counters.epoch, self.counters.env_steps, stats)

    def _write_epoch_stats(
        self, actors: DistributedActors, epoch_start: float, epoch_steps: int
    ) -> None:
        c = self.counters
        actor_stats = actors.get_epoch_stats_aggregator().reduce()
        c.episodes += int(actor_stats.get("episode_return/count", 0))
        elapsed = time.perf_counter() - epoch_start
        self.run_events.total_env_steps(c.env_steps)
        self.run_events.total_episodes(c.episodes)
        self.run_events.total_updates(c.updates)
        if self.recent_returns:
            self.run_events.train_return_recent(float(np.mean(self.recent_returns)))
        self.run_events.steps_per_second(epoch_steps / max(elapsed, 1e-9))
        self.run_events.time_epoch(elapsed)
        stats = {**actor_stats, **self.aggregator.reduce()}
        stats["wall_time_s"] = c.wall_time_s
        self._last_epoch_stats = stats
        for writer in self.writers:
            writer.on_epoch(c.epoch, c.env_steps, stats)

    def _write_summary(
        self, stopped_because: str, recent_returns: deque, error: BaseException | None
    ) -> dict[str, Any]:
        c = self.counters
        summary = {
            "best_eval_return": c.best_eval_return if np.isfinite(c.best_eval_return) else None,
            "last_eval_return": c.last_eval_return,
            "train_return_recent": float(np.mean(recent_returns)) if recent_returns else None,
            "env_steps": c.env_steps,
            "updates": c.updates,
            "epochs": c.epoch,
            "episodes": c.episodes,
            "wall_time_s": round(c.wall_time_s, 3),
            "stopped_because": stopped_because,
            "run_dir": str(self.run_dir),
        }
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        if self.is_leader and self.run_dir.is_dir():
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
