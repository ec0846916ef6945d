"""Structured (multi-step, multi-agent) envs: protocol, per-key V-trace, every backend."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from gymnasium import spaces

import impala_rl
from impala_rl.cli import main
from impala_rl.config import ConfigError, load_config
from impala_rl.envs import EnvFactory
from impala_rl.envs.examples import ItemPlacementEnv
from impala_rl.envs.factory import EnvError
from impala_rl.envs.structured import ActorID, StructuredEnv, StructuredVectorEnv
from impala_rl.evaluation import evaluate
from impala_rl.learner import Learner
from impala_rl.nn import ActorCritic
from impala_rl.nn.factory import build_model_for_env
from impala_rl.policy import load_policy
from impala_rl.rollout import ActorLoop, rollout_spec_for
from impala_rl.trainer import Trainer

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


# -- agent columns on a scripted env --------------------------------------------------------------


class ScriptedEnv(StructuredEnv):
    """Two agents, one step key: agent 1 acts at every third sub-step, agent 0 at the others.

    The observation is ``[agent, sub-step, serial]`` (``serial`` counts the env's decisions,
    so every decision is identifiable); at sub-step ``s`` agent ``a`` receives
    ``reward(s, a)``. Episodes last ``length`` sub-steps and end by termination, or by
    truncation (with each agent's final observation ``[a, length, -1]``).
    """

    n_agents = 2

    def __init__(
        self, length: int = 7, truncate: bool = False, final_obs: bool = True, first: int = 0
    ):
        self.observation_spaces = {0: spaces.Box(-1e6, 1e6, (3,), np.float32)}
        self.action_spaces = {0: spaces.Discrete(2)}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        self.length, self.truncate, self.final_obs = length, truncate, final_obs
        self.serial = first
        self.taken: list[tuple[int, int]] = []  # (agent, serial) of every decision

    @staticmethod
    def reward(s: int, a: int) -> float:
        return float((s + 1) * 10**a)

    def _agent(self) -> int:
        return 1 if self.s % 3 == 2 else 0

    def _obs(self) -> np.ndarray:
        return np.array([self._agent(), self.s, self.serial], dtype=np.float32)

    def actor_id(self) -> ActorID:
        return ActorID(0, self._agent())

    def reset(self, *, seed=None, options=None):
        self.s = 0
        return self._obs(), {}

    def step(self, action):
        self.taken.append((self._agent(), self.serial))
        rewards = np.array([self.reward(self.s, 0), self.reward(self.s, 1)])
        self.s += 1
        self.serial += 1
        end = self.s == self.length
        return self._obs(), rewards, end and not self.truncate, end and self.truncate, {}

    def final_observation(self, agent_id):
        if not self.final_obs:
            return None
        return 0, np.array([agent_id, self.length, -1], dtype=np.float32)

    def segment_reward(self, a: int, s: int) -> float:
        """What the decision of agent ``a`` at sub-step ``s`` earns up to its next one."""
        total, u = 0.0, s
        while True:
            total += self.reward(u, a)
            u += 1
            if u == self.length or (1 if u % 3 == 2 else 0) == a:
                return total


def _scripted_loop(num_envs=2, T=5, model_overrides=(), **kwargs):
    envs: list[ScriptedEnv] = []

    def factory():
        envs.append(ScriptedEnv(**kwargs, first=10_000 * len(envs)))  # serials unique
        return envs[-1]

    cfg = load_config("multistep_example", list(model_overrides))
    model = build_model_for_env(cfg.model, ScriptedEnv(**kwargs))
    loop = ActorLoop(factory, num_envs, model, seed=0, unroll_length=T)
    spec = rollout_spec_for(model, None, T, num_envs)  # type: ignore[arg-type]
    return loop, spec, envs, model


def _decision_rows(spec):
    """Every ``(t, c)`` of rows 0..T-1: each is a decision that trains."""
    return [(t, c) for t in range(spec.T) for c in range(spec.N)]


def _rows(slot, t, c):
    """``(agent, sub-step, serial)`` of row ``t`` of column ``c``."""
    return tuple(int(x) for x in slot["obs"][t, c])


def test_every_decision_over_several_unrolls_is_trained_exactly_once():
    loop, spec, envs, _ = _scripted_loop()
    trained = []
    for _ in range(6):
        slot = spec.allocate()
        loop.unroll(slot)
        for c in range(spec.N):  # a column is a stretch of one agent's stream in one env
            rows = [_rows(slot, t, c) for t in range(spec.T)]
            assert len({(agent, serial // 10_000) for agent, _, serial in rows}) == 1
        for t, c in _decision_rows(spec):
            agent, _, serial = _rows(slot, t, c)
            trained.append((agent, serial))
    taken = {(a, serial) for env in envs for a, serial in env.taken}
    pending = set()
    for stream in range(len(loop.streams.open)):
        for d in [*loop.streams.closed[stream], loop.streams.open[stream]]:
            if d is not None and d.action is not None:
                pending.add((stream % 2, int(d.obs[2])))
    assert len(trained) == len(set(trained)) > 40  # none twice
    assert set(trained) | pending == taken  # none lost
    assert not set(trained) & pending


def test_a_segment_across_the_unroll_boundary_gets_the_reward_after_it():
    loop, spec, envs, _ = _scripted_loop(num_envs=1, T=4)
    open_bootstraps: set[int] = set()  # decisions written as row T while still open
    spanning = 0
    for _ in range(10):
        slot = spec.allocate()
        loop.unroll(slot)
        for t, c in _decision_rows(spec):
            agent, s, serial = _rows(slot, t, c)
            assert float(slot["reward"][t, c]) == envs[0].segment_reward(agent, s)
            if serial in open_bootstraps:
                assert t == 0  # it opens a later column of its stream, with its whole reward
                spanning += 1
        still_open = {int(d.obs[2]) for d in loop.streams.open if d is not None}
        open_bootstraps |= {_rows(slot, spec.T, c)[2] for c in range(spec.N)} & still_open
    assert spanning >= 3


@pytest.mark.parametrize("final_obs", [True, False])
def test_truncation_bootstraps_from_the_agents_final_observation(final_obs):
    loop, spec, envs, model = _scripted_loop(num_envs=1, T=6, truncate=True, final_obs=final_obs)
    seen = 0
    for _ in range(4):
        slot = spec.allocate()
        loop.unroll(slot)
        for t, c in _decision_rows(spec):
            agent, s, _ = _rows(slot, t, c)
            last = envs[0].segment_reward(agent, s) == sum(
                envs[0].reward(u, agent) for u in range(s, envs[0].length)
            )
            truncated, terminated = bool(slot["truncated"][t, c]), bool(slot["terminated"][t, c])
            if not last:  # the agent decides again in this episode: bootstrap from that row
                assert not truncated and not terminated
                continue
            seen += 1
            if final_obs:  # the value of the agent's own final observation, by the actor
                assert truncated and not terminated
                final = torch.tensor([[agent, envs[0].length, -1]], dtype=torch.float32)
                with torch.no_grad():
                    expected = float(model.value(0, final)[0])
                assert float(slot["truncation_value"][t, c]) == pytest.approx(expected, abs=1e-6)
            else:  # an env without final observations: truncation is termination
                assert terminated and not truncated
    assert seen >= 3


def test_agents_acting_at_different_rates_train_without_deadlock():
    loop, spec, _, model = _scripted_loop(num_envs=2, T=6, length=1000)
    learner = Learner(model, load_config("multistep_example").algorithm)
    agents = []
    for _ in range(6):
        slot = spec.allocate()
        result = loop.unroll(slot)
        stats = learner.update(slot)
        assert np.isfinite(stats.total_loss) and result.env_steps > 0
        assert np.isfinite(stats.policy_loss[0])
        agents += slot["obs"][0, :, 0].tolist()
        # agent 0, deciding twice as often, fills twice the columns of agent 1
        assert max(len(q) for q in loop.streams.closed) < 3 * spec.T  # queues stay bounded
    assert agents.count(0.0) == pytest.approx(2 * agents.count(1.0), abs=3)


# -- a recurrent core along each agent's decisions ------------------------------------------------

CORE = ["model.core=lstm", "model.shared_torso=true", "model.lstm_hidden_size=64"]


@pytest.mark.parametrize(
    "env_kwargs",
    [
        {"length": 7, "truncate": True, "final_obs": True},  # truncation values along columns
        {"length": 1000},  # agents at different rates, columns cut mid-episode
    ],
)
def test_a_core_columns_stored_state_reproduces_the_actors_log_probs(env_kwargs):
    """Columns start at any decision of an agent's stream: the state stored at row 0 and the
    ``first`` flags must let the learner's core recompute exactly what the actor computed."""
    from impala_rl.learner import forward_batch

    loop, spec, _, model = _scripted_loop(num_envs=2, T=6, model_overrides=CORE, **env_kwargs)
    model.core.lstm.bias_hh_l0.data.normal_()  # a state that matters: no zero-state luck
    for _ in range(5):
        slot = spec.allocate()
        loop.unroll(slot)
        assert slot["core_h"].abs().sum() > 0 or _ == 0
        with torch.no_grad():
            log_prob = forward_batch(model, slot).log_prob[:-1]
        torch.testing.assert_close(log_prob, slot["behaviour_log_prob"], atol=1e-5, rtol=0)


def test_a_core_state_is_per_agent_in_self_play():
    from impala_rl.learner import forward_batch

    cfg = load_config("tictactoe", ["env.kwargs.opponent=self_play", *CORE])
    factory = EnvFactory(cfg.env.id, cfg.env.kwargs)
    model = build_model_for_env(cfg.model, factory())
    loop = ActorLoop(factory, 4, model, seed=0, unroll_length=5)
    spec = rollout_spec_for(model, None, 5, 4)  # type: ignore[arg-type]
    for _ in range(4):
        slot = spec.allocate()
        loop.unroll(slot)
        with torch.no_grad():
            log_prob = forward_batch(model, slot).log_prob[:-1]
        torch.testing.assert_close(log_prob, slot["behaviour_log_prob"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["sequential", "subprocess"])
def test_an_lstm_policy_reaches_the_example_envs_optimal_return(tmp_path, backend):
    summary = impala_rl.train(
        "multistep_example",
        [*FAST, *CORE, f"runner.backend={backend}", "seed=0", f"max_env_steps={EXAMPLE_BUDGET}"],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "target_return", summary
    assert summary["best_eval_return"] == 2.0


@pytest.mark.parametrize(
    "overrides", [CORE, [*CORE, "model.use_last_action_reward=true"]], ids=["lstm", "lstm-last"]
)
def test_load_policy_carries_a_structured_core_as_the_evaluator_does(tmp_path, overrides, capsys):
    """``Policy.act`` on a structured env with a core (and last inputs) keeps each agent's
    state from decision to decision: over whole episodes it reads the same inputs and computes
    the same distributions as ``evaluate`` (``impala eval``) on the same seeds; ``impala
    eval`` runs the checkpoint."""
    impala_rl.train("multistep_example", [*FAST, *overrides, "max_env_steps=512"], run_dir=tmp_path)
    policy = load_policy(tmp_path, which="last")
    model = policy.model
    calls: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
    model_act = model.act

    def spy(step_key, obs, mask, first, core_state, extra):
        dist, state = model_act(step_key, obs, mask, first, core_state, extra)
        calls.append((step_key, dist.log_prob(dist.mode()), None if extra is None else extra))
        return dist, state

    model.act = spy
    for seed in range(3):
        calls.clear()
        evaluate(model, policy.env_factory, 1, deterministic=True, seed=seed)
        evaluated = list(calls)
        calls.clear()
        env = policy.env_factory()
        obs, _ = env.reset(seed=seed)
        policy.reset()
        reward, done = 0.0, False
        while not done:
            key, agent = env.actor_id()
            action = policy.act(obs, step_key=key, agent_id=agent, last_reward=reward)
            obs, reward, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
        assert len(calls) == len(evaluated) >= 4
        for (key, log_prob, extra), (key_e, log_prob_e, extra_e) in zip(
            calls, evaluated, strict=True
        ):
            assert key == key_e
            torch.testing.assert_close(log_prob, log_prob_e)
            if extra is not None:
                torch.testing.assert_close(extra, extra_e)
    with pytest.raises(ValueError, match=r"agent_id=1 is not one of 0\.\.0"):
        policy.act(obs, step_key=0, agent_id=1)
    capsys.readouterr()
    assert main(["eval", str(tmp_path), "--episodes", "3", "--which", "last"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 3 and 0.0 <= report["min_return"] <= report["max_return"] <= 2.0


# -- observation normalization and PopArt, per step key and per critic ---------------------------


def _example_unroll(overrides, T=8, num_envs=4, unrolls=1):
    """``multistep_example``'s model and ``unrolls`` slots of one actor loop."""
    cfg = load_config("multistep_example", list(overrides))
    factory = EnvFactory(cfg.env.id, cfg.env.kwargs)
    model = build_model_for_env(cfg.model, factory())
    loop = ActorLoop(factory, num_envs, model, seed=0, unroll_length=T)
    spec = rollout_spec_for(model, None, T, num_envs)  # type: ignore[arg-type]
    slots = []
    for _ in range(unrolls):
        slots.append(spec.allocate())
        loop.unroll(slots[-1])
    loop.close()
    return model, slots


def test_observation_statistics_per_step_key_are_those_of_every_trained_decision(tmp_path):
    """normalize_obs: each step key's statistics are those of the observations of its
    decisions (rows 0..T-1, not the bootstrap row), saved with the weights, used by
    load_policy."""
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    update = Learner.update

    def recording_update(self, batch, train_policy=True, fresh=True, **kw):
        for k in seen:
            rows = batch["step_key"][:-1] == k
            seen[k].append(batch[f"obs_{k}"][:-1][rows].double().clone())
        return update(self, batch, train_policy=train_policy, fresh=fresh, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Learner, "update", recording_update)
        impala_rl.train(
            "multistep_example",
            [*FAST, "model.normalize_obs=true", "max_env_steps=4096", "target_return=null"],
            run_dir=tmp_path,
        )
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["model"]
    policy = load_policy(tmp_path, which="last")
    for k, batches in seen.items():
        data = torch.cat(batches)
        assert int(state[f"obs_norms.{k}.count"]) == len(data) > 500
        torch.testing.assert_close(state[f"obs_norms.{k}.mean"], data.mean(0))
        torch.testing.assert_close(state[f"obs_norms.{k}.var"], data.var(0, unbiased=False))
        obs = data[:3].float()
        expected = (obs.double() - data.mean(0)) / (data.var(0, unbiased=False) + 1e-8).sqrt()
        torch.testing.assert_close(policy.model.normalized(k, obs), expected.float().clamp(-10, 10))


def test_the_actor_and_the_learner_read_the_same_normalized_observations():
    from impala_rl.learner import forward_batch

    model, _ = _example_unroll(["model.normalize_obs=true"], unrolls=0)
    for norm in model.obs_norms.values():  # statistics far from the identity
        norm.mean.fill_(0.5)
        norm.var.fill_(0.04)
        norm.count.fill_(100.0)
    cfg = load_config("multistep_example", ["model.normalize_obs=true"])
    factory = EnvFactory(cfg.env.id, cfg.env.kwargs)
    loop = ActorLoop(factory, 4, model, seed=0, unroll_length=8)
    slot = rollout_spec_for(model, None, 8, 4).allocate()  # type: ignore[arg-type]
    loop.unroll(slot)
    loop.close()
    with torch.no_grad():
        log_prob = forward_batch(model, slot).log_prob[:-1]
        for norm in model.obs_norms.values():
            norm.mean.zero_()
            norm.var.fill_(1.0)
        unnormalized = forward_batch(model, slot).log_prob[:-1]
    torch.testing.assert_close(log_prob, slot["behaviour_log_prob"])
    assert not torch.allclose(unnormalized, slot["behaviour_log_prob"], atol=1e-3)


def _policy_grads(model, batch) -> list[torch.Tensor]:
    cfg = load_config("multistep_example", ["algorithm.reward_clipping=none"]).algorithm
    cfg.max_grad_norm = None
    Learner(model, cfg).update({k: v.clone() for k, v in batch.items()})
    return [p.grad.clone() for p in model.policy_parameters()]


@pytest.mark.parametrize("popart", [True, False])
def test_popart_per_critic_makes_the_policy_gradient_invariant_to_the_reward_scale(popart):
    """Rewards x100 with every critic's PopArt statistics x100: the same policy gradient;
    without PopArt the same rescaling changes it. Each critic keeps its own statistics."""
    torch.manual_seed(1)
    small, (batch,) = _example_unroll([f"model.popart={popart}"])
    assert batch["reward"].abs().sum() > 0
    heads = small.popart_heads()
    assert sorted(heads) == ([0, 1] if popart else [])
    for head in heads.values():
        head.mu.fill_(1.0)
        head.nu.fill_(1.0 + 4.0)  # sigma 2
    large = copy.deepcopy(small)
    for head in large.popart_heads().values():
        head.mu.mul_(100.0)  # values x100, the normalized layers unchanged
        head.nu.mul_(100.0**2)
    scaled = {**batch, "reward": batch["reward"] * 100.0}
    grads_small, grads_large = _policy_grads(small, batch), _policy_grads(large, scaled)
    same = all(
        torch.allclose(a, b, rtol=1e-3, atol=1e-6)
        for a, b in zip(grads_small, grads_large, strict=True)
    )
    assert same is popart
    if popart:
        mus = [float(h.mu) for h in small.popart_heads().values()]
        assert mus[0] != mus[1]  # equal before: each moved towards its own critic's targets
        for c, head in large.popart_heads().items():
            torch.testing.assert_close(head.mu, small.popart_heads()[c].mu * 100)


# -- last action and reward inputs, per agent ----------------------------------------------------

LAST = ["model.use_last_action_reward=true"]


def _check_last_inputs(model, slot) -> int:
    """Row t of a column reads row t-1's action (in its key's block) and reward, unless row
    t-1 ended the agent's episode (terminated or truncated): then zeros. Returns the rows
    checked with a previous decision."""
    last, checked = slot["last_inputs"], 0
    keys = slot.get("step_key", torch.zeros_like(slot["first"], dtype=torch.int64))
    ended = slot["terminated"] | slot["truncated"]
    for t in range(1, ended.shape[0] + 1):
        for c in range(last.shape[1]):
            expected = torch.zeros(last.shape[-1])
            if not ended[t - 1, c]:
                k = int(keys[t - 1, c])
                field = f"action_{k}" if "step_key" in slot else "action"
                action = slot[field][t - 1, c].unsqueeze(0)
                reward = slot["reward"][t - 1, c].unsqueeze(0)
                expected = model.last_inputs(k, action, reward)[0]
                checked += 1
            torch.testing.assert_close(last[t, c], expected)
    return checked


@pytest.mark.parametrize(
    "env_kwargs",
    [{"length": 7, "truncate": True, "final_obs": True}, {"length": 1000}],
)
def test_last_inputs_are_the_agents_previous_action_and_reward_since(env_kwargs):
    loop, spec, _, model = _scripted_loop(num_envs=2, T=6, model_overrides=LAST, **env_kwargs)
    checked = 0
    for _ in range(4):
        slot = spec.allocate()
        loop.unroll(slot)
        checked += _check_last_inputs(model, slot)
    assert checked > 50


def test_last_inputs_of_a_multi_key_env_fill_the_block_of_the_previous_key():
    model, slots = _example_unroll(LAST, unrolls=3)
    assert model.extra_features == 3 + 4 + 1  # pick one of 3 items, one of 4 slots, reward
    for slot in slots:
        assert _check_last_inputs(model, slot) > 20
        assert slot["last_inputs"][..., :3].sum() > 0 and slot["last_inputs"][..., 3:7].sum() > 0


@pytest.mark.parametrize("core", [False, True])
def test_last_inputs_let_the_learner_recompute_the_actors_log_probs(core):
    from impala_rl.learner import forward_batch

    overrides = [*LAST, *(CORE if core else [])]
    loop, spec, _, model = _scripted_loop(
        num_envs=2, T=6, model_overrides=overrides, length=7, truncate=True, final_obs=True
    )
    with torch.no_grad():  # weights on the extra inputs that matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    for _ in range(4):
        slot = spec.allocate()
        loop.unroll(slot)
        with torch.no_grad():
            log_prob = forward_batch(model, slot).log_prob[:-1]
            without = forward_batch(model, {**slot, "last_inputs": 0 * slot["last_inputs"]})
        torch.testing.assert_close(log_prob, slot["behaviour_log_prob"], atol=1e-5, rtol=0)
        assert not torch.allclose(without.log_prob[:-1], log_prob, atol=1e-4)


def test_a_policy_reading_last_action_and_reward_reaches_the_example_envs_optimum(tmp_path):
    summary = impala_rl.train(
        "multistep_example",
        [*FAST, *LAST, "seed=0", f"max_env_steps={EXAMPLE_BUDGET}"],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "target_return", summary
    assert summary["best_eval_return"] == 2.0


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
    assert isinstance(model, ActorCritic) and len(model.step_keys) > 1
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


def test_bf16_and_a_shared_torso_are_accepted_on_structured_envs():
    cfg = load_config("multistep_example", ["model.precision=bf16", "model.shared_torso=true"])
    model = build_model_for_env(cfg.model, ItemPlacementEnv())
    for k in model.step_keys:  # each key's critic reads its policy's encoder
        assert model.critic_torso(k) is model.policies[str(k)].torso
    dtypes = []
    first_linear = next(
        m for m in model.policies["0"].torso.modules() if isinstance(m, torch.nn.Linear)
    )
    first_linear.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    loop = ActorLoop(ItemPlacementEnv, 3, model, seed=1, unroll_length=8)
    slot = rollout_spec_for(model, None, 8, 3).allocate()  # type: ignore[arg-type]
    loop.unroll(slot)
    before = [p.detach().clone() for p in model.policies["0"].torso.parameters()]
    stats = Learner(model, cfg.algorithm).update(slot)
    assert np.isfinite(stats.total_loss) and set(stats.critic_value_loss) == {0, 1}
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the encoder ran under bf16 autocast
    after = list(model.policies["0"].torso.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    with pytest.raises(ConfigError, match="shared_torso=true needs critic=per_step_key"):
        bad = load_config("multistep_example", ["model.shared_torso=true", "model.critic=shared"])
        build_model_for_env(bad.model, ItemPlacementEnv())


def test_structured_unroll_fills_per_key_fields_and_learner_reports_per_key_events():
    cfg = load_config("multistep_example")
    model = build_model_for_env(cfg.model, ItemPlacementEnv())
    loop = ActorLoop(ItemPlacementEnv, 3, model, seed=1, unroll_length=8)
    spec = rollout_spec_for(model, None, 8, 3)  # type: ignore[arg-type]
    slot = spec.allocate()
    result = loop.unroll(slot)
    assert slot["step_key"].tolist() == [[0] * 3, [1] * 3] * 4 + [[0] * 3]
    assert slot["obs_0"].shape == (9, 3, 7) and slot["obs_1"].shape == (9, 3, 5)
    assert slot["reward"].shape == (8, 3) and not slot["truncated"].any()
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


def test_example_env_needs_the_next_decisions_value_credited_to_the_item(tmp_path, monkeypatch):
    """Control: the item's sub-step pays nothing, so the item policy learns only from the
    value of the placement decision after it (keys alternate along the agent's column);
    with every segment cut there (no bootstrap), the optimum is not reached in the budget."""
    from impala_rl.decisions import DecisionStreams

    original = DecisionStreams.close

    def no_bootstrap(self, stream, terminated=False, truncation_value=None):
        original(self, stream, True)

    monkeypatch.setattr(DecisionStreams, "close", no_bootstrap)
    summary = impala_rl.train(
        "multistep_example",
        [*FAST, "seed=0", "max_env_steps=20000"],
        run_dir=tmp_path,
    )
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["best_eval_return"] < 2.0


def test_trained_structured_policy_loads_and_acts_per_step_key(tmp_path):
    impala_rl.train(
        "multistep_example",
        [*FAST, "algorithm.n_epochs=1", "algorithm.epoch_length=2", "target_return=null"],
        run_dir=tmp_path,
    )
    policy = load_policy(tmp_path)
    assert isinstance(policy.model, ActorCritic) and len(policy.model.step_keys) > 1
    env = policy.env_factory()
    obs, _ = env.reset(seed=0)
    keys_seen = set()
    for _ in range(6):
        key = env.actor_id().step_key
        keys_seen.add(key)
        action = policy.act(obs, step_key=key)
        assert env.action_spaces[key].contains(action)
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            obs, _ = env.reset()
    assert keys_seen == {0, 1}
    with pytest.raises(ValueError, match=r"step keys \[0, 1\]: pass step_key="):
        policy.act(obs)


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
