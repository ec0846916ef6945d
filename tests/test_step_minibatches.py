"""algorithm.minibatch_of=steps: PPO's minibatches of single decisions drawn from the whole
batch, with V-trace's targets computed once per pass over the batch's columns."""

from __future__ import annotations

import copy

import gymnasium as gym
import pytest
import torch

import impala_rl
from actor_backends import stop_once_train_return_reaches
from impala_rl import losses, vtrace
from impala_rl.config import ConfigError, ImpalaAlgorithmConfig, ModelConfig, load_config
from impala_rl.learner import STEP_TARGETS, Learner, forward_batch
from impala_rl.nn.factory import build_model
from impala_rl.trainer import Trainer
from test_appo import _batch, _model
from test_trainer import LEARNING_BUDGET, STEPS_PER_UPDATE

STEPS = {"minibatch_of": "steps"}


def _decision(batch: dict[str, torch.Tensor], name: str, t: int, b: int) -> torch.Tensor:
    value = batch[name]
    return value[b] if value.ndim == 1 else value[t, b]


def test_step_blocks_hold_every_decision_once_with_its_own_fields():
    """6 columns of 5 decisions in 3 blocks of 10: each decision in exactly one block, every
    field (per row or per column) the decision's own, and a fresh shuffle per pass."""
    model = _model()
    T, B = 5, 6
    batch = _batch(model, n_envs=B, T=T)
    batch["actor_index"] = torch.arange(B)  # per column
    batch["reward"] = torch.arange(T * B, dtype=torch.float32).view(T, B)  # names a decision
    cfg = ImpalaAlgorithmConfig(policy_loss="appo", num_minibatches=3, **STEPS)
    learner = Learner(model, cfg)
    orders = []
    for _ in range(2):
        blocks = list(learner.minibatches(batch))
        assert len(blocks) == 3
        seen = torch.cat([blk["reward"][0] for blk in blocks]).long()
        assert sorted(seen.tolist()) == list(range(T * B))
        orders.append(seen)
        for blk in blocks:
            assert blk["first"].shape == (1, 10)
            assert {STEP_TARGETS, "pg_advantage", "rho", "target_log_prob"} <= blk.keys()
            for i, named in enumerate(blk["reward"][0].long().tolist()):
                t, b = divmod(named, B)
                for name in batch:
                    got = blk[name][i] if blk[name].ndim == 1 else blk[name][0, i]
                    torch.testing.assert_close(got, _decision(batch, name, t, b))
    assert not torch.equal(orders[0], orders[1])


@pytest.mark.parametrize("policy_loss", ["impala", "appo"])
def test_a_step_blocks_targets_are_vtrace_over_the_whole_batch_with_the_pass_weights(
    policy_loss,
):
    """The targets that travel with each decision are V-trace's over the batch's columns
    (the paper's recursion, here vtrace.from_importance_weights on the same inputs), with
    the weights the pass starts from: the ratios are the target's (appo) or the pass's
    weights' (impala) over the behaviour policy's."""
    model = _model()
    batch = _batch(model, n_envs=4, T=8)
    cfg = ImpalaAlgorithmConfig(policy_loss=policy_loss, num_minibatches=4, gamma=0.9, **STEPS)
    learner = Learner(model, cfg)
    learner.update(next(learner.minibatches(batch)))  # the weights move off the behaviour's
    with torch.no_grad():
        out = forward_batch(learner.model, batch)
        ratio_of = (
            out if learner.target_model is None else forward_batch(learner.target_model, batch)
        )
    discounts = cfg.gamma * (~(batch["terminated"] | batch["truncated"])).float()
    rewards = batch["reward"] + cfg.gamma * batch["truncated"].float() * batch["truncation_value"]
    expected = vtrace.from_importance_weights(
        ratio_of.log_prob[:-1] - batch["behaviour_log_prob"],
        discounts,
        rewards,
        out.value[:-1],
        out.value[-1],
    )
    T, B = batch["behaviour_log_prob"].shape
    batch["marker"] = torch.arange(T * B, dtype=torch.float32).view(T, B)
    blocks = list(learner.minibatches(batch))
    for blk in blocks:
        at = blk["marker"][0].long()
        torch.testing.assert_close(blk[STEP_TARGETS][0], expected.vs.flatten()[at])
        torch.testing.assert_close(blk["pg_advantage"][0], expected.pg_advantages.flatten()[at])
        torch.testing.assert_close(blk["rho"][0], expected.rhos.flatten()[at])


@pytest.mark.parametrize("step_targets", ["pass", "batch"])
def test_step_targets_batch_keeps_the_first_passs_targets_for_the_batch(step_targets):
    """``step_targets=batch`` (PPO's advantages, once per rollout): the later passes train on
    the targets of the weights the batch's first pass started from; ``pass`` recomputes them
    with each pass's weights. A new batch gets its own either way."""
    model = _model()
    cfg = ImpalaAlgorithmConfig(
        policy_loss="appo", num_minibatches=4, step_targets=step_targets, **STEPS
    )
    learner = Learner(model, cfg)

    def by_decision(blocks: list[dict[str, torch.Tensor]], field: str) -> torch.Tensor:
        at = torch.cat([blk["marker"][0] for blk in blocks]).long()
        values = torch.cat([blk[field][0] for blk in blocks])
        return values[at.argsort()]

    batches = []
    for _ in range(2):
        batch = _batch(model, n_envs=4, T=8)
        T, B = batch["behaviour_log_prob"].shape
        batch["marker"] = torch.arange(T * B, dtype=torch.float32).view(T, B)
        batches.append(batch)
    passes = []
    for n in range(2):
        blocks = list(learner.minibatches(batches[0], fresh=n == 0))
        for blk in blocks:
            learner.update(blk, fresh=n == 0)
        passes.append(blocks)
    for field in (STEP_TARGETS, "pg_advantage", "rho"):
        first, second = (by_decision(blocks, field) for blocks in passes)
        assert torch.equal(first, second) == (step_targets == "batch"), field
    # the next batch's first pass: its own targets, with the weights trained so far
    per_column = [name for name, value in batches[1].items() if value.ndim == 1]
    expected = learner._step_rows_of(batches[1], per_column)[STEP_TARGETS][0]
    blocks = list(learner.minibatches(batches[1], fresh=True))
    assert torch.equal(by_decision(blocks, STEP_TARGETS), expected)


def test_an_update_on_a_step_block_is_the_clipped_surrogate_and_value_loss_of_its_decisions():
    model = _model()
    batch = _batch(model, n_envs=4, T=8)
    cfg = ImpalaAlgorithmConfig(policy_loss="appo", num_minibatches=4, clip_param=0.1, **STEPS)
    learner = Learner(model, cfg)
    blocks = list(learner.minibatches(batch))
    learner.update(blocks[0])  # later blocks' ratios are no longer 1
    blk = blocks[1]
    trained = copy.deepcopy(learner.model)
    out = forward_batch(trained, blk)
    ratio = out.log_prob - blk["target_log_prob"]
    policy = losses.clipped_surrogate_loss(ratio[0], blk["pg_advantage"][0], cfg.clip_param)
    value = losses.baseline_loss(blk[STEP_TARGETS][0], out.value[0])
    entropy = losses.entropy_loss(out.entropy[0])
    total = policy + cfg.value_loss_coef * value + cfg.entropy_coef * entropy
    total.backward()
    stats = learner.update(blk)
    assert stats.policy_loss[0] == pytest.approx(float(policy.detach()), rel=1e-5)
    assert stats.critic_value_loss[0] == pytest.approx(float(value.detach()), rel=1e-5)
    for got, want in zip(learner.model.parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7)


def _pendulum_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A continuous-action model with observation normalization and PopArt, and its unroll."""
    torch.manual_seed(0)
    env = gym.make("Pendulum-v1")
    cfg = ModelConfig(hidden_sizes=[16], normalize_obs=True, popart=True)
    model = build_model(cfg, env.observation_space, env.action_space)
    env.close()
    return model, _batch(model, env_id="Pendulum-v1")


@pytest.mark.parametrize("policy_loss", ["impala", "appo"])
@pytest.mark.parametrize("env", ["cartpole", "pendulum-popart"])
def test_one_block_of_every_decision_takes_the_same_steps_as_the_whole_batch(policy_loss, env):
    """With one minibatch, each pass sees the same weights, targets and decisions either way:
    the same optimizer steps, also with normalized observations, PopArt and a Gaussian policy."""
    if env == "cartpole":
        model = _model()
        batch = _batch(model, n_envs=4, T=8)
    else:
        model, batch = _pendulum_batch()
    columns = Learner(copy.deepcopy(model), ImpalaAlgorithmConfig(policy_loss=policy_loss))
    steps = Learner(copy.deepcopy(model), ImpalaAlgorithmConfig(policy_loss=policy_loss, **STEPS))
    for learner in (columns, steps):
        for n in range(3):
            (blk,) = learner.minibatches(batch, fresh=n == 0)
            learner.update(blk, fresh=n == 0)
    after = steps.model.state_dict()
    for name, want in columns.model.state_dict().items():  # weights and statistics
        torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6)


def test_normalized_observations_join_the_statistics_once_per_batch():
    """A fresh pass adds the batch's decisions to ``normalize_obs``'s statistics before its
    targets; the step blocks' updates add nothing."""
    torch.manual_seed(0)
    space = gym.spaces.Box(-5, 5, (4,))
    model = build_model(
        ModelConfig(hidden_sizes=[16], normalize_obs=True), space, gym.spaces.Discrete(2)
    )
    batch = _batch(model, n_envs=4, T=8)
    learner = Learner(model, ImpalaAlgorithmConfig(num_minibatches=4, num_passes=2, **STEPS))
    norm = learner.model.observation_normalizer(0)
    for n in range(2):
        for blk in learner.minibatches(batch, fresh=n == 0):
            learner.update(blk, fresh=n == 0)
    assert float(norm.count) == pytest.approx(32, abs=1e-3)  # 8 rows x 4 columns, once


def test_step_minibatches_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch_of.*core"):
        load_config(None, ["algorithm.minibatch_of=steps", "model.core=lstm"])
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch_of.*columns \| steps"):
        load_config(None, ["algorithm.minibatch_of=decisions"])
    with pytest.raises(ConfigError, match=r"algorithm\.step_targets.*pass \| batch"):
        load_config(None, ["algorithm.step_targets=rollout"])
    with pytest.raises(ConfigError, match=r"algorithm\.step_targets.*minibatch_of=steps"):
        load_config(None, ["algorithm.step_targets=batch"])
    assert load_config("minigrid", ["algorithm.step_targets=batch"]).algorithm.step_targets == (
        "batch"
    )
    model = _model()
    cfg = ImpalaAlgorithmConfig(num_minibatches=7, **STEPS)
    with pytest.raises(ConfigError, match=r"algorithm\.num_minibatches.*32 decisions"):
        next(Learner(model, cfg).minibatches(_batch(model, n_envs=4, T=8)))


# -- in training ---------------------------------------------------------------------------------
FAST = ["log.console=false", "log.tensorboard=false", "runner.backend=sequential"]
STEP_REUSE = [
    "algorithm.policy_loss=appo",
    "algorithm.minibatch_of=steps",
    "algorithm.num_passes=2",
    "algorithm.num_minibatches=2",
]


def test_the_trainer_takes_one_step_per_block_and_each_pass_covers_every_decision(tmp_path):
    """cartpole preset: 1 actor's rollout of 4 envs per batch, 2 passes of 2 blocks of
    decisions; each pass holds every decision once."""
    seen: list[torch.Tensor] = []
    update = Learner.update

    def recording_update(self, batch, train_policy=True, fresh=True, **kw):
        seen.append(batch["obs"][0].clone())
        return update(self, batch, train_policy=train_policy, fresh=fresh, **kw)

    overrides = [*FAST, *STEP_REUSE, "algorithm.n_epochs=1", "algorithm.epoch_length=3"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Learner, "update", recording_update)
        cfg = load_config("cartpole", [*overrides, "target_return=null"])
        summary = Trainer(cfg, run_dir=tmp_path).train()
    decisions = 4 * cfg.algorithm.n_rollout_steps
    assert summary["updates"] == 3 * 4 and len(seen) == 3 * 4
    assert all(obs.shape[0] == decisions // 2 for obs in seen)
    for b in range(3):
        passes = [torch.cat(seen[4 * b + 2 * p : 4 * b + 2 * p + 2]) for p in (0, 1)]
        rows = [sorted(map(tuple, obs.tolist())) for obs in passes]
        assert rows[0] == rows[1] and len(rows[0]) == decisions


def test_cartpole_learns_with_step_minibatches(tmp_path, monkeypatch):
    """The ``cartpole`` preset (sequential, seed 0) with appo and 2 passes of 2 blocks of
    decisions reaches a training return >= 195 within the plain preset's learning-test
    budget (tests/test_trainer.py's; the run stops there)."""
    stop_once_train_return_reaches(monkeypatch, 195)
    summary = impala_rl.train(
        "cartpole",
        [*FAST, *STEP_REUSE, "seed=0", "target_return=null", f"max_env_steps={LEARNING_BUDGET}"],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["env_steps"] <= LEARNING_BUDGET + STEPS_PER_UPDATE  # at most one batch over
    assert summary["train_return_recent"] >= 195, summary


def test_a_presets_step_minibatches_give_way_to_a_core_the_user_asks_for(tmp_path):
    """``impala train minigrid model.core=lstm`` (MiniGrid's memory rooms) runs the preset's
    reuse on whole columns; ``steps`` given by the user beside a core is refused."""
    assert load_config("minigrid").algorithm.minibatch_of == "steps"
    cfg = load_config("minigrid", ["model.core=lstm"])
    assert cfg.algorithm.minibatch_of == "columns"
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch_of"):
        load_config("minigrid", ["model.core=lstm", "algorithm.minibatch_of=steps"])
    mine = tmp_path / "memory.yaml"
    mine.write_text("base: minigrid\nmodel:\n  core: lstm\n")
    assert load_config(mine).algorithm.minibatch_of == "columns"
    mine.write_text("base: minigrid\nmodel:\n  core: lstm\nalgorithm:\n  minibatch_of: steps\n")
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch_of"):
        load_config(mine)
