"""Structured (multi-step, multi-agent) envs: protocol, per-key V-trace, every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import impala_rl
from impala_rl import vtrace
from impala_rl.config import ConfigError, load_config
from impala_rl.decisions import decision_sequence, sequence_vtrace
from impala_rl.envs.examples import ItemPlacementEnv
from impala_rl.envs.factory import EnvError
from impala_rl.envs.structured import ActorID, StructuredEnv, StructuredVectorEnv
from impala_rl.learner import Learner
from impala_rl.nn.factory import build_model_for_env
from impala_rl.nn.structured import StructuredActorCritic
from impala_rl.rollout import make_actor_loop, rollout_spec_for
from impala_rl.trainer import Trainer, load_policy

FAST = ["log.console=false", "log.tensorboard=false"]
EXAMPLE_BUDGET = 60_000  # sub-steps; the sequential run needs ~9k (seed 0)


def _t(rows):
    return torch.tensor(rows)


# -- one key: unchanged ---------------------------------------------------------------------------


def test_plain_env_training_is_unchanged_from_before_structured_envs(tmp_path):
    """A seeded CartPole run (sequential) ends with the same weights as commit 55efad6, the
    last one before structured envs: the one-key path computes exactly what it did."""
    cfg = load_config(
        "cartpole",
        [
            *FAST,
            "log.jsonl=false",
            "algorithm.n_epochs=1",
            "algorithm.epoch_length=5",
            "target_return=null",
            "algorithm.rollout_evaluator.n_episodes=2",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    summary = trainer.train()
    params = torch.cat([p.detach().flatten() for p in trainer.learner.model.parameters()]).double()
    # measured with 55efad6's code on the same script
    assert float(params.sum()) == pytest.approx(12.213987000330235, rel=1e-5)
    assert float(params.abs().sum()) == pytest.approx(1235.696946121563, rel=1e-5)
    assert summary["best_eval_return"] == 206.0


def test_one_key_decision_sequence_is_plain_vtrace():
    """With one step key and one agent every row is a decision: per-key V-trace equals V-trace
    over the flat batch (episode ends included)."""
    g = torch.Generator().manual_seed(0)
    T, B = 7, 3
    reward = torch.randn(T, B, 1, generator=g)
    terminated = torch.rand(T, B, generator=g) < 0.2
    log_mu = -torch.rand(T, B, generator=g)
    log_pi = torch.cat([-torch.rand(T, B, generator=g), torch.zeros(1, B)])
    values = torch.randn(T + 1, B, generator=g)
    zeros = torch.zeros(T + 1, B, dtype=torch.long)
    seq = decision_sequence(
        zeros, zeros, reward, terminated, torch.zeros(T, B, dtype=torch.bool), 0, 0, 0.9
    )
    assert seq.trainable[:T].all() and not seq.trainable[T].any()
    got = sequence_vtrace(seq, log_pi, log_mu, values)
    want = vtrace.from_importance_weights(
        log_pi[:T] - log_mu, 0.9 * (~terminated).float(), reward[..., 0], values[:T], values[T]
    )
    torch.testing.assert_close(got.vs[:T], want.vs)
    torch.testing.assert_close(got.pg_advantages[:T], want.pg_advantages)
    torch.testing.assert_close(got.vs[T], values[T])  # the bootstrap row is not trained


# -- per-key V-trace on a scripted trajectory ----------------------------------------------------

# Rows 0..6 of one column: keys alternate 0, 1, 0, 1, ...; one agent. Key 1's sub-steps pay
# 1, 2, 3; the episode terminates after sub-step 3 (row 4 starts the next one). gamma = 0.9.
STEP_KEY = [0, 1, 0, 1, 0, 1, 0]
REWARD = [0.0, 1.0, 0.0, 2.0, 0.0, 3.0]
TERMINATED = [False, False, False, True, False, False]
V = [0.5, 0.7, 0.4, 0.6, 0.3, 0.1, 0.2]  # the acting key's critic at each row


def _scripted(key: int):
    T = len(REWARD)
    step_key = _t(STEP_KEY).unsqueeze(1)
    agent = torch.zeros_like(step_key)
    reward = _t(REWARD).reshape(T, 1, 1)
    term = _t(TERMINATED).unsqueeze(1)
    seq = decision_sequence(
        step_key, agent, reward, term, torch.zeros(T, 1, dtype=torch.bool), key, 0, 0.9
    )
    return seq


def test_per_key_sequences_sum_rewards_between_that_keys_decisions():
    seq0 = _scripted(0)
    assert seq0.rows[:, 0].tolist() == [0, 2, 4, 6]
    # row 0 earns r0 + r1; row 2 earns r2 + r3 and its episode ends; row 4 earns r4 + r5;
    # row 6 (= T) only bootstraps
    assert seq0.rewards[:, 0].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert seq0.discounts[:, 0].tolist() == pytest.approx([0.9, 0.0, 0.9, 0.0])
    assert seq0.trainable[:, 0].tolist() == [True, True, True, False]
    seq1 = _scripted(1)
    assert seq1.rows[:, 0].tolist() == [1, 3, 5]
    # row 1 earns r1 + r2; row 3 earns r3, then the episode ends; row 5's segment is still
    # open at the end of the unroll: not trained
    assert seq1.rewards[:, 0].tolist() == [1.0, 2.0, 0.0]
    assert seq1.discounts[:, 0].tolist() == pytest.approx([0.9, 0.0, 0.0])
    assert seq1.trainable[:, 0].tolist() == [True, True, False]


def test_per_key_vtrace_matches_a_hand_computation():
    T = len(REWARD)
    values = _t(V).unsqueeze(1)
    behaviour = torch.zeros(T, 1)
    # on-policy, except key 0's first decision: pi/mu = 0.5 there
    target = torch.zeros(T + 1, 1)
    target[0, 0] = math.log(0.5)
    vt0 = sequence_vtrace(_scripted(0), target, behaviour, values)
    # by hand (rho_bar = c_bar = 1, gamma = 0.9), key 0 at rows 0, 2, 4, 6:
    vs6 = 0.2  # bootstrap
    vs4 = 3.0 + 0.9 * vs6  # 3.18
    vs2 = 2.0  # the episode ended: no bootstrap
    # row 0: rho = c = 0.5: v = V + rho (r + g V2 - V) + g c (vs2 - V2)
    vs0 = 0.5 + 0.5 * (1.0 + 0.9 * 0.4 - 0.5) + 0.9 * 0.5 * (vs2 - 0.4)  # 1.65
    assert vt0.vs[:, 0].tolist() == pytest.approx([vs0, vs2, vs4, vs6])
    adv0 = 0.5 * (1.0 + 0.9 * vs2 - 0.5)
    assert vt0.pg_advantages[:, 0].tolist() == pytest.approx(
        [adv0, 2.0 - 0.4, 3.0 + 0.9 * vs6 - 0.3, 0.0]
    )
    vt1 = sequence_vtrace(_scripted(1), target, behaviour, values)
    # key 1 at rows 1, 3, 5: row 5 is open (vs = V, no advantage)
    assert vt1.vs[:, 0].tolist() == pytest.approx([1.0 + 0.9 * 2.0, 2.0, 0.1])
    assert vt1.pg_advantages[:, 0].tolist() == pytest.approx([2.8 - 0.7, 2.0 - 0.6, 0.0])


def test_the_agent_that_did_not_move_last_gets_the_final_reward():
    """Two agents in turn (one shared step key): agent 0's move at row 2 ends the game, paying
    +1 to agent 0 and -1 to agent 1, whose last decision was at row 1."""
    step_key = torch.zeros(5, 1, dtype=torch.long)
    agent = _t([0, 1, 0, 1, 0]).unsqueeze(1)
    reward = torch.zeros(4, 1, 2)
    reward[2, 0] = torch.tensor([1.0, -1.0])
    term = _t([False, False, True, False]).unsqueeze(1)
    no = torch.zeros(4, 1, dtype=torch.bool)
    seq1 = decision_sequence(step_key, agent, reward, term, no, 0, 1, 0.9)
    assert seq1.rows[:, 0].tolist() == [1, 3]
    assert seq1.rewards[0, 0].item() == -1.0 and seq1.discounts[0, 0].item() == 0.0
    assert seq1.trainable[:, 0].tolist() == [True, False]
    seq0 = decision_sequence(step_key, agent, reward, term, no, 0, 0, 0.9)
    assert seq0.rewards[:, 0].tolist() == [0.0, 1.0, 0.0]
    assert seq0.discounts[:, 0].tolist() == pytest.approx([0.9, 0.0, 0.0])


def test_actor_done_ends_that_actors_sequence():
    step_key = torch.zeros(5, 1, dtype=torch.long)
    agent = _t([0, 1, 0, 1, 0]).unsqueeze(1)
    reward = torch.ones(4, 1, 2)
    term = torch.zeros(4, 1, dtype=torch.bool)
    actor_done = _t([False, True, False, False]).unsqueeze(1)  # agent 1 is out after row 1
    seq = decision_sequence(step_key, agent, reward, term, actor_done, 0, 1, 0.9)
    assert seq.rewards[0, 0].item() == 1.0  # only its own sub-step's reward
    assert seq.discounts[0, 0].item() == 0.0 and bool(seq.trainable[0, 0])


# -- the protocol and the model ------------------------------------------------------------------


class _BadKeyEnv(ItemPlacementEnv):
    def actor_id(self) -> ActorID:
        return ActorID(step_key=5, agent_id=0)


def test_vector_env_rejects_unknown_step_keys_by_name():
    with pytest.raises(EnvError, match="step_key 5.*valid: \\[0, 1\\]"):
        StructuredVectorEnv([_BadKeyEnv]).reset(seed=0)


def test_structured_env_needs_keys_0_to_k():
    class Gappy(StructuredEnv):
        def __init__(self):
            box = ItemPlacementEnv().observation_spaces[0]
            self.observation_spaces = {0: box, 2: box}
            discrete = ItemPlacementEnv().action_spaces[0]
            self.action_spaces = {0: discrete, 2: discrete}

    with pytest.raises(EnvError, match="step keys must be 0..K-1"):
        StructuredVectorEnv([Gappy])


def test_model_per_key_spaces_and_shared_policy_needs_equal_spaces():
    cfg = load_config("multistep_example")
    model = build_model_for_env(cfg.model, ItemPlacementEnv())
    assert isinstance(model, StructuredActorCritic)
    assert model.policy(0, torch.zeros(4, 7)).batch_shape == (4,)
    assert model.policy(1, torch.zeros(4, 5)).logits.shape == (4, 4)
    assert model.value(1, torch.zeros(3, 5)).shape == (3,)
    assert model.critic_keys == [0, 1]
    cfg.model.critic = "shared"
    shared = build_model_for_env(cfg.model, ItemPlacementEnv())
    assert shared.critic_keys == [0] and shared.value(1, torch.zeros(3, 5)).shape == (3,)
    cfg.model.shared_policy = True
    with pytest.raises(ConfigError, match="shared_policy needs equal spaces"):
        build_model_for_env(cfg.model, ItemPlacementEnv())


def test_model_critic_choice_is_validated():
    with pytest.raises(ConfigError, match="model.critic.*per_step_key \\| shared"):
        load_config("multistep_example", ["model.critic=both"])


@pytest.mark.parametrize(
    "override, field",
    [
        (["model.core=lstm", "model.shared_torso=true"], "model.core"),
        (["model.use_last_action_reward=true"], "model.use_last_action_reward"),
        (["model.precision=bf16"], "model.precision"),
    ],
)
def test_model_options_of_plain_envs_are_refused_by_name(tmp_path, override, field):
    cfg = load_config("multistep_example", [*FAST, *override])
    with pytest.raises(ConfigError, match=f"{field}=.*not supported for structured envs"):
        Trainer(cfg, run_dir=tmp_path).train()


def test_structured_unroll_fills_per_key_fields_and_learner_reports_per_key_events():
    cfg = load_config("multistep_example")
    model = build_model_for_env(cfg.model, ItemPlacementEnv())
    loop = make_actor_loop(ItemPlacementEnv, 3, model, seed=1, unroll_length=8)
    spec = rollout_spec_for(model, None, 8, 3)  # type: ignore[arg-type]
    slot = spec.allocate()
    result = loop.unroll(slot)
    assert slot["step_key"].tolist() == [[0] * 3, [1] * 3] * 4 + [[0] * 3]
    assert slot["obs_0"].shape == (9, 3, 7) and slot["obs_1"].shape == (9, 3, 5)
    assert slot["reward"].shape == (8, 3, 1)
    assert (slot["reward"][0::2] == 0).all() and (slot["reward"][1::2] > 0).all()
    assert slot["terminated"][3::4].all() and not slot["terminated"][1::4].any()
    assert len(result.episode_returns) == 2 * 3 and result.env_steps == 24
    learner = Learner(model, cfg.algorithm)
    stats = learner.update(slot)
    assert set(stats.policy_loss) == {0, 1} and set(stats.critic_value_loss) == {0, 1}
    assert all(np.isfinite(list(stats.policy_loss.values())))
    assert stats.vtrace_mean_rho[0] == pytest.approx(1.0, abs=1e-5)  # on-policy


# -- learning on every backend -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sequential", "subprocess", "ray"])
def test_example_env_reaches_its_optimal_return(tmp_path, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    summary = impala_rl.train(
        "multistep_example",
        [*FAST, f"runner.backend={backend}", "seed=0", f"max_env_steps={EXAMPLE_BUDGET}"],
        run_dir=tmp_path,
    )
    assert ItemPlacementEnv(n_rounds=2).optimal_return == 2.0
    assert summary["stopped_because"] == "target_return", summary
    assert summary["best_eval_return"] == 2.0


def test_example_env_needs_rewards_summed_between_decisions(tmp_path, monkeypatch):
    """Control: crediting each decision only with its own sub-step's reward, the item policy
    (whose sub-step pays nothing) cannot learn, and the optimum is not reached in the budget."""
    import impala_rl.decisions as decisions

    original = decisions.decision_sequence

    def last_substep_only(step_key, agent_id, reward, *args):
        own = torch.zeros_like(reward)
        acting = (step_key[:-1] == args[2]).unsqueeze(-1).expand_as(reward)
        own[acting] = reward[acting]
        return original(step_key, agent_id, own, *args)

    monkeypatch.setattr(decisions, "decision_sequence", last_substep_only)
    summary = impala_rl.train(
        "multistep_example",
        [*FAST, "seed=0", "max_env_steps=20000"],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["best_eval_return"] < 2.0


def test_trained_structured_policy_loads_and_act_names_the_alternative(tmp_path):
    impala_rl.train(
        "multistep_example",
        [*FAST, "algorithm.n_epochs=1", "algorithm.epoch_length=2", "target_return=null"],
        run_dir=tmp_path,
    )
    policy = load_policy(tmp_path)
    assert isinstance(policy.model, StructuredActorCritic)
    assert policy.model.policy(1, torch.zeros(2, 5)).mode().shape == (2,)
    with pytest.raises(TypeError, match="policy.model.policy\\(step_key"):
        policy.act(np.zeros(7, dtype=np.float32))


def test_categorical_action_mask_gives_illegal_actions_zero_probability():
    from impala_rl.nn import CategoricalDistribution

    mask = torch.tensor([[True, False, True, False], [False, False, False, False]])
    dist = CategoricalDistribution(torch.zeros(2, 4), mask)
    assert dist.probs[0].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert dist.probs[1].tolist() == [0.25] * 4  # no legal action: left unmasked, not NaN
    assert dist.entropy().tolist() == pytest.approx([math.log(2), math.log(4)])
    samples = torch.stack([dist.sample(torch.Generator().manual_seed(s)) for s in range(50)])
    assert set(samples[:, 0].tolist()) == {0, 2}
    with pytest.raises(ValueError, match="action mask shape"):
        CategoricalDistribution(torch.zeros(2, 4), mask[:, :3])
