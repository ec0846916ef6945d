"""Every event the project records, defined once.

An event is a method on an interface class whose arguments are its fields; a decorator
declares how the event is reduced per epoch (mean by default) and which argument groups it
(``step_key`` for policies, ``critic_key`` for critics). Code records events through an
:class:`impala_rl.stats.EventRecorder`'s typed proxy, e.g.
``events.policy_loss(step_key=0, value=0.3)``; writers only ever see names derived from
these definitions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

REDUCERS = ("mean", "sum", "min", "max", "std", "count", "last")


@dataclass(frozen=True)
class StatOutput:
    """One reduced statistic of an event: ``reducer`` applied to the values of ``field``."""

    name: str | None
    field: str
    reducer: str


@dataclass(frozen=True)
class EventSpec:
    """The definition of one event: its name, value fields, grouping and epoch reduction."""

    name: str
    fields: tuple[str, ...]
    group_by: str | None
    outputs: tuple[StatOutput, ...]
    doc: str


def epoch_stats(
    *reducers: str,
    group_by: str | None = None,
    fields: Sequence[str] | None = None,
) -> Callable[[Callable], Callable]:
    """Declare an event's per-epoch reduction.

    ``reducers`` default to ``("mean",)``. With one reducer and one field the statistic is
    named after the event; otherwise each output is named by field and/or reducer.
    ``fields`` limits which arguments are reduced (the others are context).
    """
    reducers = reducers or ("mean",)
    for r in reducers:
        if r not in REDUCERS:
            raise ValueError(f"unknown reducer {r!r}; valid: {', '.join(REDUCERS)}")

    def decorate(fn: Callable) -> Callable:
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        value_fields = tuple(fields) if fields else tuple(p for p in params if p != group_by)
        outputs = []
        for f in value_fields:
            for r in reducers:
                parts = []
                if len(value_fields) > 1 or f != "value":
                    parts.append(f)
                if len(reducers) > 1:
                    parts.append(r)
                outputs.append(StatOutput("/".join(parts) or None, f, r))
        fn.__event_spec__ = EventSpec(  # type: ignore[attr-defined]
            name=fn.__name__,
            fields=tuple(params),
            group_by=group_by,
            outputs=tuple(outputs),
            doc=(fn.__doc__ or "").strip(),
        )
        return fn

    return decorate


def event_specs(interface: type) -> dict[str, EventSpec]:
    """All event definitions of an interface class, by name."""
    specs = {}
    for name, member in inspect.getmembers(interface, predicate=inspect.isfunction):
        spec = getattr(member, "__event_spec__", None)
        if spec is not None:
            specs[name] = spec
    return specs


def spec_of(event: Callable | EventSpec) -> EventSpec:
    if isinstance(event, EventSpec):
        return event
    spec = getattr(event, "__event_spec__", None)
    if spec is None:
        raise ValueError(f"{event!r} is not an event (no @epoch_stats declaration)")
    return spec


class ImpalaEvents:
    """The learner's events, with the names Maze-RL users know."""

    @epoch_stats(group_by="critic_key")
    def critic_grad_norm(self, critic_key, value):
        """Gradient norm of a critic's parameters before clipping."""

    @epoch_stats(group_by="critic_key")
    def critic_popart_mu(self, critic_key, value):
        """PopArt's running mean of a critic's V-trace targets after the update
        (``model.popart``; recorded where it is set)."""

    @epoch_stats(group_by="critic_key")
    def critic_popart_sigma(self, critic_key, value):
        """PopArt's scale of a critic's V-trace targets after the update: the critic learns
        targets divided by it (``model.popart``; recorded where it is set)."""

    @epoch_stats(group_by="critic_key")
    def critic_value(self, critic_key, value):
        """Mean value estimate of a critic over the batch."""

    @epoch_stats(group_by="critic_key")
    def critic_value_loss(self, critic_key, value):
        """Baseline (value) loss of a critic, before its coefficient."""

    @epoch_stats()
    def estimated_queue_sizes(self, before, after):
        """Full rollouts waiting for the learner before and after a batch was dequeued."""

    @epoch_stats(group_by="step_key")
    def policy_entropy(self, step_key, value):
        """Mean entropy of a policy over the batch."""

    @epoch_stats(group_by="step_key")
    def policy_below_entropy_floor(self, step_key, value):
        """Share of the batch's decisions whose policy entropy is under the entropy floor
        (``algorithm.entropy_floor``; recorded where it is set)."""

    @epoch_stats(group_by="step_key")
    def policy_grad_norm(self, step_key, value):
        """Gradient norm of a policy's parameters before clipping."""

    @epoch_stats(group_by="step_key")
    def policy_loss(self, step_key, value):
        """Policy-gradient loss of a policy, before its coefficient."""

    @epoch_stats()
    def time_backprob(self, time, percent):
        """Seconds (and share of the update) spent in backward, clipping and optimizer step."""

    @epoch_stats()
    def time_collecting_actors(self, time, percent):
        """Seconds (and share) waiting for the actors (or running them, when sequential)."""

    @epoch_stats()
    def time_dequeuing_actors(self, time, percent):
        """Seconds (and share) spent taking finished rollouts off the queue."""

    @epoch_stats()
    def time_learner_rollout(self, time, percent):
        """Seconds (and share) of the learner's forward pass over the batch."""

    @epoch_stats()
    def time_loss_computation(self, time, percent):
        """Seconds (and share) computing V-trace and the losses."""

    @epoch_stats()
    def time_update(self, value):
        """Seconds for one whole learner update, collection included."""

    @epoch_stats()
    def total_loss(self, value):
        """The weighted sum of all loss terms that was minimised."""

    @epoch_stats()
    def grad_norm(self, value):
        """Global gradient norm before clipping."""

    @epoch_stats("last")
    def learning_rate(self, value):
        """Learning rate used for the update."""

    @epoch_stats("last")
    def entropy_coef(self, value):
        """Weight of the entropy bonus used for the update."""

    @epoch_stats("mean", "min", "max")
    def policy_lag(self, value):
        """Updates between the policy that produced a rollout and the learner's."""

    @epoch_stats("sum")
    def dropped_stale_rollouts(self, value):
        """Rollouts dropped for exceeding ``max_policy_lag``."""

    @epoch_stats(group_by="step_key")
    def vtrace_mean_rho(self, step_key, value):
        """Mean unclipped importance weight pi/mu over the batch."""

    @epoch_stats(group_by="step_key")
    def vtrace_clipped_fraction(self, step_key, value):
        """Share of importance weights above the rho threshold."""


class ActorEvents:
    """Events from the actors and their environments."""

    @epoch_stats("mean", "std", "min", "max", "count")
    def episode_return(self, value):
        """Undiscounted return of a finished training episode."""

    @epoch_stats("mean", "std", "min", "max")
    def episode_length(self, value):
        """Length of a finished training episode."""

    @epoch_stats("sum")
    def actor_env_steps(self, value):
        """Env steps of the rollouts handed to the learner, trained or dropped as stale."""

    @epoch_stats("sum")
    def actor_restarts(self, value):
        """Actor processes restarted after they died."""

    @epoch_stats("sum")
    def lost_rollouts(self, value):
        """Rollouts dropped because their actor (or its node) died before delivering them."""


class RunEvents:
    """Per-epoch facts of the training run."""

    @epoch_stats("last")
    def total_env_steps(self, value):
        """Env steps since the start of the run (resumes included)."""

    @epoch_stats("last")
    def total_episodes(self, value):
        """Training episodes finished since the start of the run."""

    @epoch_stats("last")
    def total_updates(self, value):
        """Learner updates since the start of the run."""

    @epoch_stats("last")
    def train_return_recent(self, value):
        """Mean return of the last 100 training episodes, at the end of the epoch."""

    @epoch_stats("last")
    def steps_per_second(self, value):
        """Env steps per second over the epoch."""

    @epoch_stats("last")
    def time_epoch(self, value):
        """Seconds the epoch took, evaluation included."""

    @epoch_stats("last")
    def time_evaluation(self, value):
        """Seconds training waited for evaluation in the epoch (background: the copy only)."""

    @epoch_stats("mean", "std", "min", "max")
    def eval_return(self, value):
        """Return of an evaluation episode."""

    @epoch_stats("mean")
    def eval_length(self, value):
        """Length of an evaluation episode."""

    @epoch_stats("mean")
    def eval_win_rate(self, value):
        """Share of evaluation games won (envs that report ``info["win"]``, e.g. tictactoe)."""
