"""Per-actor decision sequences of a structured rollout, and V-trace over them.

In a structured rollout (:class:`impala_rl.rollout.StructuredRolloutSpec`) each row is one
sub-step of one actor, identified by its ``(step_key, agent_id)``. V-trace runs over one
actor's **own** decisions: for a pair ``(k, a)`` and a column, its decisions are the rows ``d_0 < d_1 < ...``
where ``step_key == k`` and ``agent_id == a`` (row ``T`` included, for bootstrapping). Decision
``i`` earns the sum of agent ``a``'s rewards from row ``d_i`` up to (not including) ``d_{i+1}``,
or up to the end of the episode when that comes first (then its discount is 0, else gamma:
one discount per decision of that actor). When the actor is done (``actor_done``) its
sequence ends there too. A decision whose reward segment is still open at the end of the unroll
(no later decision of the same actor, no episode end) is not trained: its value only
bootstraps the one before it. Truncation ends a segment like termination (no bootstrap): the
final observation belongs to whichever actor would act next, not to this one.

The sequence of a pair is compacted to the front of each column: ``[L, B]`` with ``L`` the
largest number of decisions of that pair in any column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impala_rl import vtrace


@dataclass
class DecisionSequence:
    """One actor's decisions in a batch, compacted: every tensor is ``[L, B]``."""

    rows: torch.Tensor
    """int64: the batch row (``0..T``) of decision ``j`` in a column (``T`` as padding)."""
    valid: torch.Tensor
    """bool: decision ``j`` exists in the column."""
    trainable: torch.Tensor
    """bool: its reward segment is complete in this unroll (it gets a loss)."""
    rewards: torch.Tensor
    """float: the actor's rewards summed from the decision to its next one (or episode end)."""
    discounts: torch.Tensor
    """float: ``gamma``, or 0 where the episode or the actor ended before the next decision."""


def decision_sequence(
    step_key: torch.Tensor,
    agent_id: torch.Tensor,
    reward: torch.Tensor,
    episode_end: torch.Tensor,
    actor_done: torch.Tensor,
    key: int,
    agent: int,
    gamma: float,
) -> DecisionSequence | None:
    """The decision sequence of ``(key, agent)``; ``None`` when it never acts in the batch.

    Args:
        step_key: ``[T+1, B]`` step key of every row.
        agent_id: ``[T+1, B]`` agent of every row.
        reward: ``[T, B, n_agents]`` per-agent rewards of every sub-step (already clipped).
        episode_end: ``[T, B]`` the episode ended after sub-step t (terminated or truncated).
        actor_done: ``[T, B]`` the actor of row t takes no more decisions this episode.
        key, agent: the actor.
        gamma: discount per decision.
    """
    T, B = episode_end.shape
    device = step_key.device
    is_dec = (step_key == key) & (agent_id == agent)  # [T+1, B]
    counts = is_dec.sum(dim=0)
    L = int(counts.max()) if B else 0
    if L == 0:
        return None
    pos = is_dec.long().cumsum(dim=0) - 1
    tt, bb = is_dec.nonzero(as_tuple=True)
    rows = torch.full((L, B), T, dtype=torch.long, device=device)
    rows[pos[tt, bb], bb] = tt
    valid = torch.arange(L, device=device).unsqueeze(1) < counts.unsqueeze(0)

    next_valid = torch.cat([valid[1:], torch.zeros(1, B, dtype=torch.bool, device=device)])
    none = T + 1
    next_rows = torch.cat([rows[1:], torch.full((1, B), none, device=device)])
    next_rows = torch.where(next_valid, next_rows, torch.full_like(next_rows, none))

    # first segment end at or after each row: the episode ends, or this actor is done
    ends = episode_end | (actor_done & is_dec[:T])
    times = torch.arange(T, device=device).unsqueeze(1).expand(T, B)
    end_at = torch.where(ends, times, torch.full_like(times, none))
    end_at = torch.cat([end_at, torch.full((1, B), none, dtype=torch.long, device=device)])
    end_after = torch.flip(torch.cummin(torch.flip(end_at, [0]), dim=0).values, [0])  # [T+1, B]
    end = end_after.gather(0, rows)

    ended = end < next_rows  # the segment closes at an end, before any next decision
    trainable = valid & (rows < T) & (ended | next_valid)
    seg_stop = torch.where(ended, end + 1, next_rows).clamp(max=T)
    r = reward[..., agent]
    cum = torch.cat([torch.zeros(1, B, dtype=r.dtype, device=device), r.cumsum(dim=0)])
    seg_rewards = cum.gather(0, seg_stop) - cum.gather(0, rows)
    zeros = torch.zeros_like(seg_rewards)
    seg_rewards = torch.where(trainable, seg_rewards, zeros)
    discounts = torch.where(trainable & ~ended, torch.full_like(zeros, gamma), zeros)
    return DecisionSequence(rows, valid, trainable, seg_rewards, discounts)


def sequence_vtrace(
    seq: DecisionSequence,
    target_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    values: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    clip_c_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> vtrace.VTraceReturns:
    """V-trace over one decision sequence.

    Args:
        seq: the sequence (``[L, B]``).
        target_log_prob: ``[T+1, B]`` log pi of every row's action (row ``T``: anything).
        behaviour_log_prob: ``[T, B]`` log mu of every row's action.
        values: ``[T+1, B]`` the acting key's critic at every row (detached here).

    Returns:
        :class:`impala_rl.vtrace.VTraceReturns` over ``[L, B]``; entries that are not
        ``seq.trainable`` have ``vs = V`` and a zero advantage (weight 0), so an open last
        decision bootstraps the one before it and padding contributes nothing.
    """
    T = behaviour_log_prob.shape[0]
    rows = seq.rows
    v = torch.where(seq.valid, values.detach().gather(0, rows), torch.zeros_like(seq.rewards))
    behaviour = behaviour_log_prob.gather(0, rows.clamp(max=T - 1))
    log_rhos = target_log_prob.detach().gather(0, rows) - behaviour
    log_rhos = torch.where(seq.trainable, log_rhos, torch.full_like(log_rhos, float("-inf")))
    return vtrace.from_importance_weights(
        log_rhos,
        seq.discounts,
        seq.rewards,
        v,
        torch.zeros_like(v[0]),
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
        clip_c_threshold=clip_c_threshold,
        lambda_=lambda_,
    )
