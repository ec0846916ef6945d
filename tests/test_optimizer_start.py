"""RMSProp's starting mean square and the learning-rate warm-up, against the formulas."""

import pytest
import torch

from impala_rl.config import ImpalaAlgorithmConfig, load_config
from impala_rl.learner import make_optimizer, scheduled_lr


def _two_steps(cfg: ImpalaAlgorithmConfig, grads: list[torch.Tensor]) -> torch.Tensor:
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))
    opt = make_optimizer(model, cfg)
    for g in grads:
        model.weight.grad = g.clone()
        opt.step()
    return model.weight.detach().clone()


@pytest.mark.parametrize("start", [0.0, 1.0, 2.5e-6])
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_rmsprop_steps_follow_the_formula_from_the_configured_mean_square(start, momentum):
    cfg = ImpalaAlgorithmConfig(
        optimizer="rmsprop",
        lr=1e-2,
        rmsprop_alpha=0.9,
        rmsprop_momentum=momentum,
        optimizer_eps=1e-5,
        rmsprop_initial_square_avg=start,
    )
    grads = [torch.tensor([[1e-3, -2e-3, 0.5]]), torch.tensor([[3e-3, 1e-3, -0.25]])]
    p = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    v = torch.full_like(p, start)
    buf = torch.zeros_like(p)
    for g in grads:
        v = 0.9 * v + 0.1 * g.double() ** 2
        step = g.double() / (v.sqrt() + 1e-5)
        buf = momentum * buf + step if momentum else step
        p = p - 1e-2 * buf
    torch.testing.assert_close(_two_steps(cfg, grads).double(), p, rtol=1e-5, atol=1e-7)


def test_a_mean_square_started_at_one_makes_the_first_step_small():
    grads = [torch.tensor([[1e-3, -1e-3, 1e-3]])]
    base = dict(optimizer="rmsprop", lr=1e-2, optimizer_eps=1e-5)
    from_zero = _two_steps(ImpalaAlgorithmConfig(**base), grads)
    from_one = _two_steps(ImpalaAlgorithmConfig(**base, rmsprop_initial_square_avg=1.0), grads)
    start = torch.tensor([[0.5, -1.0, 2.0]])
    assert (from_zero - start).abs().min() > 5 * 1e-2  # ~10x the learning rate
    assert (from_one - start).abs().max() < 1e-4


def test_learning_rate_warms_up_linearly_then_follows_the_schedule():
    cfg = ImpalaAlgorithmConfig(
        lr=1e-3,
        lr_schedule="linear",
        lr_final=0.0,
        lr_decay_env_steps=1000,
        lr_warmup_env_steps=100,
    )
    assert scheduled_lr(cfg, 0, None) == 0.0
    assert scheduled_lr(cfg, 50, None) == pytest.approx(0.5 * (1e-3 * 0.95))
    assert scheduled_lr(cfg, 100, None) == pytest.approx(1e-3 * 0.9)
    assert scheduled_lr(cfg, 500, None) == pytest.approx(1e-3 * 0.5)
    constant = ImpalaAlgorithmConfig(lr=1e-3, lr_warmup_env_steps=100)
    assert scheduled_lr(constant, 25, None) == pytest.approx(2.5e-4)
    assert scheduled_lr(constant, 10_000, None) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "override, field",
    [
        ("algorithm.rmsprop_initial_square_avg=-1", "algorithm.rmsprop_initial_square_avg"),
        ("algorithm.lr_warmup_env_steps=-5", "algorithm.lr_warmup_env_steps"),
    ],
)
def test_negative_settings_are_refused_naming_the_field(override, field):
    with pytest.raises(Exception, match=field.replace(".", r"\.")):
        load_config("cartpole", [override])
