"""PopArt: outputs preserved across statistics updates; updates invariant to the reward's scale."""

from __future__ import annotations

import copy

import gymnasium as gym
import pytest
import torch

from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
from impala_rl.envs import EnvFactory
from impala_rl.learner import Learner
from impala_rl.nn.factory import build_model
from impala_rl.nn.popart import PopArtValueHead
from impala_rl.rollout import ActorLoop, rollout_spec_for


def test_a_statistics_update_preserves_the_unnormalized_outputs():
    torch.manual_seed(0)
    head = PopArtValueHead(5, beta=0.5)
    x = torch.randn(32, 5)
    before = head(x).detach()
    old_mu, old_sigma = head.update_statistics(torch.randn(200) * 50 + 300)
    assert float(head.mu) != float(old_mu) and float(head.sigma) != float(old_sigma)
    changed = head(x).detach()
    assert not torch.allclose(changed, before)  # without the rescale the outputs would move
    head.preserve_outputs(old_mu, old_sigma)
    torch.testing.assert_close(head(x).detach(), before, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sigma_min", [1e-4, 1.0])
def test_the_scale_never_goes_under_its_floor(sigma_min):
    """Targets of spread 0.2 give the scale 0.2, or the floor above it; outputs preserved."""
    torch.manual_seed(0)
    head = PopArtValueHead(5, beta=1.0, sigma_min=sigma_min)
    x = torch.randn(32, 5)
    before = head(x).detach()
    targets = torch.randn(10_000) * 0.2 + 0.5
    head.set_statistics(*head.moved_statistics(targets))
    assert float(head.sigma) == pytest.approx(max(0.2, sigma_min), rel=0.02)
    assert float(head.mu) == pytest.approx(0.5, abs=0.01)
    torch.testing.assert_close(head(x).detach(), before, rtol=1e-5, atol=1e-5)


def test_a_models_popart_heads_take_the_configured_floor():
    model = build_model(
        ModelConfig(hidden_sizes=[8], popart=True, popart_sigma_min=0.5),
        gym.spaces.Box(-1, 1, (3,)),
        gym.spaces.Discrete(2),
    )
    assert [h.sigma_min for h in model.popart_heads().values()] == [0.5]
    assert float(model.critics["0"].head.sigma) == 1.0  # nu starts at 1: above the floor


def _batch(model, scale: float) -> dict[str, torch.Tensor]:
    """One CartPole unroll of ``model`` (4 envs x T 8, time-limit truncations), rewards times
    ``scale``."""
    factory = EnvFactory("CartPole-v1", {}, max_episode_steps=6)
    env = factory()
    spec = rollout_spec_for(model, env.observation_space, 8, 4)
    env.close()
    loop = ActorLoop(factory, 4, copy.deepcopy(model), seed=0, unroll_length=8)
    slot = spec.allocate()
    loop.unroll(slot)
    loop.close()
    slot["reward"] = slot["reward"] * scale  # truncation_value is the acting model's value
    assert slot["truncated"].any()
    return slot


def _grads_after_update(model, batch) -> list[torch.Tensor]:
    cfg = ImpalaAlgorithmConfig(reward_clipping="none", max_grad_norm=None)
    learner = Learner(model, cfg)
    learner.update({k: v.clone() for k, v in batch.items()})
    return [p.grad.clone() for p in model.policy_parameters()]


@pytest.mark.parametrize("popart", [True, False])
def test_policy_gradient_is_invariant_to_the_reward_scale_with_popart(popart):
    """Rewards x100 with PopArt statistics x100 (adapted to that scale): the same policy
    gradient. Without PopArt the same rescaling changes it."""
    space = gym.spaces.Box(-5, 5, (4,))
    torch.manual_seed(1)
    small = build_model(
        ModelConfig(hidden_sizes=[16], popart=popart), space, gym.spaces.Discrete(2)
    )
    if popart:
        small.critics["0"].head.mu.fill_(3.0)
        small.critics["0"].head.nu.fill_(3.0**2 + 2.0**2)  # sigma 2
    large = copy.deepcopy(small)
    if popart:
        large.critics["0"].head.mu.mul_(100.0)  # values x100, the normalized layer unchanged
        large.critics["0"].head.nu.mul_(100.0**2)
    grads_small = _grads_after_update(small, _batch(small, 1.0))
    grads_large = _grads_after_update(large, _batch(large, 100.0))
    same = all(
        torch.allclose(a, b, rtol=1e-3, atol=1e-6)
        for a, b in zip(grads_small, grads_large, strict=True)
    )
    assert same is popart
    if popart:
        torch.testing.assert_close(large.critics["0"].head.mu, small.critics["0"].head.mu * 100)
        torch.testing.assert_close(
            large.critics["0"].head.sigma, small.critics["0"].head.sigma * 100
        )


@pytest.mark.parametrize("popart", [True, False])
def test_an_update_reports_the_statistics_it_gave_each_popart_head(popart):
    """The update's ``critic_popart_mu`` / ``critic_popart_sigma`` are the head's statistics
    after it (moved towards returns of scale 100); a critic without PopArt reports none."""
    space = gym.spaces.Box(-5, 5, (4,))
    torch.manual_seed(1)
    model = build_model(
        ModelConfig(hidden_sizes=[16], popart=popart, popart_beta=0.5),
        space,
        gym.spaces.Discrete(2),
    )
    learner = Learner(model, ImpalaAlgorithmConfig(reward_clipping="none"))
    stats = learner.update(_batch(model, 100.0))
    if not popart:
        assert stats.critic_popart_mu == stats.critic_popart_sigma == {}
        return
    head = model.critics["0"].head
    assert stats.critic_popart_mu == {0: pytest.approx(float(head.mu), rel=1e-6)}
    assert stats.critic_popart_sigma == {0: pytest.approx(float(head.sigma), rel=1e-6)}
    assert stats.critic_popart_sigma[0] > 10.0  # moved from 1 towards the returns' scale
