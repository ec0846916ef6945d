"""Tests for impala_rl.losses."""

from __future__ import annotations

import math

import pytest
import torch

from batches import vector_batch
from impala_rl import losses


def test_policy_gradient_loss_value():
    log_probs = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]])
    advantages = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    # -(( -0.5*1) + (-1*-2) + (-2*0.5) + (-0.1*3)) / 4 = -(-0.5 + 2 - 1 - 0.3) / 4
    expected = -(-0.5 + 2.0 - 1.0 - 0.3) / 4
    loss = losses.policy_gradient_loss(log_probs, advantages)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected)


def test_policy_gradient_loss_is_mean_not_sum():
    log_probs = torch.full((3, 2), -1.0)
    advantages = torch.ones(3, 2)
    assert losses.policy_gradient_loss(log_probs, advantages).item() == pytest.approx(1.0)
    # Doubling T leaves the loss unchanged.
    assert losses.policy_gradient_loss(
        log_probs.repeat(2, 1), advantages.repeat(2, 1)
    ).item() == pytest.approx(1.0)


def test_policy_gradient_loss_gradients():
    log_probs = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0], [0.5, 3.0]], requires_grad=True)
    losses.policy_gradient_loss(log_probs, advantages).backward()
    torch.testing.assert_close(log_probs.grad, -advantages.detach() / 4)
    assert advantages.grad is None


def test_baseline_loss_value_and_gradients():
    vs = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
    values = torch.tensor([[0.0, 2.5], [1.0, 1.0]], requires_grad=True)
    loss = losses.baseline_loss(vs, values)
    # 0.5 * mean([1, 0.25, 4, 4]) = 0.5 * 9.25 / 4
    assert loss.item() == pytest.approx(0.5 * 9.25 / 4)
    loss.backward()
    # d/dV 0.5 * mean((vs - V)^2) = -(vs - V) / N
    torch.testing.assert_close(values.grad, -(vs.detach() - values.detach()) / 4)
    assert vs.grad is None


def test_entropy_loss_value_and_gradient():
    entropy = torch.tensor([[1.0, 0.5], [0.25, 0.25]], requires_grad=True)
    loss = losses.entropy_loss(entropy)
    assert loss.item() == pytest.approx(-2.0 / 4)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.full((2, 2), -0.25))


def test_entropy_floor_loss_against_the_hinge_element_by_element():
    """``mean(max(floor - H, 0))``: decisions above the floor add nothing and get no gradient;
    each one below adds its shortfall and gets ``-1/N``."""
    entropy = torch.tensor([[1.0, 0.05], [0.2, 0.0]], requires_grad=True)
    floor = 0.1
    shortfall = [max(floor - h, 0.0) for h in (1.0, 0.05, 0.2, 0.0)]
    loss = losses.entropy_floor_loss(entropy, floor)
    assert loss.item() == pytest.approx(sum(shortfall) / 4)
    loss.backward()
    expected = torch.tensor([[0.0, -0.25], [0.0, -0.25]])
    torch.testing.assert_close(entropy.grad, expected)


def test_entropy_floor_loss_raises_a_near_deterministic_policy_entropy():
    """Descent on the floor's penalty moves a policy below the floor towards more entropy and
    leaves one above it where it is."""
    logits = torch.tensor([[[9.0, 0.0, 0.0]], [[0.5, 0.0, 0.0]]], requires_grad=True)

    def entropy_of(z: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(z, dim=-1)
        return -(log_p.exp() * log_p).sum(-1)

    before = entropy_of(logits)
    losses.entropy_floor_loss(before, 0.1).backward()
    with torch.no_grad():
        after = entropy_of(logits - 10.0 * logits.grad)
    assert before[0, 0] < 0.1 < before[1, 0]
    assert after[0, 0] > before[0, 0]
    assert after[1, 0] == before[1, 0]


def test_entropy_loss_from_policy_decreases_towards_uniform():
    """Gradient descent on entropy_loss pushes logits towards the uniform policy."""
    logits = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    losses.entropy_loss(entropy).backward()
    with torch.no_grad():
        new_logits = logits - 0.1 * logits.grad
    new_log_p = torch.log_softmax(new_logits, dim=-1)
    new_entropy = -(new_log_p.exp() * new_log_p).sum(-1)
    assert new_entropy.item() > entropy.item()


def _clipped_surrogate_reference(
    log_ratio: list[list[float]], advantages: list[list[float]], clip: float
) -> tuple[float, list[list[float]]]:
    """The surrogate and its gradient in log_ratio, element by element in plain Python.

    Per element: the objective is r * A unless clipping binds (r outside [1 - eps, 1 + eps]
    on the side where the clipped term is the smaller one), where it is the constant
    clip(r) * A. d(r * A)/d log r = r * A."""
    n = sum(len(row) for row in log_ratio)
    total, grad = 0.0, []
    for lr_row, a_row in zip(log_ratio, advantages, strict=True):
        grad_row = []
        for lr, a in zip(lr_row, a_row, strict=True):
            r = math.exp(lr)
            clipped = min(max(r, 1.0 - clip), 1.0 + clip)
            unclipped_term, clipped_term = r * a, clipped * a
            total += min(unclipped_term, clipped_term)
            binds = clipped_term < unclipped_term
            grad_row.append(0.0 if binds else -r * a / n)
        grad.append(grad_row)
    return -total / n, grad


@pytest.mark.parametrize("clip", [0.1, 0.4, 100.0])
def test_clipped_surrogate_loss_matches_a_per_element_reference(clip):
    gen = torch.Generator().manual_seed(0)
    log_ratio = (0.6 * torch.randn(7, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(7, 5, generator=gen, dtype=torch.float64).requires_grad_()
    loss = losses.clipped_surrogate_loss(log_ratio, advantages, clip)
    expected, expected_grad = _clipped_surrogate_reference(
        log_ratio.tolist(), advantages.tolist(), clip
    )
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(log_ratio.grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert advantages.grad is None


def test_clipped_surrogate_loss_clips_on_the_side_of_the_advantage():
    # r = 2 (log 2): a positive advantage is capped at 1 + clip; a negative one is not
    log_ratio = torch.full((1, 2), math.log(2.0), requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0]])
    loss = losses.clipped_surrogate_loss(log_ratio, advantages, 0.2)
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 2.0 * -1.0) / 2)
    loss.backward()
    torch.testing.assert_close(log_ratio.grad, torch.tensor([[0.0, 2.0 / 2]]))


def test_clipped_surrogate_loss_at_ratio_one_has_the_policy_gradient_losss_gradient():
    log_probs = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    losses.clipped_surrogate_loss(log_probs - log_probs.detach(), advantages, 0.4).backward()
    surrogate_grad = log_probs.grad.clone()
    log_probs.grad = None
    losses.policy_gradient_loss(log_probs, advantages).backward()
    torch.testing.assert_close(surrogate_grad, log_probs.grad)


@pytest.mark.parametrize(
    "fn",
    [
        losses.policy_gradient_loss,
        losses.baseline_loss,
        lambda a, b: losses.clipped_surrogate_loss(a, b, 0.2),
    ],
)
def test_shape_mismatch_raises(fn):
    with pytest.raises(ValueError, match="same shape"):
        fn(torch.zeros(4, 3), torch.zeros(4, 1))


def test_reward_clipping_modes_constant():
    assert losses.REWARD_CLIPPING_MODES == ("none", "abs_one", "soft_asymmetric")


def test_clip_rewards_none_is_identity():
    r = torch.tensor([-10.0, -0.5, 0.0, 0.5, 10.0])
    torch.testing.assert_close(losses.clip_rewards(r, "none"), r)


def test_clip_rewards_abs_one():
    r = torch.tensor([-10.0, -1.0, -0.5, 0.0, 0.5, 1.0, 10.0])
    expected = torch.tensor([-1.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.0])
    torch.testing.assert_close(losses.clip_rewards(r, "abs_one"), expected)


def test_clip_rewards_soft_asymmetric_exact():
    r = torch.tensor([-10.0, -1.0, 0.0, 1.0, 10.0], dtype=torch.float64)
    expected = torch.tensor(
        [
            5 * 0.3 * math.tanh(-2.0),
            5 * 0.3 * math.tanh(-0.2),
            0.0,
            5 * math.tanh(0.2),
            5 * math.tanh(2.0),
        ],
        dtype=torch.float64,
    )
    out = losses.clip_rewards(r, "soft_asymmetric")
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float64
    # Bounded in (-1.5, 5) for any reward.
    big = losses.clip_rewards(torch.tensor([-1e6, 1e6]), "soft_asymmetric")
    torch.testing.assert_close(big, torch.tensor([-1.5, 5.0]))


def test_clip_rewards_preserves_shape():
    r = torch.randn(5, 3) * 10
    for mode in losses.REWARD_CLIPPING_MODES:
        assert losses.clip_rewards(r, mode).shape == (5, 3)


def test_clip_rewards_unknown_mode():
    with pytest.raises(ValueError, match="soft_asymmetric") as excinfo:
        losses.clip_rewards(torch.zeros(3), "tanh")
    message = str(excinfo.value)
    assert "'tanh'" in message
    for mode in losses.REWARD_CLIPPING_MODES:
        assert mode in message


def test_normalize_advantages_matches_a_reference():
    gen = torch.Generator().manual_seed(3)
    adv = 5.0 + 3.0 * torch.randn(6, 4, generator=gen, dtype=torch.float64)
    values = adv.flatten().tolist()
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    expected = torch.tensor([(v - mean) / (std + 1e-8) for v in values], dtype=torch.float64)
    torch.testing.assert_close(losses.normalize_advantages(adv).flatten(), expected)
    assert losses.normalize_advantages(torch.tensor([[2.5]])).item() == 0.0


def test_the_learner_normalizes_advantages_when_asked(monkeypatch):
    """``algorithm.normalize_advantages``: the policy loss sees advantages of mean 0, std 1."""
    import gymnasium as gym

    from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
    from impala_rl.learner import Learner
    from impala_rl.nn.factory import build_model

    seen = []
    pg = losses.policy_gradient_loss

    def recording(log_probs, advantages):
        seen.append(advantages.detach().clone())
        return pg(log_probs, advantages)

    monkeypatch.setattr(losses, "policy_gradient_loss", recording)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(hidden_sizes=[8]), gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2)
    )
    batch = vector_batch(5, 4)
    batch["reward"] = 10.0 + batch["reward"]
    for flag in (False, True):
        Learner(model, ImpalaAlgorithmConfig(normalize_advantages=flag)).update(batch)
    plain, normalized = seen
    assert plain.mean() > 1.0  # rewards of ~10: large positive advantages
    assert abs(normalized.mean().item()) < 1e-6 and normalized.std().item() == pytest.approx(1.0)
