"""algorithm.policy_loss=appo (APPO / IMPACT): the target network, the clipped surrogate against
it, minibatches over a batch's columns, its config refusals, checkpoints and a CartPole run."""

from __future__ import annotations

import copy

import gymnasium as gym
import pytest
import torch

import impala_rl
from actor_backends import stop_once_train_return_reaches
from impala_rl import checkpoint, losses, vtrace
from impala_rl.config import ConfigError, ImpalaAlgorithmConfig, ModelConfig, load_config
from impala_rl.envs import EnvFactory
from impala_rl.learner import Learner, forward_batch
from impala_rl.nn.factory import build_model
from impala_rl.rollout import ActorLoop, rollout_spec_for
from impala_rl.trainer import Trainer
from test_trainer import LEARNING_BUDGET, STEPS_PER_UPDATE

FAST = ["log.console=false", "log.tensorboard=false", "runner.backend=sequential"]
APPO = "algorithm.policy_loss=appo"


def _model(seed: int = 1):
    torch.manual_seed(seed)
    return build_model(
        ModelConfig(hidden_sizes=[16]), gym.spaces.Box(-5, 5, (4,)), gym.spaces.Discrete(2)
    )


def _batch(
    model, n_envs: int = 4, T: int = 8, env_id: str = "CartPole-v1"
) -> dict[str, torch.Tensor]:
    """One unroll of ``model`` on ``env_id`` (``n_envs`` columns of ``T`` steps)."""
    factory = EnvFactory(env_id, {}, max_episode_steps=20)
    env = factory()
    spec = rollout_spec_for(model, env.observation_space, T, n_envs)
    env.close()
    loop = ActorLoop(factory, n_envs, copy.deepcopy(model), seed=0, unroll_length=T)
    slot = spec.allocate()
    loop.unroll(slot)
    loop.close()
    return slot


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the target network --------------------------------------------------------------------------


def test_the_target_network_changes_only_at_its_update_frequency():
    model = _model()
    learner = Learner(model, ImpalaAlgorithmConfig(policy_loss="appo", target_update_frequency=3))
    assert learner.target_model is not None and learner.target_model is not learner.model
    assert not any(p.requires_grad for p in learner.target_model.parameters())
    assert _equal(_params(learner.target_model), _params(model))
    batch = _batch(model)
    target = _params(learner.target_model)
    for step in range(1, 8):
        learner.update(batch, fresh=step == 1)
        now = _params(learner.target_model)
        if step % 3:
            assert _equal(now, target), f"the target moved after step {step}"
            assert not _equal(now, _params(model))
        else:
            assert _equal(now, _params(model)), f"no hard copy after step {step}"
        target = now


def test_a_soft_target_update_moves_by_tau():
    model = _model()
    cfg = ImpalaAlgorithmConfig(policy_loss="appo", target_update_frequency=1, target_tau=0.25)
    learner = Learner(model, cfg)
    before = _params(learner.target_model)
    learner.update(_batch(model))
    for old, new, trained in zip(
        before, _params(learner.target_model), _params(model), strict=True
    ):
        torch.testing.assert_close(new, 0.75 * old + 0.25 * trained)


def test_by_default_the_target_moves_once_per_batch():
    cfg = ImpalaAlgorithmConfig(policy_loss="appo", num_passes=3, num_minibatches=2)
    assert Learner(_model(), cfg).target_update_frequency == 6
    assert Learner(_model(), ImpalaAlgorithmConfig(policy_loss="appo")).target_update_frequency == 1
    assert Learner(_model(), ImpalaAlgorithmConfig()).target_model is None


# -- the loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip_param", [1e6, 0.1])
def test_at_ratio_one_appos_gradient_is_impalas(clip_param):
    """pi_target == pi_theta: V-trace's weights are the same and the surrogate's gradient is
    the policy gradient's (d/dtheta r * A = A * dlog pi at r = 1), so every gradient is."""
    model = _model()
    batch = _batch(model)
    grads, stats = {}, {}
    for loss in ("impala", "appo"):
        cfg = ImpalaAlgorithmConfig(policy_loss=loss, clip_param=clip_param, max_grad_norm=None)
        learner = Learner(copy.deepcopy(model), cfg)
        stats[loss] = learner.update({k: v.clone() for k, v in batch.items()})
        grads[loss] = [p.grad.clone() for p in learner.model.parameters()]
    for a, b in zip(grads["impala"], grads["appo"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(bool(g.abs().sum() > 0) for g in grads["appo"])
    assert stats["appo"].vtrace_mean_rho == stats["impala"].vtrace_mean_rho
    assert stats["appo"].critic_value_loss == stats["impala"].critic_value_loss


def test_a_later_pass_clips_pi_over_pi_target_on_v_trace_advantages_from_pi_target():
    """A second pass with the target held: the learner's policy loss and gradient are the
    clipped surrogate of ``pi / pi_target`` on V-trace advantages whose importance weights are
    ``pi_target / mu``, computed here from the two networks' forward passes."""
    model = _model()
    batch = _batch(model)
    assert not batch["truncated"].any()
    clip = 0.01
    cfg = ImpalaAlgorithmConfig(
        policy_loss="appo",
        clip_param=clip,
        target_update_frequency=100,
        lr=1e-2,
        entropy_coef=0.0,
        value_loss_coef=0.0,
        max_grad_norm=None,
    )
    learner = Learner(model, cfg)
    learner.update(batch)

    trained = copy.deepcopy(learner.model)
    out = forward_batch(trained, batch)
    with torch.no_grad():
        target_log_prob = forward_batch(learner.target_model, batch).log_prob[:-1]
    vt = vtrace.from_importance_weights(
        target_log_prob - batch["behaviour_log_prob"],
        cfg.gamma * (~batch["terminated"]).float(),
        batch["reward"],
        out.value[:-1].detach(),
        out.value[-1].detach(),
    )
    log_ratio = out.log_prob[:-1] - target_log_prob
    assert not torch.allclose(log_ratio.exp(), torch.ones_like(log_ratio), atol=clip)
    expected = losses.clipped_surrogate_loss(log_ratio, vt.pg_advantages, clip)
    unclipped = losses.clipped_surrogate_loss(log_ratio, vt.pg_advantages, 1e6)
    assert (
        abs(float(expected.detach()) - float(unclipped.detach())) > 1e-4
    )  # the clip binds somewhere
    expected.backward()

    stats = learner.update(batch, fresh=False)
    assert stats.policy_loss[0] == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, want in zip(
        learner.model.policy_parameters(0), trained.policy_parameters(0), strict=True
    ):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7)


# -- minibatches ---------------------------------------------------------------------------------


def test_minibatches_split_the_columns_once_each_and_every_field_alike():
    model = _model()
    batch = _batch(model, n_envs=6)
    batch["actor_index"] = torch.arange(6)  # a column's name
    learner = Learner(model, ImpalaAlgorithmConfig(policy_loss="appo", num_minibatches=3))
    for _ in range(2):  # a fresh shuffle per pass
        blocks = list(learner.minibatches(batch))
        assert len(blocks) == 3
        seen = torch.cat([b["actor_index"] for b in blocks])
        assert sorted(seen.tolist()) == list(range(6))
        for b in blocks:
            cols = b["actor_index"]
            assert b.keys() == {*batch.keys(), "target_log_prob"}
            for name, v in batch.items():
                axis = 0 if v.ndim == 1 else 1
                assert b[name].shape[axis] == 2
                torch.testing.assert_close(b[name], batch[name].index_select(axis, cols))
    impala = Learner(model, ImpalaAlgorithmConfig())
    assert list(impala.minibatches(batch)) == [batch]
    (whole,) = Learner(model, ImpalaAlgorithmConfig(policy_loss="appo")).minibatches(batch)
    assert whole.keys() == {*batch.keys(), "target_log_prob"}
    assert all(whole[name] is v for name, v in batch.items())


def _count_target_forwards(monkeypatch, learner: Learner) -> list[int]:
    import impala_rl.learner as learner_module

    calls = [0]
    forward = learner_module.forward_batch

    def counting(model, batch):
        calls[0] += model is learner.target_model
        return forward(model, batch)

    monkeypatch.setattr(learner_module, "forward_batch", counting)
    return calls


def test_the_passes_over_a_batch_share_one_forward_pass_of_the_target(monkeypatch):
    """3 passes x 2 minibatches, the target moved once per batch: one target forward per
    batch, and the same steps as when every step computes the target's log-probs itself."""
    model = _model()
    cfg = ImpalaAlgorithmConfig(policy_loss="appo", num_passes=3, num_minibatches=2)
    shared, own = Learner(copy.deepcopy(model), cfg), Learner(copy.deepcopy(model), cfg)
    calls = _count_target_forwards(monkeypatch, shared)
    for i, batch in enumerate([_batch(model), _batch(model, T=6)]):
        for learner in (shared, own):
            torch.manual_seed(i)  # the same shuffles
            for n in range(cfg.num_passes):
                for block in learner.minibatches(batch):
                    target_log_prob = block.pop("target_log_prob")
                    if learner is shared:
                        block["target_log_prob"] = target_log_prob
                    learner.update(block, fresh=n == 0)
        assert calls[0] == i + 1  # the target moved after the batch's sixth step
    torch.testing.assert_close(_params(shared.model), _params(own.model))
    torch.testing.assert_close(_params(shared.target_model), _params(own.target_model))


def test_each_step_sees_the_target_of_that_step():
    """2 passes x 2 minibatches (4 steps per batch). Moving every step, the target's
    log-probs are computed at each step; moving every 6th step (once in the second batch's
    second pass) they are attached, and after the move they are the moved target's."""
    model = _model()
    for frequency, attached in ((1, False), (6, True)):
        cfg = ImpalaAlgorithmConfig(
            policy_loss="appo", num_passes=2, num_minibatches=2, target_update_frequency=frequency
        )
        learner = Learner(copy.deepcopy(model), cfg)
        for batch in (_batch(model), _batch(model, T=6)):
            for n in range(cfg.num_passes):
                for block in learner.minibatches(batch):
                    assert ("target_log_prob" in block) is attached
                    if attached:
                        expected = forward_batch(learner.target_model, block).log_prob
                        torch.testing.assert_close(block["target_log_prob"], expected)
                    learner.update(block, fresh=n == 0)
        assert learner.num_updates == 8


def test_minibatches_that_do_not_divide_the_columns_are_refused_at_update_time():
    model = _model()
    learner = Learner(model, ImpalaAlgorithmConfig(policy_loss="appo", num_minibatches=4))
    with pytest.raises(ConfigError, match=r"algorithm\.num_minibatches.*6 columns"):
        next(learner.minibatches(_batch(model, n_envs=6)))


def test_the_trainer_takes_one_step_per_minibatch_and_each_pass_covers_every_column(tmp_path):
    """cartpole preset: 1 actor's rollout of 4 envs per batch; 2 passes of 2 minibatches."""
    seen: list[tuple[torch.Tensor, bool, int]] = []
    update = Learner.update

    def recording_update(self, batch, train_policy=True, fresh=True, **kw):
        seen.append((batch["obs"][0].clone(), fresh, batch["first"].shape[1]))
        return update(self, batch, train_policy=train_policy, fresh=fresh, **kw)

    overrides = [
        *FAST,
        APPO,
        "algorithm.num_passes=2",
        "algorithm.num_minibatches=2",
        "algorithm.n_epochs=1",
        "algorithm.epoch_length=3",
        "target_return=null",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Learner, "update", recording_update)
        trainer = Trainer(load_config("cartpole", overrides), run_dir=tmp_path)
        summary = trainer.train()
    assert summary["updates"] == 3 * 4 and len(seen) == 3 * 4
    assert [fresh for _, fresh, _ in seen] == [True, True, False, False] * 3
    assert all(columns == 2 for _, _, columns in seen)
    for b in range(3):
        passes = [
            torch.cat([obs for obs, _, _ in seen[4 * b + 2 * p : 4 * b + 2 * p + 2]])
            for p in (0, 1)
        ]
        rows = [sorted(map(tuple, obs.tolist())) for obs in passes]
        assert len(set(rows[0])) == 4  # every column once
        assert rows[0] == rows[1]
    # once per batch (the default): the target is the trained model after each batch's steps
    assert _equal(_params(trainer.learner.target_model), _params(trainer.learner.model))


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["algorithm.clip_param=0"], "algorithm.clip_param"),
        (["algorithm.clip_param=-0.2"], "algorithm.clip_param"),
        (["algorithm.policy_loss=ppo"], "algorithm.policy_loss"),
        (["algorithm.num_minibatches=0"], "algorithm.num_minibatches"),
        (["algorithm.target_update_frequency=0"], "algorithm.target_update_frequency"),
        (["algorithm.target_tau=0"], "algorithm.target_tau"),
        (["algorithm.target_tau=1.5"], "algorithm.target_tau"),
        (
            ["algorithm.num_passes=2", "algorithm.num_minibatches=2", "algorithm.max_policy_lag=2"],
            "algorithm.max_policy_lag",
        ),
    ],
)
def test_appo_knobs_out_of_range_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("cartpole", [APPO, *overrides])


def test_the_policy_loss_choices_are_listed_in_the_refusal():
    with pytest.raises(ConfigError, match=r"impala \| appo"):
        load_config("cartpole", ["algorithm.policy_loss=ppo"])


def test_minibatches_that_do_not_divide_a_batchs_columns_are_refused_before_training(tmp_path):
    # the cartpole preset's batch: 1 rollout x 4 envs x 1 agent = 4 columns
    with pytest.raises(ConfigError, match=r"algorithm\.num_minibatches.*4 columns"):
        impala_rl.train("cartpole", [*FAST, APPO, "algorithm.num_minibatches=3"], run_dir=tmp_path)


# -- checkpoints ---------------------------------------------------------------------------------


def test_the_target_network_is_saved_and_restored_on_resume(tmp_path):
    overrides = [
        *FAST,
        APPO,
        "algorithm.target_update_frequency=4",
        "algorithm.n_epochs=1",
        "algorithm.epoch_length=3",
        "target_return=null",
    ]
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert "target_model" in saved  # 3 steps: the target is still the initial model
    assert any(not torch.equal(saved["target_model"][k], v) for k, v in saved["model"].items())
    trainer = Trainer(load_config("cartpole", overrides), run_dir=tmp_path, resume=True)
    trainer._build()
    for name, value in trainer.learner.target_model.state_dict().items():
        assert torch.equal(value, saved["target_model"][name]), name
    assert trainer.learner.num_updates == 3
    assert trainer.learner.steps_since_target == 3  # the next step (the 4th) moves the target


def test_after_a_resume_that_changes_the_steps_per_batch_the_target_moves_at_each_batch_end(
    tmp_path, monkeypatch
):
    """5 IMPALA updates, then resumed as appo with 2 passes: the target moves after steps 7, 9,
    11, 13 and 15 (each batch's last), never after the first pass of a batch."""
    overrides = [*FAST, "algorithm.n_epochs=1", "algorithm.epoch_length=5", "target_return=null"]
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    moved_at: list[int] = []
    sync = Learner.sync_target

    def recording_sync(self: Learner, tau: float = 1.0) -> None:
        moved_at.append(self.num_updates)
        sync(self, tau)

    monkeypatch.setattr(Learner, "sync_target", recording_sync)
    resumed = [*overrides, APPO, "algorithm.num_passes=2", "algorithm.n_epochs=2"]
    summary = impala_rl.train("cartpole", resumed, run_dir=tmp_path, resume=True)
    assert summary["updates"] == 15
    assert moved_at == [7, 9, 11, 13, 15]


def test_resuming_an_impala_run_as_appo_starts_the_target_at_the_trained_weights(tmp_path):
    overrides = [*FAST, "algorithm.n_epochs=1", "algorithm.epoch_length=2", "target_return=null"]
    impala_rl.train("cartpole", overrides, run_dir=tmp_path)
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert "target_model" not in saved
    trainer = Trainer(load_config("cartpole", [*overrides, APPO]), run_dir=tmp_path, resume=True)
    trainer._build()
    for name, value in trainer.learner.target_model.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name


# -- learning ------------------------------------------------------------------------------------


def test_cartpole_learns_with_appo(tmp_path, monkeypatch):
    """The ``cartpole`` preset (sequential, seed 0) with appo, 2 passes of 2 minibatches,
    reaches a training return >= 195 within the plain preset's learning-test budget (the run
    stops there)."""
    stop_once_train_return_reaches(monkeypatch, 195)
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            APPO,
            "algorithm.num_passes=2",
            "algorithm.num_minibatches=2",
            "seed=0",
            "target_return=null",
            f"max_env_steps={LEARNING_BUDGET}",
        ],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["env_steps"] <= LEARNING_BUDGET + STEPS_PER_UPDATE  # at most one batch over
    assert summary["train_return_recent"] >= 195, summary
