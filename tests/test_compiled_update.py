"""The compiled update (``algorithm.compile_update``): the eager update's steps, up to float
rounding, from one fused program; and PopArt's statistics, which now move after the backward."""

from __future__ import annotations

import copy
import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch

from batches import vector_batch
from impala_rl.config import (
    COMPILE_MIN_STEPS,
    ImpalaAlgorithmConfig,
    ModelConfig,
    compile_pays,
    load_config,
    planned_optimizer_steps,
)
from impala_rl.learner import Learner, has_pixel_convolutions
from impala_rl.nn.factory import build_model
from impala_rl.nn.popart import PopArtValueHead


def _vector_model(core: str = "none", popart: bool = True):
    torch.manual_seed(0)
    return build_model(
        ModelConfig(
            hidden_sizes=[32, 32],
            core=core,
            lstm_hidden_size=16,
            shared_torso=core != "none",
            popart=popart,
        ),
        gym.spaces.Box(-5, 5, (3,)),
        gym.spaces.Discrete(2),
    )


def test_popart_statistics_moved_after_the_backward_are_the_in_place_move():
    """``moved_statistics`` then ``set_statistics`` (the learner's order now) leaves the head
    exactly as ``update_statistics`` then ``preserve_outputs`` did, and the statistics stay
    put until they are set."""
    torch.manual_seed(0)
    a = PopArtValueHead(8, beta=0.1)
    b = copy.deepcopy(a)
    targets = torch.randn(50) * 20 + 7
    mu, nu = b.moved_statistics(targets)
    assert float(b.mu) == 0.0 and float(b.nu) == 1.0, "moving returns new statistics"
    a.preserve_outputs(*a.update_statistics(targets))
    b.set_statistics(mu, nu)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_popart_statistics_do_not_move_when_no_learner_has_targets():
    head = PopArtValueHead(4)
    mu, nu = head.moved_statistics(torch.empty(0), all_sum=lambda x: x)
    assert float(mu) == 0.0 and float(nu) == 1.0


def test_the_compiled_update_gives_the_eager_updates_weights():
    """APPO with PopArt, two passes of two minibatches, a burn-in batch, the entropy
    coefficient and the learning rate moving between batches: the compiled learner's losses,
    gradient norms and weights follow the eager one's to float rounding."""
    cfg = ImpalaAlgorithmConfig(
        lr=1e-3, optimizer="adam", policy_loss="appo", num_passes=2, num_minibatches=2
    )
    model = _vector_model()
    eager = Learner(copy.deepcopy(model), cfg, capture=False)
    compiled = Learner(copy.deepcopy(model), dataclasses.replace(cfg, compile_update=True))
    torch.manual_seed(1)
    batches = [vector_batch(8, 4) for _ in range(3)]
    for i, batch in enumerate(batches):
        for learner in (eager, compiled):
            learner.entropy_coef = 0.01 * (i + 1)
            learner.set_learning_rate(1e-3 / (i + 1))
        for n in range(cfg.num_passes):
            torch.manual_seed(100 * i + n)  # the same minibatch order for both
            blocks_eager = list(eager.minibatches(batch))
            torch.manual_seed(100 * i + n)
            for a, b in zip(blocks_eager, list(compiled.minibatches(batch)), strict=True):
                train_policy = i > 0  # the first batch is critic burn-in (eager in both)
                sa = eager.update(a, train_policy=train_policy, fresh=n == 0)
                sb = compiled.update(b, train_policy=train_policy, fresh=n == 0)
                assert sb.total_loss == pytest.approx(sa.total_loss, rel=1e-4, abs=1e-6)
                assert sb.grad_norm == pytest.approx(sa.grad_norm, rel=1e-4, abs=1e-6)
                assert sb.policy_entropy == pytest.approx(sa.policy_entropy, rel=1e-4)
    assert compiled.compiled is True and eager.compiled is False
    for (name, x), y in zip(
        eager.model.state_dict().items(), compiled.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(next(iter(eager.model.parameters())), next(iter(model.parameters()))), (
        "the updates moved the weights"
    )


def test_an_lstm_core_is_not_compiled_and_trains_eagerly(caplog):
    cfg = ImpalaAlgorithmConfig(lr=1e-3, compile_update=True)
    learner = Learner(_vector_model(core="lstm"), cfg)
    assert learner.compiled is None, "wanted, decided at the first update"
    batch = vector_batch(8, 4)
    batch["core_h"], batch["core_c"] = torch.zeros(1, 4, 16), torch.zeros(1, 4, 16)
    with caplog.at_level("WARNING"):
        learner.update(batch)
    assert learner.compiled is False and learner.num_updates == 1
    # asked for by name, so the log says why it runs eagerly
    assert "compile_update: the update runs eagerly: the LSTM core" in caplog.text


def test_compile_update_null_compiles_an_mlp_or_a_grid_cnn_only_on_a_long_run():
    cfg = ImpalaAlgorithmConfig(compile_update=None)
    mlp = _vector_model()
    cnn = build_model(
        ModelConfig(encoder="nature_cnn"),
        gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
        gym.spaces.Discrete(6),
    )
    grid = build_model(  # the minigrid preset's encoder: convolutions over a 7x7 view
        ModelConfig(encoder="impala_rl.nn.grid:GridEncoder"),
        gym.spaces.Box(0, 10, (3, 7, 7), np.uint8),
        gym.spaces.Discrete(7),
    )
    assert not has_pixel_convolutions(mlp) and has_pixel_convolutions(cnn)
    assert not has_pixel_convolutions(grid), "a grid's small CNN is overhead-bound"
    assert Learner(grid, cfg, planned_steps=COMPILE_MIN_STEPS).compiled is None  # wanted
    assert compile_pays(False, COMPILE_MIN_STEPS) and not compile_pays(False, COMPILE_MIN_STEPS - 1)
    assert not compile_pays(True, float("inf")), "a CNN's step is not per-op overhead"
    assert Learner(mlp, cfg, planned_steps=COMPILE_MIN_STEPS).compiled is None  # wanted
    assert Learner(mlp, cfg, planned_steps=100).compiled is False
    assert Learner(mlp, ImpalaAlgorithmConfig(), planned_steps=1e9).compiled is False


def test_a_run_plans_its_optimizer_steps_from_its_budget():
    cfg = load_config(
        "cartpole",
        [
            "max_env_steps=64000",
            "algorithm.actors_batch_size=2",
            "algorithm.envs_per_actor=8",
            "algorithm.n_rollout_steps=20",
            "algorithm.num_passes=3",
            "algorithm.num_minibatches=4",
        ],
    )
    assert planned_optimizer_steps(cfg) == 64000 / 320 * 12
    cfg.max_env_steps = None
    assert planned_optimizer_steps(cfg) == float("inf")


def test_a_compile_that_fails_falls_back_to_the_eager_update_and_says_why(monkeypatch, caplog):
    """No C++ compiler for inductor (or a Python dynamo does not support) must not cost a
    user's first run: the update runs eagerly, takes the eager step, and the log says why."""

    def failing_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    cfg = ImpalaAlgorithmConfig(lr=1e-3, optimizer="adam", policy_loss="appo")
    model = _vector_model()
    eager = Learner(copy.deepcopy(model), cfg)
    fallback = Learner(copy.deepcopy(model), dataclasses.replace(cfg, compile_update=True))
    torch.manual_seed(3)
    batch = vector_batch(8, 4)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            sa, sb = eager.update(batch), fallback.update(batch)
            assert sb.total_loss == sa.total_loss
    assert fallback.compiled is False and fallback.num_updates == 2
    assert "could not be compiled (RuntimeError: InvalidCxxCompiler" in caplog.text
    assert "algorithm.compile_update=false" in caplog.text
    for (name, x), y in zip(
        eager.model.state_dict().items(), fallback.model.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


def test_an_encoder_that_breaks_the_graph_trains_eagerly_and_says_so(caplog):
    """A user's torso that reads a number to the host cannot be one program; compiled anyway,
    its backward ran outside the traced program and no weight moved. The compile now fails
    at the first update and the learner steps eagerly: the eager learner's weights."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(encoder="user_nets:HostReadTorso"),
        gym.spaces.Box(-5, 5, (3,)),
        gym.spaces.Discrete(2),
    )
    cfg = ImpalaAlgorithmConfig(lr=1e-3, optimizer="adam")
    eager = Learner(copy.deepcopy(model), cfg, capture=False)
    compiled = Learner(copy.deepcopy(model), dataclasses.replace(cfg, compile_update=True))
    torch.manual_seed(1)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            batch = vector_batch(8, 4)
            sa = eager.update(batch)
            sb = compiled.update(copy.deepcopy(batch))
            assert sb.grad_norm == pytest.approx(sa.grad_norm, rel=1e-6) and sb.grad_norm > 0
    assert compiled.compiled is False
    assert "could not be compiled" in caplog.text and "runs eagerly" in caplog.text
    for (name, x), y in zip(
        eager.model.state_dict().items(), compiled.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, msg=name)
    assert not torch.equal(next(iter(compiled.model.parameters())), next(iter(model.parameters())))


def test_a_tuple_or_dict_action_compiles_into_one_program():
    """A composite action's update compiles whole (no graph break) and steps as eagerly."""
    space = gym.spaces.Dict(
        {"pick": gym.spaces.Discrete(3), "amount": gym.spaces.Box(-1, 1, (1,), np.float32)}
    )
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_sizes=[16]), gym.spaces.Box(-5, 5, (3,)), space)
    cfg = ImpalaAlgorithmConfig(lr=1e-3, optimizer="adam")
    eager = Learner(copy.deepcopy(model), cfg, capture=False)
    compiled = Learner(copy.deepcopy(model), dataclasses.replace(cfg, compile_update=True))
    torch.manual_seed(1)
    for _ in range(2):
        batch = vector_batch(8, 4)
        batch["action"] = torch.cat(  # amount, pick (the Dict's key order)
            [torch.randn(9, 4, 1), torch.randint(0, 3, (9, 4, 1)).float()], dim=-1
        )
        sa = eager.update(batch)
        sb = compiled.update(copy.deepcopy(batch))
        assert sb.grad_norm == pytest.approx(sa.grad_norm, rel=1e-4) and sb.grad_norm > 0
    assert compiled.compiled is True
    for (name, x), y in zip(
        eager.model.state_dict().items(), compiled.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
