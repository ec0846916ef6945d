"""Tests for impala_rl.nn: distributions, action heads, MLP and ActorCritic."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch
from torch import distributions as td

from impala_rl.nn import (
    ACTIVATIONS,
    MLP,
    ActionDistribution,
    ActionHead,
    ActorCritic,
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    MultiCategoricalDistribution,
    act,
    make_action_head,
    make_activation,
)

T, B = 3, 4
spaces = gymnasium.spaces


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_dist(kind: str, batch: tuple[int, ...] = (T, B)) -> tuple[ActionDistribution, object]:
    """Return (our distribution, torch.distributions reference) for ``kind``."""
    torch.manual_seed(0)
    if kind == "categorical":
        logits = torch.randn(*batch, 5)
        return CategoricalDistribution(logits), td.Categorical(logits=logits)
    if kind == "bernoulli":
        logits = torch.randn(*batch, 6)
        return BernoulliDistribution(logits), td.Independent(td.Bernoulli(logits=logits), 1)
    if kind == "gaussian":
        mean = torch.randn(*batch, 3)
        log_std = torch.randn(3) * 0.5
        ref = td.Independent(td.Normal(mean, log_std.exp().expand_as(mean)), 1)
        return DiagGaussianDistribution(mean, log_std), ref
    raise AssertionError(kind)


KINDS = ["categorical", "bernoulli", "gaussian"]


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_and_entropy_match_torch(kind: str) -> None:
    dist, ref = make_dist(kind)
    actions = dist.sample(gen(1))
    torch.testing.assert_close(dist.log_prob(actions), ref.log_prob(actions.float()))
    torch.testing.assert_close(dist.entropy(), ref.entropy())
    assert dist.log_prob(actions).shape == (T, B)
    assert dist.entropy().shape == (T, B)
    assert dist.batch_shape == (T, B)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_reproducible_with_generator(kind: str) -> None:
    dist, _ = make_dist(kind, batch=(64,))
    a1, a2 = dist.sample(gen(123)), dist.sample(gen(123))
    a3 = dist.sample(gen(456))
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, a3)
    # The global RNG does not interfere with seeded sampling.
    torch.manual_seed(999)
    assert torch.equal(a1, dist.sample(gen(123)))


def test_sample_shapes_and_dtypes() -> None:
    cat, _ = make_dist("categorical")
    ber, _ = make_dist("bernoulli")
    gau, _ = make_dist("gaussian")
    assert cat.sample().shape == (T, B) and cat.sample().dtype == torch.int64
    assert ber.sample().shape == (T, B, 6) and ber.sample().dtype == torch.int64
    assert gau.sample().shape == (T, B, 3) and gau.sample().dtype == torch.float32


def test_categorical_empirical_frequencies() -> None:
    logits = torch.tensor([0.0, 1.0, -1.0, 2.0])
    n = 20000
    dist = CategoricalDistribution(logits.expand(n, 4))
    samples = dist.sample(gen(0))
    freq = torch.bincount(samples, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits, -1), atol=0.02, rtol=0)


def test_bernoulli_and_gaussian_empirical_moments() -> None:
    n = 20000
    logits = torch.tensor([-1.0, 0.0, 2.0])
    ber = BernoulliDistribution(logits.expand(n, 3))
    freq = ber.sample(gen(0)).float().mean(0)
    torch.testing.assert_close(freq, torch.sigmoid(logits), atol=0.02, rtol=0)

    mean = torch.tensor([1.0, -2.0])
    log_std = torch.tensor([0.0, -1.0])
    gau = DiagGaussianDistribution(mean.expand(n, 2), log_std)
    s = gau.sample(gen(0))
    torch.testing.assert_close(s.mean(0), mean, atol=0.03, rtol=0)
    torch.testing.assert_close(s.std(0), log_std.exp(), atol=0.03, rtol=0)


def test_modes() -> None:
    cat, ref = make_dist("categorical")
    assert torch.equal(cat.mode(), ref.logits.argmax(-1))
    ber, _ = make_dist("bernoulli")
    assert torch.equal(ber.mode(), (ber.logits > 0).long())
    gau, _ = make_dist("gaussian")
    assert torch.equal(gau.mode(), gau.mean)


def test_bernoulli_log_prob_accepts_int_and_float() -> None:
    dist, _ = make_dist("bernoulli")
    a = dist.sample(gen(3))
    torch.testing.assert_close(dist.log_prob(a), dist.log_prob(a.float()))


def test_multicategorical_matches_independent_categoricals() -> None:
    nvec = (2, 3, 4)
    logits = torch.randn(T, B, sum(nvec), generator=gen(0))
    dist = MultiCategoricalDistribution(logits, nvec)
    a = dist.sample(gen(1))
    assert a.shape == (T, B, 3) and a.dtype == torch.int64
    for i, n in enumerate(nvec):
        assert int(a[..., i].max()) < n
    refs = [td.Categorical(logits=c) for c in torch.split(logits, nvec, dim=-1)]
    ref_lp = sum(r.log_prob(a[..., i]) for i, r in enumerate(refs))
    ref_ent = sum(r.entropy() for r in refs)
    torch.testing.assert_close(dist.log_prob(a), ref_lp)
    torch.testing.assert_close(dist.entropy(), ref_ent)
    assert torch.equal(dist.mode(), torch.stack([r.logits.argmax(-1) for r in refs], -1))
    assert torch.equal(a, dist.sample(gen(1)))
    assert not torch.equal(a, dist.sample(gen(2)))


def test_log_prob_is_differentiable() -> None:
    logits = torch.randn(B, 4, requires_grad=True)
    dist = CategoricalDistribution(logits)
    a = dist.sample(gen(0))
    assert not a.requires_grad
    (dist.log_prob(a).sum() + dist.entropy().sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


# ----------------------------------------------------------------------------- action heads


def test_discrete_head() -> None:
    head = make_action_head(spaces.Discrete(3), 8)
    assert isinstance(head, ActionHead)
    assert head.action_shape == () and head.action_dtype == torch.int64
    dist = head(torch.randn(T, B, 8))
    assert isinstance(dist, CategoricalDistribution)
    a = dist.sample(gen(0))
    assert a.shape == (T, B)
    env_a = head.to_env(a.reshape(-1))
    assert env_a.dtype == np.int64 and env_a.shape == (T * B,)
    assert all(spaces.Discrete(3).contains(x) for x in env_a)


def test_initial_policy_near_uniform() -> None:
    head = make_action_head(spaces.Discrete(4), 16)
    probs = head(torch.randn(10, 16)).logits.exp()
    torch.testing.assert_close(probs, torch.full_like(probs, 0.25), atol=0.05, rtol=0)


def test_discrete_head_with_start() -> None:
    space = spaces.Discrete(3, start=1)
    head = make_action_head(space, 8)
    env_a = head.to_env(torch.tensor([0, 1, 2]))
    np.testing.assert_array_equal(env_a, [1, 2, 3])
    assert all(space.contains(x) for x in env_a)


def test_multidiscrete_head() -> None:
    space = spaces.MultiDiscrete([2, 3, 4])
    head = make_action_head(space, 8)
    assert head.action_shape == (3,) and head.action_dtype == torch.int64
    dist = head(torch.randn(T, B, 8))
    a = dist.sample(gen(0))
    assert a.shape == (T, B, 3)
    env_a = head.to_env(a.reshape(-1, 3))
    assert env_a.dtype == np.int64 and env_a.shape == (T * B, 3)
    assert all(space.contains(x) for x in env_a)


def test_multibinary_head() -> None:
    space = spaces.MultiBinary(5)
    head = make_action_head(space, 8)
    assert head.action_shape == (5,)
    a = head(torch.randn(B, 8)).sample(gen(0))
    assert a.shape == (B, 5)
    env_a = head.to_env(a)
    assert env_a.dtype == np.int8 and env_a.shape == (B, 5)
    assert all(space.contains(x) for x in env_a)


def test_box_head() -> None:
    space = spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    head = make_action_head(space, 8)
    assert head.action_shape == (2,) and head.action_dtype == torch.float32
    log_std = [p for n, p in head.named_parameters() if "log_std" in n]
    assert len(log_std) == 1 and torch.equal(log_std[0].detach(), torch.zeros(2))
    dist = head(torch.randn(T, B, 8))
    assert isinstance(dist, DiagGaussianDistribution)
    a = dist.sample(gen(0)) * 5  # push far out of bounds
    assert dist.log_prob(a).shape == (T, B)
    env_a = head.to_env(a.reshape(-1, 2))
    assert env_a.shape == (T * B, 2) and env_a.dtype == np.float32
    assert (env_a >= -1).all() and (env_a <= 1).all()
    assert all(space.contains(x) for x in env_a)


def test_box_head_multidim_shape() -> None:
    space = spaces.Box(-0.5, 2.0, (2, 2), dtype=np.float32)
    head = make_action_head(space, 8)
    assert head.action_shape == (4,)
    a = torch.tensor([[-3.0, 0.0, 1.0, 9.0], [0.1, 0.2, 0.3, 0.4]])
    env_a = head.to_env(a)
    assert env_a.shape == (2, 2, 2)
    np.testing.assert_allclose(env_a[0], [[-0.5, 0.0], [1.0, 2.0]])
    assert all(space.contains(x) for x in env_a)


def test_box_head_infinite_bounds_not_clipped() -> None:
    head = make_action_head(spaces.Box(-np.inf, np.inf, (2,), dtype=np.float32), 4)
    a = torch.tensor([[-100.0, 100.0]])
    np.testing.assert_array_equal(head.to_env(a), [[-100.0, 100.0]])


def test_unsupported_action_space_raises() -> None:
    with pytest.raises(ValueError, match="Discrete.*MultiDiscrete.*MultiBinary.*Box"):
        make_action_head(spaces.Text(5), 8)


# ----------------------------------------------------------------------------- MLP


def test_make_activation() -> None:
    for name in ACTIVATIONS:
        assert isinstance(make_activation(name), torch.nn.Module)
    with pytest.raises(ValueError, match="tanh"):
        make_activation("sigmoidish")


def test_mlp_shapes() -> None:
    mlp = MLP(6, (32, 16), "relu")
    assert mlp.out_features == 16
    assert mlp(torch.randn(T, B, 6)).shape == (T, B, 16)
    ident = MLP(6, (), "tanh")
    assert ident.out_features == 6
    x = torch.randn(B, 6)
    assert torch.equal(ident(x), x)
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in linears)


# ----------------------------------------------------------------------------- ActorCritic

OBS = spaces.Box(-np.inf, np.inf, (4,), dtype=np.float32)
ACTION_SPACES = [
    spaces.Discrete(3),
    spaces.MultiDiscrete([2, 3]),
    spaces.MultiBinary(3),
    spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
]


@pytest.mark.parametrize("action_space", ACTION_SPACES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("shared", [False, True])
def test_actor_critic_shapes(action_space: gymnasium.Space, shared: bool) -> None:
    model = ActorCritic(OBS, action_space, hidden_sizes=(16, 16), shared_torso=shared)
    head = model.action_head(0)
    assert head is model.action_head(0)
    for batch in [(T, B), (B,)]:
        dist, value = model.policy_value(0, torch.randn(*batch, 4))
        assert isinstance(dist, ActionDistribution)
        assert value.shape == batch
        a = dist.sample(gen(0))
        assert dist.log_prob(a).shape == batch
        assert dist.entropy().shape == batch
        assert model.value(0, torch.randn(*batch, 4)).shape == batch
        env_a = head.to_env(a.reshape(-1, *head.action_shape))
        assert all(action_space.contains(x) for x in env_a)


def test_actor_critic_flattens_obs_and_casts() -> None:
    obs_space = spaces.Box(0, 255, (2, 3), dtype=np.uint8)
    model = ActorCritic(obs_space, spaces.Discrete(2), hidden_sizes=(8,))
    obs = torch.randint(0, 255, (T, B, 2, 3), dtype=torch.uint8)
    _, value = model.policy_value(0, obs)
    assert value.shape == (T, B) and value.dtype == torch.float32
    with pytest.raises(ValueError):
        model.policy_value(0, torch.randn(B, 5))
    with pytest.raises(ValueError):
        model.policy(0, torch.randn(B, 5))


def test_value_matches_forward() -> None:
    for shared in (False, True):
        model = ActorCritic(OBS, spaces.Discrete(3), shared_torso=shared)
        obs = torch.randn(T, B, 4)
        dist, value = model.policy_value(0, obs)
        torch.testing.assert_close(model.value(0, obs), value)
        torch.testing.assert_close(model.policy(0, obs).logits, dist.logits)


def test_shared_vs_separate_param_counts() -> None:
    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    hidden = (32, 32)
    shared = ActorCritic(OBS, spaces.Discrete(3), hidden, shared_torso=True)
    separate = ActorCritic(OBS, spaces.Discrete(3), hidden, shared_torso=False)
    torso = count(MLP(4, hidden, "tanh"))
    heads = (32 * 3 + 3) + (32 + 1)
    assert count(shared) == torso + heads
    assert count(separate) == 2 * torso + heads


@pytest.mark.parametrize("action_space", ACTION_SPACES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("shared", [False, True])
def test_gradients_reach_all_parameters(action_space: gymnasium.Space, shared: bool) -> None:
    model = ActorCritic(OBS, action_space, hidden_sizes=(8,), activation="elu", shared_torso=shared)
    dist, value = model.policy_value(0, torch.randn(T, B, 4))
    a = dist.sample(gen(0))
    loss = -dist.log_prob(a).mean() - 0.01 * dist.entropy().mean() + value.pow(2).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("action_space", ACTION_SPACES, ids=lambda s: type(s).__name__)
def test_act_without_a_core_samples_the_policy(action_space: gymnasium.Space) -> None:
    """``nn.act`` on a model without a core: the policy's sample (same generator) or mode,
    its log-prob, the env's form of the action and no core state."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, action_space, hidden_sizes=(8,))
    obs = torch.randn(B, 4)
    dist = model.policy(0, obs)
    acted = act(model, 0, obs, generator=gen(5))
    assert acted.core_state is None
    assert torch.equal(acted.action, dist.sample(gen(5)))
    torch.testing.assert_close(acted.log_prob, dist.log_prob(acted.action))
    assert all(action_space.contains(x) for x in acted.env_action)
    assert torch.equal(act(model, 0, obs, deterministic=True).action, dist.mode())
    model_dist, state = model.act(0, obs)
    assert state is None and torch.equal(model_dist.mode(), dist.mode())


@pytest.mark.parametrize("action_space", ACTION_SPACES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("nested", [False, True])
def test_a_state_dict_with_the_old_action_head_names_loads_with_identical_outputs(
    action_space: gymnasium.Space, nested: bool
) -> None:
    """Checkpoints written before one class served every env name a plain env's parts
    ``action_head.*`` (earliest), ``policy_torso.*``, ``value_torso.*`` and ``value_head.*``;
    they load (strictly) into the model, whose parts are step key 0's
    (``policies.0.action_head.*``, ...), with the same outputs. ``nested``: the model is a
    submodule (its names carry a prefix)."""
    torch.manual_seed(0)
    saved = ActorCritic(OBS, action_space, hidden_sizes=(8,), shared_torso=False)
    torch.manual_seed(1)
    fresh = ActorCritic(OBS, action_space, hidden_sizes=(8,), shared_torso=False)
    names = saved.state_dict().keys()
    assert any(n.startswith("policies.0.action_head.") for n in names)
    earlier = {
        "policies.0.action_head.": "action_head.",
        "policies.0.torso.": "policy_torso.",
        "critics.0.torso.": "value_torso.",
        "critics.0.head.": "value_head.",
    }

    def earlier_name(name: str) -> str:
        for new, old_name in earlier.items():
            if name.startswith(new):
                return old_name + name[len(new) :]
        raise AssertionError(name)

    old = {earlier_name(k): v for k, v in saved.state_dict().items()}
    assert any(k.startswith("action_head.") for k in old)
    obs = torch.randn(T, B, 4, generator=gen(2))
    with torch.no_grad():
        dist, value = saved.policy_value(0, obs)
        action = dist.sample(gen(3))
        before = fresh.policy_value(0, obs)[1]
    assert not torch.equal(before, value)
    if nested:
        outer = torch.nn.ModuleDict({"model": fresh})
        outer.load_state_dict({f"model.{k}": v for k, v in old.items()})
    else:
        fresh.load_state_dict(old)
    with torch.no_grad():
        loaded, loaded_value = fresh.policy_value(0, obs)
    assert torch.equal(loaded_value, value)
    assert torch.equal(loaded.log_prob(action), dist.log_prob(action))
    assert torch.equal(loaded.entropy(), dist.entropy())
    assert torch.equal(loaded.mode(), dist.mode())
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "obs_space", [spaces.Discrete(3), spaces.Tuple((OBS,))]
)  # a Dict keeps its structure: tests/test_dict_obs.py
def test_non_box_observation_space_raises(obs_space: gymnasium.Space) -> None:
    with pytest.raises(ValueError, match="Box"):
        ActorCritic(obs_space, spaces.Discrete(2))


# -- observation normalization, weight init, separate actor and critic sizes ------------------


def test_running_obs_norm_matches_the_statistics_of_all_data_seen():
    from impala_rl.nn.normalization import RunningObsNorm

    gen = torch.Generator().manual_seed(0)
    norm = RunningObsNorm((3,))
    chunks = [torch.randn(n, 3, generator=gen) * 4 + 7 for n in (1, 5, 64, 2)]
    for chunk in chunks:
        norm.update(chunk.reshape(-1, 1, 3))  # any leading dims
    data = torch.cat(chunks).double().numpy()
    assert int(norm.count) == len(data)
    np.testing.assert_allclose(norm.mean.numpy(), data.mean(0), rtol=1e-12)
    np.testing.assert_allclose(norm.var.numpy(), data.var(0), rtol=1e-10)
    x = torch.tensor([[7.0, 7.0, 1e6]])
    expected = (x.double().numpy() - data.mean(0)) / np.sqrt(data.var(0) + 1e-8)
    np.testing.assert_allclose(norm(x).numpy(), np.clip(expected, -10, 10), rtol=1e-5)


def test_uncentered_obs_norm_divides_by_the_root_mean_square_and_keeps_the_offset():
    # 6 readings: three resting near 0.9 (a lidar's free distance), three around 0
    x = torch.tensor([[0.8, -2.0], [0.9, 2.0], [1.0, 0.0]]).repeat(1, 3)
    norm = _mlp_model(normalize_obs=True, normalize_obs_center=False).observation_normalizer(0)
    plain = _mlp_model(normalize_obs=True).observation_normalizer(0)
    for n in (norm, plain):
        n.update(x)
    rms = x.double().square().mean(0).sqrt()
    np.testing.assert_allclose(norm(x).numpy(), (x.double() / rms).numpy(), rtol=1e-5)
    assert (norm(x)[:, 0] > 0.8).all()  # the offset stays: readings near 0.9, scaled by ~1.1
    np.testing.assert_allclose(norm(x)[:, 1].numpy(), plain(x)[:, 1].numpy(), rtol=1e-5)
    assert plain(x)[:, 0].mean().abs() < 1e-5  # centered: the offset is gone
    # the same statistics (one state dict for both), so either setting loads any checkpoint
    assert norm.state_dict().keys() == plain.state_dict().keys()


def _mlp_model(**model):
    from impala_rl.config import ModelConfig
    from impala_rl.nn.factory import build_model

    space = gymnasium.spaces.Box(-1, 1, (6,), np.float32)
    return build_model(ModelConfig(**model), space, gymnasium.spaces.Discrete(4))


def _gain(weight: torch.Tensor) -> float:
    """The gain of an orthogonal-initialised weight: its singular values, all equal."""
    s = torch.linalg.svdvals(weight.detach().reshape(weight.shape[0], -1))
    assert float(s.max() - s.min()) < 1e-4 * float(s.max())
    return float(s[0])


def test_orthogonal_init_uses_the_usual_gains_per_layer_type():
    torch.manual_seed(0)
    model = _mlp_model(init="orthogonal", hidden_sizes=[32, 32])
    hidden = [m for m in model.policies["0"].torso.modules() if isinstance(m, torch.nn.Linear)]
    assert len(hidden) == 2
    for layer in hidden:
        assert _gain(layer.weight) == pytest.approx(np.sqrt(2), rel=1e-4)
        assert not layer.bias.any()
    assert _gain(model.action_head(0).logits.weight) == pytest.approx(0.01, rel=1e-4)
    assert _gain(model.critics["0"].head.weight) == pytest.approx(1.0, rel=1e-4)


def test_torch_init_is_pytorchs_default_and_builtin_is_unchanged():
    torch.manual_seed(0)
    builtin = _mlp_model()
    torch.manual_seed(0)
    also_builtin = _mlp_model(init="builtin")
    for a, b in zip(builtin.parameters(), also_builtin.parameters(), strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    default = _mlp_model(init="torch")
    first = next(m for m in default.policies["0"].torso.modules() if isinstance(m, torch.nn.Linear))
    bound = 1 / np.sqrt(first.in_features)  # PyTorch's Linear init: U(-1/sqrt(in), 1/sqrt(in))
    assert first.bias.abs().max() <= bound and first.bias.abs().max() > 0
    assert first.weight.abs().max() <= bound


def test_actor_and_critic_torsos_take_their_own_sizes():
    model = _mlp_model(actor_hidden_sizes=[8], critic_hidden_sizes=[32, 16])
    widths = [
        [m.out_features for m in torso.modules() if isinstance(m, torch.nn.Linear)]
        for torso in (model.policies["0"].torso, model.critics["0"].torso)
    ]
    assert widths == [[8], [32, 16]]
    dist, value = model.policy_value(0, torch.zeros(5, 6))
    assert value.shape == (5,) and dist.sample().shape == (5,)
