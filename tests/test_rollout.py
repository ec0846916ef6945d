"""Semantics of the actor loop, the sequential actors and the learner's targets.

Everything runs on :mod:`scripted_envs`, whose observations, rewards and episode ends do not
depend on the actions, so the expected slot contents can be computed without the library.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from impala_rl import vtrace
from impala_rl.actors import SequentialDistributedActors
from impala_rl.config import ImpalaAlgorithmConfig
from impala_rl.envs import EnvFactory
from impala_rl.learner import Learner
from impala_rl.nn import ActorCritic
from impala_rl.rollout import ActorLoop, rollout_spec_for

# EnvFactory imports ``scripted_envs`` by name; pytest's default import mode already puts tests/
# on sys.path, this keeps it working under --import-mode=importlib too.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

ENV_ID = "scripted_envs:make_env"
GAMMA = 0.9


# ---------------------------------------------------------------------------------------------
# Ground truth: the scripted env's logic, replayed without gymnasium or impala_rl.
# ---------------------------------------------------------------------------------------------


def expected_steps(
    T: int,
    episode_lengths=(3,),
    terminate: bool = True,
    time_limit: int | None = None,
    reward: float = 1.0,
) -> dict:
    """What one env of a scripted vector env does over ``T`` steps (all envs are identical).

    Returns per step ``obs`` (before the step; ``T + 1`` entries), ``first``, ``terminated``,
    ``truncated`` (not when also terminated), ``final_obs`` (the true last observation of an
    episode ending at that step, else ``None``), and the finished episodes' returns/lengths.
    """
    ep, k, ret = 0, 0, 0.0
    out = {
        "obs": [],
        "first": [],
        "terminated": [],
        "truncated": [],
        "final_obs": [],
        "returns": [],
        "lengths": [],
    }
    first = True
    for _ in range(T):
        out["obs"].append((float(k), float(ep)))
        out["first"].append(first)
        k += 1
        ret += reward
        length = episode_lengths[ep % len(episode_lengths)]
        term = terminate and k >= length
        trunc = time_limit is not None and k >= time_limit and not term
        out["terminated"].append(term)
        out["truncated"].append(trunc)
        if term or trunc:
            out["final_obs"].append((float(k), float(ep)))
            out["returns"].append(ret)
            out["lengths"].append(k)
            ep, k, ret = ep + 1, 0, 0.0
            first = True
        else:
            out["final_obs"].append(None)
            first = False
    out["obs"].append((float(k), float(ep)))
    out["first"].append(first)
    return out


def make_model(seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    factory = EnvFactory(ENV_ID)
    env = factory()
    model = ActorCritic(env.observation_space, env.action_space, hidden_sizes=(16,))
    env.close()
    return model


def make_loop(
    model: ActorCritic,
    T: int,
    N: int = 2,
    seed: int = 0,
    max_episode_steps: int | None = None,
    **env_kwargs,
) -> ActorLoop:
    factory = EnvFactory(ENV_ID, env_kwargs, max_episode_steps)
    return ActorLoop(factory, N, model, seed=seed, unroll_length=T)


def unroll(loop: ActorLoop) -> tuple[dict[str, torch.Tensor], object]:
    spec = rollout_spec_for(loop.model, loop.envs.single_observation_space, loop.T, loop.num_envs)
    slot = spec.allocate()
    result = loop.unroll(slot)
    return slot, result


def obs_tensor(rows, N: int) -> torch.Tensor:
    """``[len(rows), N, 2]`` from per-step ``(k, ep)`` tuples, the same for every env."""
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(1).expand(-1, N, -1)


# ---------------------------------------------------------------------------------------------
# ActorLoop.unroll
# ---------------------------------------------------------------------------------------------


def test_slot_shapes_dtypes_and_behaviour_log_probs():
    T, N = 5, 3
    model = make_model()
    loop = make_loop(model, T, N)
    spec = rollout_spec_for(model, loop.envs.single_observation_space, T, N)
    assert spec.field_shapes()["obs"] == ((T + 1, N, 2), torch.float32)
    assert spec.field_shapes()["action"] == ((T + 1, N), torch.int64)
    slot = spec.allocate()
    result = loop.unroll(slot)
    for name, (shape, dtype) in spec.field_shapes().items():
        assert tuple(slot[name].shape) == shape, name
        assert slot[name].dtype == dtype, name
    assert set(slot) == set(spec.field_shapes())
    assert result.env_steps == T * N
    assert set(slot["action"].unique().tolist()) <= {0, 1}
    # behaviour_log_prob is log mu(a_t | x_t) of the acting model on the stored observations
    with torch.no_grad():
        expected = model.policy(0, slot["obs"][:T]).log_prob(slot["action"][:T])
    torch.testing.assert_close(slot["behaviour_log_prob"], expected)
    loop.close()


def test_observations_and_first_flags_follow_the_env():
    T, N = 9, 3
    lengths = (2, 3)
    loop = make_loop(make_model(), T, N, episode_lengths=lengths)
    exp = expected_steps(2 * T, lengths)
    slot1, _ = unroll(loop)
    slot2, _ = unroll(loop)
    torch.testing.assert_close(slot1["obs"], obs_tensor(exp["obs"][: T + 1], N))
    torch.testing.assert_close(slot2["obs"], obs_tensor(exp["obs"][T:], N))
    first = torch.tensor(exp["first"]).unsqueeze(1).expand(-1, N)
    assert torch.equal(slot1["first"], first[: T + 1])
    assert torch.equal(slot2["first"], first[T:])
    assert slot1["first"][0].all()
    # after a non-final step, obs[t+1] is the env's next observation of the same episode
    for t in range(T):
        if not exp["terminated"][t]:
            k, ep = slot1["obs"][t, 0].tolist()
            assert slot1["obs"][t + 1, 0].tolist() == [k + 1, ep]
            assert not slot1["first"][t + 1].any()
    loop.close()


def test_termination_autoresets_in_the_same_step():
    T, N = 7, 2
    loop = make_loop(make_model(), T, N, episode_lengths=(3,))
    slot, _ = unroll(loop)
    exp = expected_steps(T, (3,))
    ends = [t for t in range(T) if exp["terminated"][t]]
    assert ends == [2, 5]
    expected_term = torch.tensor(exp["terminated"]).unsqueeze(1).expand(-1, N)
    assert torch.equal(slot["terminated"], expected_term)
    assert not slot["truncated"].any()
    assert torch.equal(slot["truncation_value"], torch.zeros(T, N))
    for t in ends:
        ep = exp["obs"][t][1]
        # obs[t+1] is already the NEXT episode's first observation
        assert slot["obs"][t + 1].tolist() == [[0.0, ep + 1]] * N
        assert slot["first"][t + 1].all()
    # the terminal observation itself (k == 3) is never stored
    assert not (slot["obs"][..., 0] == 3).any()
    loop.close()


def test_truncation_stores_the_value_of_the_true_final_observation():
    T, N, limit = 10, 2, 4
    model = make_model()
    loop = make_loop(model, T, N, max_episode_steps=limit, terminate=False)
    slot, _ = unroll(loop)
    exp = expected_steps(T, terminate=False, time_limit=limit)
    ends = [t for t in range(T) if exp["truncated"][t]]
    assert ends == [3, 7]
    assert not slot["terminated"].any()
    expected_trunc = torch.tensor(exp["truncated"]).unsqueeze(1).expand(-1, N)
    assert torch.equal(slot["truncated"], expected_trunc)
    for t in range(T):
        if t in ends:
            final = torch.tensor([exp["final_obs"][t]] * N)  # e.g. [4, ep]: never in obs
            assert final[0, 0].item() == limit
            with torch.no_grad():
                expected_value = model.value(0, final)
            torch.testing.assert_close(slot["truncation_value"][t], expected_value)
            assert (slot["truncation_value"][t] != 0).all()
            # and it is not the value of the stored (post-reset) next observation
            with torch.no_grad():
                reset_value = model.value(0, slot["obs"][t + 1])
            assert not torch.allclose(slot["truncation_value"][t], reset_value)
            assert slot["obs"][t + 1, :, 0].tolist() == [0.0] * N
        else:
            assert (slot["truncation_value"][t] == 0).all()
    loop.close()


def test_termination_at_the_time_limit_counts_as_termination():
    T, N = 6, 2
    loop = make_loop(make_model(), T, N, max_episode_steps=3, episode_lengths=(3,))
    slot, _ = unroll(loop)
    assert slot["terminated"][2].all() and slot["terminated"][5].all()
    assert not slot["truncated"].any()
    assert (slot["truncation_value"] == 0).all()
    loop.close()


@pytest.mark.parametrize(
    "env_kwargs, limit",
    [
        ({"episode_lengths": (2, 3), "reward": 0.5}, None),
        ({"terminate": False, "reward": 2.0}, 3),
    ],
)
def test_episode_returns_match_the_scripted_env(env_kwargs, limit):
    T, N = 4, 2  # episodes span unroll boundaries
    loop = make_loop(make_model(), T, N, max_episode_steps=limit, **env_kwargs)
    exp = expected_steps(
        3 * T,
        env_kwargs.get("episode_lengths", (3,)),
        env_kwargs.get("terminate", True),
        limit,
        env_kwargs["reward"],
    )
    returns, lengths = [], []
    for _ in range(3):
        _, result = unroll(loop)
        assert result.env_steps == T * N
        returns += result.episode_returns
        lengths += result.episode_lengths
    assert len(exp["returns"]) >= 3
    assert returns == [r for r in exp["returns"] for _ in range(N)]
    assert lengths == [n for n in exp["lengths"] for _ in range(N)]
    loop.close()


# ---------------------------------------------------------------------------------------------
# The learner's V-trace inputs and targets
# ---------------------------------------------------------------------------------------------

T_L = 7  # episodes of 3 steps end at t = 2 and t = 5


def learner_batch(model: ActorCritic) -> dict[str, torch.Tensor]:
    """Columns 0-1 terminate after 3 steps, columns 2-3 are truncated after 3 steps."""
    term_loop = make_loop(copy.deepcopy(model), T_L, 2, seed=1, episode_lengths=(3,))
    trunc_loop = make_loop(
        copy.deepcopy(model), T_L, 2, seed=2, max_episode_steps=3, terminate=False
    )
    s1, _ = unroll(term_loop)
    s2, _ = unroll(trunc_loop)
    term_loop.close()
    trunc_loop.close()
    return concat_slots([s1, s2])


def concat_slots(slots: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join slots along the batch axis: ``[T(+1), N]`` each -> ``[T(+1), sum N]``."""
    return {
        name: torch.cat([s[name] for s in slots], dim=0 if slots[0][name].ndim == 1 else 1)
        for name in slots[0]
    }


def spy_vtrace(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    real = vtrace.from_importance_weights
    names = ("log_rhos", "discounts", "rewards", "values", "bootstrap_value")

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        record = dict(zip(names, args, strict=False))
        record.update(kwargs)
        record["out"] = out
        calls.append(record)
        return out

    monkeypatch.setattr(vtrace, "from_importance_weights", spy)
    return calls


def learner_cfg(**kw) -> ImpalaAlgorithmConfig:
    return ImpalaAlgorithmConfig(gamma=GAMMA, **kw)


def test_learner_discounts_and_rewards_at_episode_ends(monkeypatch):
    model = make_model()
    batch = learner_batch(model)
    calls = spy_vtrace(monkeypatch)
    Learner(copy.deepcopy(model), learner_cfg()).update(batch)
    (call,) = calls
    ends = (2, 5)
    discounts, rewards = call["discounts"], call["rewards"]
    for t in range(T_L):
        # (a) termination and (b) truncation: discount 0 at the end step, gamma elsewhere
        assert discounts[t].tolist() == pytest.approx([0.0 if t in ends else GAMMA] * 4)
        # terminated columns: the plain reward
        assert rewards[t, :2].tolist() == [1.0, 1.0]
        if t in ends:
            # (b) truncated columns: reward + gamma * V(true final obs [3, ep])
            ep = ends.index(t)
            with torch.no_grad():
                v_final = model.value(0, torch.tensor([[3.0, ep]] * 2))
            torch.testing.assert_close(rewards[t, 2:], 1.0 + GAMMA * v_final)
        else:
            assert rewards[t, 2:].tolist() == [1.0, 1.0]
    # same weights for actor and learner: rho = 1, so at an end step vs == the adjusted reward
    vs = call["out"].vs
    for t in ends:
        torch.testing.assert_close(vs[t], rewards[t], atol=1e-5, rtol=1e-5)


def test_no_value_leaks_across_an_autoreset(monkeypatch):
    model = make_model()
    batch = learner_batch(model)
    calls = spy_vtrace(monkeypatch)
    # lambda < 1 cuts the traces, so V(x_{t+1}) enters the targets directly (with full on-policy
    # traces the targets telescope into n-step returns and values would barely matter)
    cfg = learner_cfg(vtrace_lambda=0.5)
    Learner(copy.deepcopy(model), cfg).update(batch)
    (call,) = calls
    assert call["lambda_"] == 0.5
    base = call["out"].vs

    # (c1) perturbing V at the first step of the next episode leaves vs up to the end unchanged
    for end in (2, 5):
        values = call["values"].clone()
        values[end + 1] += 1000.0
        vt = vtrace.from_importance_weights(
            call["log_rhos"],
            call["discounts"],
            call["rewards"],
            values,
            call["bootstrap_value"],
            lambda_=0.5,
        )
        torch.testing.assert_close(vt.vs[: end + 1], base[: end + 1])
        # counterfactual: had the discount at the end step not been 0, the value would leak
        leaky = vtrace.from_importance_weights(
            call["log_rhos"],
            torch.full_like(call["discounts"], GAMMA),
            call["rewards"],
            values,
            call["bootstrap_value"],
            lambda_=0.5,
        )
        assert (leaky.vs[end] - base[end]).abs().min() > 100.0

    # (c2) end to end: a wildly different post-reset observation changes nothing up to the end
    perturbed = {k: v.clone() for k, v in batch.items()}
    perturbed["obs"][3] = torch.tensor([50.0, -70.0])
    Learner(copy.deepcopy(model), cfg).update(perturbed)
    other = calls[1]
    assert (other["values"][3] - call["values"][3]).abs().min() > 1e-3
    torch.testing.assert_close(other["out"].vs[:3], base[:3])


@pytest.mark.parametrize("adv_mode", ["official", "acme"])
def test_learner_passes_adv_mode_to_vtrace(monkeypatch, adv_mode):
    model = make_model()
    batch = learner_batch(model)
    calls = spy_vtrace(monkeypatch)
    Learner(copy.deepcopy(model), learner_cfg(vtrace_lambda=0.5, adv_mode=adv_mode)).update(batch)
    (call,) = calls
    assert call["adv_mode"] == adv_mode


def test_learner_adv_mode_defaults_to_official():
    assert ImpalaAlgorithmConfig().adv_mode == "official"


def test_learner_weighs_the_entropy_bonus_by_its_current_coefficient():
    """The total loss holds ``entropy_coef * -mean(H)`` with the weight the trainer last set
    (the schedule's), not the config's initial value."""
    model = make_model()
    batch = learner_batch(model)
    losses = {}
    for coef in (0.0, 0.5):
        learner = Learner(copy.deepcopy(model), learner_cfg(entropy_coef=0.01))
        learner.entropy_coef = coef
        stats = learner.update(batch)
        assert stats.entropy_coef == coef
        losses[coef] = (stats.total_loss, stats.policy_entropy[0])
    (without, entropy), (with_half, _) = losses[0.0], losses[0.5]
    assert entropy > 0.1
    assert with_half - without == pytest.approx(-0.5 * entropy, rel=1e-5)


def test_learner_adds_the_entropy_floor_penalty_only_below_the_floor():
    """``algorithm.entropy_floor``: a floor under every decision's entropy adds nothing to the
    total loss; one above all of them adds ``entropy_floor_coef * (floor - mean(H))``."""
    model = make_model()
    batch = learner_batch(model)

    def total(**settings) -> tuple[float, float, dict[int, float]]:
        learner = Learner(copy.deepcopy(model), learner_cfg(entropy_coef=0.0, **settings))
        stats = learner.update(batch)
        return stats.total_loss, stats.policy_entropy[0], stats.policy_below_entropy_floor

    without, entropy, below = total()
    assert below == {}  # no floor: no figure
    floored, _, below = total(entropy_floor=0.0)
    assert floored == pytest.approx(without, rel=1e-6) and below == {0: 0.0}
    floored, _, below = total(entropy_floor=10.0, entropy_floor_coef=0.5)
    assert floored - without == pytest.approx(0.5 * (10.0 - entropy), rel=1e-5)
    assert below == {0: 1.0}


def test_learner_update_end_to_end_reports_policy_lag():
    model = make_model()
    batch = learner_batch(model)
    learner = Learner(copy.deepcopy(model), learner_cfg())
    before = [p.detach().clone() for p in learner.model.parameters()]
    stats = learner.update(batch)
    assert learner.num_updates == 1
    assert stats.policy_lag == [0, 0, 0, 0]
    for value in (stats.total_loss, stats.grad_norm, stats.learning_rate):
        assert math.isfinite(value)
    for d in (stats.policy_loss, stats.critic_value_loss, stats.policy_entropy):
        assert math.isfinite(d[0])
    assert any(
        not torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True)
    )

    learner.num_updates = 5
    batch["policy_version"] = torch.tensor([5, 4, 2, 0])
    stats = learner.update(batch)
    assert stats.policy_lag == [0, 1, 3, 5]
    assert learner.num_updates == 6


# ---------------------------------------------------------------------------------------------
# SequentialDistributedActors
# ---------------------------------------------------------------------------------------------


def actors_cfg() -> ImpalaAlgorithmConfig:
    return ImpalaAlgorithmConfig(
        n_rollout_steps=5, envs_per_actor=3, num_actors=2, actors_batch_size=2
    )


def collect(factory, model, seed: int, n: int = 3) -> list[dict[str, torch.Tensor]]:
    actors = SequentialDistributedActors(factory, model, actors_cfg(), seed)
    with actors:
        # the CPU batch is the actors' reusable buffer: clone it before the next collect
        return [
            {k: v.clone() for k, v in actors.collect_outputs("cpu").batch.items()} for _ in range(n)
        ]


@pytest.mark.parametrize(
    "factory",
    [EnvFactory(ENV_ID, {"episode_lengths": (2, 3)}), EnvFactory("CartPole-v1")],
    ids=["scripted", "cartpole"],
)
def test_sequential_actors_are_deterministic_for_a_seed(factory):
    env = factory()
    torch.manual_seed(0)
    model = ActorCritic(env.observation_space, env.action_space, hidden_sizes=(16,))
    env.close()
    a = collect(factory, model, seed=3)
    b = collect(factory, model, seed=3)
    c = collect(factory, model, seed=4)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert a[0]["obs"].shape == (6, 6, *env.observation_space.shape)
    # the three collects are different unrolls, and a different seed gives different actions
    assert not torch.equal(a[0]["action"], a[1]["action"])
    assert any(not torch.equal(x["action"], z["action"]) for x, z in zip(a, c, strict=True))


def test_policy_version_follows_broadcasts():
    model = make_model()
    factory = EnvFactory(ENV_ID)
    actors = SequentialDistributedActors(factory, model, actors_cfg(), seed=0)
    with actors:
        assert (actors.collect_outputs("cpu").batch["policy_version"] == 0).all()
        new_state = {k: v + 0.5 for k, v in model.state_dict().items()}
        actors.broadcast_updated_policy(model.state_dict())
        actors.broadcast_updated_policy(new_state)
        batch = actors.collect_outputs("cpu").batch
        assert batch["policy_version"].tolist() == [2] * 6
        for actor in actors.actors:
            assert actor.policy_version == 2
            for k, v in actor.model.state_dict().items():
                assert torch.equal(v, new_state[k]), k
        # the batch was produced by the new weights
        with torch.no_grad():
            acting = actors.actors[0].model
            expected = acting.policy(0, batch["obs"][:5]).log_prob(batch["action"][:5])
        torch.testing.assert_close(batch["behaviour_log_prob"], expected)


def test_scripted_env_really_is_action_independent():
    """Guard for the ground truth above: the env's trajectory ignores the actions."""
    from scripted_envs import ScriptedEnv

    trajectories = []
    for action in (0, 1):
        env = ScriptedEnv(episode_lengths=(2, 3))
        obs, _ = env.reset(seed=0)
        seq = [obs.tolist()]
        for _ in range(6):
            obs, _, term, _, _ = env.step(action)
            seq.append(obs.tolist())
            if term:
                obs, _ = env.reset()
                seq.append(obs.tolist())
        trajectories.append(seq)
    assert trajectories[0] == trajectories[1]
    assert np.array(trajectories[0])[:, 1].max() >= 2
