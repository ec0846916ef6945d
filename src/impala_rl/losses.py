"""IMPALA learner losses and reward clipping (Espeholt et al. 2018, section 4.2).

All losses take time-major ``[T, B]`` tensors and return a scalar. They are **means** over time
and batch, so their scale (and hence the right learning rate / loss coefficients) does not depend
on the unroll length or the batch size.
"""

from __future__ import annotations

import torch

from impala_rl.config import REWARD_CLIPPING_MODES

__all__ = [
    "REWARD_CLIPPING_MODES",
    "baseline_loss",
    "clip_rewards",
    "clipped_surrogate_loss",
    "entropy_floor_loss",
    "entropy_loss",
    "normalize_advantages",
    "policy_gradient_loss",
]


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    # Guard against silent broadcasting (e.g. [T, B] * [T, 1]).
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def policy_gradient_loss(action_log_probs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``-mean(log pi(a_t|x_t) * A_t)``.

    Args:
        action_log_probs: ``[T, B]`` log-probabilities of the taken actions (with gradient).
        advantages: ``[T, B]`` V-trace advantages; detached here, they are constants.

    Returns:
        Scalar; mean over time and batch so the scale does not depend on unroll length or
        batch size.
    """
    _check_same_shape("action_log_probs", action_log_probs, "advantages", advantages)
    return -(action_log_probs * advantages.detach()).mean()


def clipped_surrogate_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's clipped surrogate, as APPO and IMPACT use it on V-trace advantages:
    ``-mean(min(r_t * A_t, clip(r_t, 1 - clip, 1 + clip) * A_t))`` with ``r_t = exp(log_ratio)``.

    Args:
        log_ratio: ``[T, B]`` ``log pi(a_t|x_t) - log pi_target(a_t|x_t)``, with gradient
            through the trained policy's term.
        advantages: ``[T, B]`` V-trace advantages; detached here, they are constants.
        clip: the clip range (``> 0``).

    Returns:
        Scalar mean over time and batch. Where the ratio is 1 its gradient is the policy
        gradient's, ``-mean(A_t * grad log pi(a_t|x_t))``.
    """
    _check_same_shape("log_ratio", log_ratio, "advantages", advantages)
    advantages = advantages.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def baseline_loss(vs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``0.5 * mean((v_s - V(x_s))^2)``: regress the baseline towards the V-trace targets.

    Args:
        vs: ``[T, B]`` V-trace targets; detached, gradient flows only into ``values``.
        values: ``[T, B]`` baseline predictions ``V(x_s)``.
    """
    _check_same_shape("vs", vs, "values", values)
    return 0.5 * (vs.detach() - values).pow(2).mean()


def entropy_loss(entropy: torch.Tensor) -> torch.Tensor:
    """``-mean(H(pi(.|x_t)))``: minimising it maximises policy entropy (exploration bonus).

    Args:
        entropy: ``[T, B]`` per-step policy entropies.
    """
    return -entropy.mean()


def entropy_floor_loss(entropy: torch.Tensor, floor: float) -> torch.Tensor:
    """``mean(max(floor - H(pi(.|x_t)), 0))``: zero for a decision whose policy keeps at least
    ``floor`` nats of entropy; below it, minimising raises that decision's entropy alone.

    Args:
        entropy: ``[T, B]`` per-step policy entropies.
        floor: the entropy (nats) each decision keeps.
    """
    return (floor - entropy).clamp(min=0.0).mean()


def clip_rewards(rewards: torch.Tensor, mode: str) -> torch.Tensor:
    """Clip/squash rewards before computing V-trace targets.

    Modes:
        ``"none"``: identity (returns ``rewards`` itself).
        ``"abs_one"``: clamp to ``[-1, 1]``.
        ``"soft_asymmetric"``: as in the IMPALA reference agent,
            ``5 * where(r < 0, 0.3 * tanh(r / 5), tanh(r / 5))``; squashes large rewards
            smoothly and down-weights negative ones.

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode == "none":
        return rewards
    if mode == "abs_one":
        return torch.clamp(rewards, -1.0, 1.0)
    if mode == "soft_asymmetric":
        squeezed = torch.tanh(rewards / 5.0)
        return 5.0 * torch.where(rewards < 0, 0.3 * squeezed, squeezed)
    raise ValueError(
        f"unknown reward clipping mode {mode!r}; valid modes are {', '.join(REWARD_CLIPPING_MODES)}"
    )


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over every entry of ``advantages [T, B]`` (PPO's
    per-minibatch normalization, as Stable-Baselines3 and CleanRL compute it: the sample
    standard deviation). A single entry is only centred."""
    centred = advantages - advantages.mean()
    if advantages.numel() < 2:
        return centred
    return centred / (advantages.std() + eps)
