"""Tests for impala_rl.vtrace against a slow ground truth written from the paper's definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala_rl import config, vtrace

# ---------------------------------------------------------------------------------------------
# Ground truth: direct (non-recursive) evaluation of eq. 1 of the IMPALA paper, float64 numpy.
# ---------------------------------------------------------------------------------------------


def _clip(x: float, threshold: float | None) -> float:
    return x if threshold is None else min(threshold, x)


def ground_truth(
    log_rhos: np.ndarray,
    discounts: np.ndarray,
    rewards: np.ndarray,
    values: np.ndarray,
    bootstrap_value: np.ndarray,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    clip_c_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{k<t} gamma_k)(prod_{i<t} c_i) rho_t delta_t."""
    T, B = log_rhos.shape
    vs = np.zeros((T, B))
    pg = np.zeros((T, B))
    for b in range(B):

        def value(t: int, b: int = b) -> float:
            return float(bootstrap_value[b]) if t == T else float(values[t, b])

        for s in range(T):
            total = 0.0
            for t in range(s, T):
                gamma_prod = 1.0
                c_prod = 1.0
                for k in range(s, t):
                    gamma_prod *= discounts[k, b]
                    c_prod *= lambda_ * _clip(np.exp(log_rhos[k, b]), clip_c_threshold)
                rho_t = _clip(np.exp(log_rhos[t, b]), clip_rho_threshold)
                td = rewards[t, b] + discounts[t, b] * value(t + 1) - value(t)
                total += gamma_prod * c_prod * rho_t * td
            vs[s, b] = value(s) + total
        for s in range(T):
            v_next = bootstrap_value[b] if s == T - 1 else vs[s + 1, b]
            pg_rho = _clip(np.exp(log_rhos[s, b]), clip_pg_rho_threshold)
            pg[s, b] = pg_rho * (rewards[s, b] + discounts[s, b] * v_next - values[s, b])
    return vs, pg


def make_inputs(
    T: int, B: int, seed: int, zero_discount_at: int | None = None, random_discounts: bool = False
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if random_discounts:
        discounts = rng.uniform(0.0, 1.0, size=(T, B))
    else:
        discounts = np.full((T, B), 0.9)
    if zero_discount_at is not None:
        discounts[zero_discount_at, :] = 0.0
    return {
        "log_rhos": rng.uniform(-2.0, 2.0, size=(T, B)),
        "discounts": discounts,
        "rewards": rng.normal(size=(T, B)),
        "values": rng.normal(size=(T, B)),
        "bootstrap_value": rng.normal(size=(B,)),
    }


def to_torch(inputs: dict[str, np.ndarray], dtype: torch.dtype = torch.float64):
    return {k: torch.as_tensor(v, dtype=dtype) for k, v in inputs.items()}


SHAPES = [(1, 1), (5, 3), (20, 7)]
HYPERPARAMS = [
    {},  # all thresholds 1.0, lambda 1
    {"clip_rho_threshold": 2.0, "clip_c_threshold": 0.5, "clip_pg_rho_threshold": 1.5},
    {"clip_rho_threshold": None, "clip_c_threshold": None, "clip_pg_rho_threshold": None},
    {"clip_rho_threshold": 1.0, "clip_c_threshold": None, "clip_pg_rho_threshold": 2.0},
    {"lambda_": 0.9},
    {"lambda_": 0.5, "clip_rho_threshold": 1.5, "clip_c_threshold": 0.8},
    {"lambda_": 0.0},
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hparams", HYPERPARAMS)
@pytest.mark.parametrize(
    "discount_kind", ["constant", "random", "zero_in_middle", "random_zero_in_middle"]
)
def test_from_importance_weights_matches_ground_truth(shape, hparams, discount_kind):
    T, B = shape
    zero_at = T // 2 if "zero" in discount_kind and T > 1 else None
    inputs = make_inputs(
        T, B, seed=T * 100 + B, zero_discount_at=zero_at, random_discounts="random" in discount_kind
    )
    expected_vs, expected_pg = ground_truth(**inputs, **hparams)
    out = vtrace.from_importance_weights(**to_torch(inputs), **hparams)
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_pg, rtol=1e-10, atol=1e-10)

    rhos = np.exp(inputs["log_rhos"])
    np.testing.assert_allclose(out.rhos.numpy(), rhos, rtol=1e-12)
    rho_bar = hparams.get("clip_rho_threshold", 1.0)
    expected_clipped = rhos if rho_bar is None else np.minimum(rhos, rho_bar)
    np.testing.assert_allclose(out.clipped_rhos.numpy(), expected_clipped, rtol=1e-12)


def acme_pg_ground_truth(
    log_rhos: np.ndarray,
    discounts: np.ndarray,
    rewards: np.ndarray,
    values: np.ndarray,
    bootstrap_value: np.ndarray,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    clip_c_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> np.ndarray:
    """EvoRL's / Acme's ``adv_mode='acme'``, element by element: the policy-gradient target
    bootstraps from ``lambda v_{s+1} + (1 - lambda) V(x_{s+1})`` (``V(x_T)`` at the last step)."""
    vs, _ = ground_truth(
        log_rhos,
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold,
        clip_pg_rho_threshold,
        clip_c_threshold,
        lambda_,
    )
    T, B = log_rhos.shape
    pg = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            if s == T - 1:
                q_next = float(bootstrap_value[b])
            else:
                q_next = lambda_ * vs[s + 1, b] + (1.0 - lambda_) * values[s + 1, b]
            pg_rho = _clip(np.exp(log_rhos[s, b]), clip_pg_rho_threshold)
            pg[s, b] = pg_rho * (rewards[s, b] + discounts[s, b] * q_next - values[s, b])
    return pg


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hparams", HYPERPARAMS)
@pytest.mark.parametrize("discount_kind", ["random", "random_zero_in_middle"])
def test_adv_mode_official_and_acme_match_their_references(shape, hparams, discount_kind):
    T, B = shape
    zero_at = T // 2 if "zero" in discount_kind and T > 1 else None
    inputs = make_inputs(T, B, seed=T * 10 + B, zero_discount_at=zero_at, random_discounts=True)
    expected_vs, expected_official = ground_truth(**inputs, **hparams)
    expected_acme = acme_pg_ground_truth(**inputs, **hparams)
    official = vtrace.from_importance_weights(**to_torch(inputs), **hparams, adv_mode="official")
    acme = vtrace.from_importance_weights(**to_torch(inputs), **hparams, adv_mode="acme")
    np.testing.assert_allclose(official.pg_advantages.numpy(), expected_official, rtol=1e-10)
    np.testing.assert_allclose(acme.pg_advantages.numpy(), expected_acme, rtol=1e-10, atol=1e-10)
    # the mode changes the policy-gradient target only
    for name in ("vs", "clipped_rhos", "rhos"):
        torch.testing.assert_close(getattr(acme, name), getattr(official, name), rtol=0, atol=0)
    np.testing.assert_allclose(acme.vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)


def test_adv_mode_acme_differs_below_lambda_one_and_not_at_one():
    inputs = to_torch(make_inputs(20, 7, seed=5, random_discounts=True))
    for lambda_, differs in ((0.5, True), (1.0, False)):
        official = vtrace.from_importance_weights(**inputs, lambda_=lambda_)
        acme = vtrace.from_importance_weights(**inputs, lambda_=lambda_, adv_mode="acme")
        same = torch.equal(official.pg_advantages, acme.pg_advantages)
        assert same is not differs, lambda_
        # the last step bootstraps from V(x_T) in both modes
        torch.testing.assert_close(official.pg_advantages[-1], acme.pg_advantages[-1])


def test_adv_mode_default_is_official():
    inputs = to_torch(make_inputs(6, 3, seed=8, random_discounts=True))
    default = vtrace.from_importance_weights(**inputs, lambda_=0.7)
    official = vtrace.from_importance_weights(**inputs, lambda_=0.7, adv_mode="official")
    assert torch.equal(default.pg_advantages, official.pg_advantages)


def test_from_logits_passes_adv_mode():
    np_inputs = _logits_inputs(6, 3, 4, seed=9)
    t_inputs = {
        k: torch.as_tensor(v, dtype=torch.int64 if k == "actions" else torch.float64)
        for k, v in np_inputs.items()
    }
    out = vtrace.from_logits(**t_inputs, lambda_=0.6, adv_mode="acme")
    ref = vtrace.from_importance_weights(
        log_rhos=out.log_rhos,
        discounts=t_inputs["discounts"],
        rewards=t_inputs["rewards"],
        values=t_inputs["values"],
        bootstrap_value=t_inputs["bootstrap_value"],
        lambda_=0.6,
        adv_mode="acme",
    )
    torch.testing.assert_close(out.pg_advantages, ref.pg_advantages, rtol=0, atol=0)


def test_unknown_adv_mode_raises():
    with pytest.raises(ValueError, match="adv_mode"):
        vtrace.from_importance_weights(**_valid_iw(), adv_mode="rllib")
    assert config.ADV_MODES == vtrace.ADV_MODES  # the config's choices are V-trace's


def test_clipping_binds_in_ground_truth_inputs():
    """The random log-rhos straddle every threshold used above, so clipping is exercised."""
    for T, B in [(5, 3), (20, 7)]:
        rhos = np.exp(make_inputs(T, B, seed=T * 100 + B)["log_rhos"])
        for threshold in (0.5, 0.8, 1.0, 1.5, 2.0):
            assert (rhos > threshold).any() and (rhos < threshold).any()


def test_clipping_changes_result():
    """Sanity check that the thresholds matter (guards against a vacuous comparison)."""
    inputs = to_torch(make_inputs(20, 7, seed=1))
    clipped = vtrace.from_importance_weights(**inputs)
    unclipped = vtrace.from_importance_weights(
        **inputs, clip_rho_threshold=None, clip_c_threshold=None, clip_pg_rho_threshold=None
    )
    assert not torch.allclose(clipped.vs, unclipped.vs)
    assert not torch.allclose(clipped.pg_advantages, unclipped.pg_advantages)
    assert (clipped.clipped_rhos <= 1.0).all()
    assert (unclipped.clipped_rhos > 1.0).any()


def test_zero_discount_cuts_trajectory():
    """With discounts[t] = 0, vs[:t+1] must not depend on anything after t."""
    inputs = make_inputs(10, 4, seed=3, zero_discount_at=4)
    base = vtrace.from_importance_weights(**to_torch(inputs))
    changed = dict(inputs)
    changed["rewards"] = inputs["rewards"].copy()
    changed["rewards"][5:] += 100.0
    changed["values"] = inputs["values"].copy()
    changed["values"][5:] -= 50.0
    changed["bootstrap_value"] = inputs["bootstrap_value"] + 7.0
    other = vtrace.from_importance_weights(**to_torch(changed))
    torch.testing.assert_close(base.vs[:5], other.vs[:5])
    torch.testing.assert_close(base.pg_advantages[:5], other.pg_advantages[:5])


@pytest.mark.parametrize("shape", SHAPES)
def test_on_policy_equals_n_step_returns(shape):
    T, B = shape
    inputs = make_inputs(T, B, seed=7, random_discounts=True)
    inputs["log_rhos"] = np.zeros((T, B))
    out = vtrace.from_importance_weights(
        **to_torch(inputs),
        clip_rho_threshold=None,
        clip_c_threshold=None,
        clip_pg_rho_threshold=None,
    )
    d, r, boot = inputs["discounts"], inputs["rewards"], inputs["bootstrap_value"]
    returns = np.zeros((T, B))
    for s in range(T):
        for b in range(B):
            total, discount = 0.0, 1.0
            for t in range(s, T):
                total += discount * r[t, b]
                discount *= d[t, b]
            returns[s, b] = total + discount * boot[b]
    np.testing.assert_allclose(out.vs.numpy(), returns, rtol=1e-10, atol=1e-10)

    vs_next = np.concatenate([returns[1:], boot[None]], axis=0)
    np.testing.assert_allclose(
        out.pg_advantages.numpy(), r + d * vs_next - inputs["values"], rtol=1e-10, atol=1e-10
    )


def test_outputs_have_no_gradient():
    inputs = to_torch(make_inputs(5, 3, seed=11))
    for v in inputs.values():
        v.requires_grad_(True)
    out = vtrace.from_importance_weights(**inputs)
    for name, tensor in out._asdict().items():
        assert not tensor.requires_grad, name
        assert tensor.grad_fn is None, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_preserved(dtype):
    inputs = to_torch(make_inputs(5, 3, seed=12), dtype=dtype)
    out = vtrace.from_importance_weights(**inputs)
    for name, tensor in out._asdict().items():
        assert tensor.dtype == dtype, name


def test_float32_close_to_float64():
    inputs = make_inputs(20, 7, seed=13)
    out32 = vtrace.from_importance_weights(**to_torch(inputs, torch.float32))
    out64 = vtrace.from_importance_weights(**to_torch(inputs, torch.float64))
    np.testing.assert_allclose(out32.vs.numpy(), out64.vs.numpy(), rtol=1e-4, atol=1e-5)


def test_returns_field_order():
    assert vtrace.VTraceReturns._fields[:2] == ("vs", "pg_advantages")
    assert vtrace.VTraceFromLogitsReturns._fields == (
        "vs",
        "pg_advantages",
        "log_rhos",
        "behaviour_action_log_probs",
        "target_action_log_probs",
        "clipped_rhos",
        "rhos",
    )


# ---------------------------------------------------------------------------------------------
# from_logits
# ---------------------------------------------------------------------------------------------


def _np_log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    return np.log(probs)


def _logits_inputs(T: int, B: int, A: int, seed: int):
    rng = np.random.default_rng(seed)
    base = make_inputs(T, B, seed=seed + 1, random_discounts=True)
    del base["log_rhos"]
    return {
        "behaviour_policy_logits": rng.normal(scale=2.0, size=(T, B, A)),
        "target_policy_logits": rng.normal(scale=2.0, size=(T, B, A)),
        "actions": rng.integers(0, A, size=(T, B)),
        **base,
    }


@pytest.mark.parametrize("shape", [(1, 1, 2), (5, 3, 4), (20, 7, 6)])
@pytest.mark.parametrize("hparams", HYPERPARAMS[:3])
def test_from_logits_matches_importance_weights(shape, hparams):
    T, B, A = shape
    np_inputs = _logits_inputs(T, B, A, seed=21)
    actions = np_inputs["actions"]
    idx_t, idx_b = np.meshgrid(np.arange(T), np.arange(B), indexing="ij")
    target_lp = _np_log_softmax(np_inputs["target_policy_logits"])[idx_t, idx_b, actions]
    behaviour_lp = _np_log_softmax(np_inputs["behaviour_policy_logits"])[idx_t, idx_b, actions]
    log_rhos = target_lp - behaviour_lp

    t_inputs = {
        k: torch.as_tensor(v, dtype=torch.int64 if k == "actions" else torch.float64)
        for k, v in np_inputs.items()
    }
    t_inputs["target_policy_logits"].requires_grad_(True)
    out = vtrace.from_logits(**t_inputs, **hparams)

    np.testing.assert_allclose(out.log_rhos.numpy(), log_rhos, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        out.behaviour_action_log_probs.numpy(), behaviour_lp, rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(
        out.target_action_log_probs.detach().numpy(), target_lp, rtol=1e-10, atol=1e-12
    )

    ref = vtrace.from_importance_weights(
        log_rhos=torch.as_tensor(log_rhos),
        discounts=t_inputs["discounts"],
        rewards=t_inputs["rewards"],
        values=t_inputs["values"],
        bootstrap_value=t_inputs["bootstrap_value"],
        **hparams,
    )
    for name in ("vs", "pg_advantages", "clipped_rhos", "rhos"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-10, atol=1e-10)

    # Also against the paper-definition ground truth.
    gt_vs, gt_pg = ground_truth(
        log_rhos,
        np_inputs["discounts"],
        np_inputs["rewards"],
        np_inputs["values"],
        np_inputs["bootstrap_value"],
        **hparams,
    )
    np.testing.assert_allclose(out.vs.numpy(), gt_vs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.pg_advantages.numpy(), gt_pg, rtol=1e-9, atol=1e-9)


def test_from_logits_gradient_only_through_target_log_probs():
    np_inputs = _logits_inputs(5, 3, 4, seed=31)
    t_inputs = {
        k: torch.as_tensor(v, dtype=torch.int64 if k == "actions" else torch.float32)
        for k, v in np_inputs.items()
    }
    for k in ("behaviour_policy_logits", "target_policy_logits", "values", "bootstrap_value"):
        t_inputs[k].requires_grad_(True)
    out = vtrace.from_logits(**t_inputs)

    assert out.target_action_log_probs.grad_fn is not None
    for name in ("vs", "pg_advantages", "log_rhos", "behaviour_action_log_probs", "rhos"):
        assert not getattr(out, name).requires_grad, name
    assert not out.clipped_rhos.requires_grad

    out.target_action_log_probs.sum().backward()
    grad = t_inputs["target_policy_logits"].grad
    assert grad is not None and grad.abs().sum() > 0
    assert t_inputs["behaviour_policy_logits"].grad is None
    for name, tensor in out._asdict().items():
        assert tensor.dtype == torch.float32, name


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _valid_iw(T: int = 5, B: int = 3) -> dict[str, torch.Tensor]:
    return to_torch(make_inputs(T, B, seed=0), dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "bad_shape"),
    [
        ("log_rhos", (5,)),
        ("log_rhos", (5, 3, 1)),
        ("discounts", (5, 4)),
        ("rewards", (5,)),
        ("values", (4, 3)),
        ("values", (5, 3, 1)),
        ("bootstrap_value", (3, 1)),
        ("bootstrap_value", (4,)),
        ("bootstrap_value", ()),
    ],
)
def test_from_importance_weights_bad_shapes(name, bad_shape):
    inputs = _valid_iw()
    inputs[name] = torch.zeros(bad_shape)
    with pytest.raises(ValueError, match=name) as excinfo:
        vtrace.from_importance_weights(**inputs)
    assert str(tuple(bad_shape)) in str(excinfo.value)


def test_shape_error_message_is_explicit():
    inputs = _valid_iw()
    inputs["rewards"] = torch.zeros(5)
    with pytest.raises(ValueError) as excinfo:
        vtrace.from_importance_weights(**inputs)
    assert str(excinfo.value) == "rewards must have shape [T, B] = [5, 3], got (5,)"


def test_empty_time_dimension_raises():
    inputs = _valid_iw()
    for k in ("log_rhos", "discounts", "rewards", "values"):
        inputs[k] = torch.zeros(0, 3)
    with pytest.raises(ValueError, match="log_rhos"):
        vtrace.from_importance_weights(**inputs)


@pytest.mark.parametrize("lambda_", [-0.1, 1.1, float("nan")])
def test_invalid_lambda_raises(lambda_):
    with pytest.raises(ValueError, match="lambda_"):
        vtrace.from_importance_weights(**_valid_iw(), lambda_=lambda_)


@pytest.mark.parametrize(
    "name", ["clip_rho_threshold", "clip_pg_rho_threshold", "clip_c_threshold"]
)
def test_negative_threshold_raises(name):
    with pytest.raises(ValueError, match=name):
        vtrace.from_importance_weights(**_valid_iw(), **{name: -1.0})


def _valid_logits(T: int = 5, B: int = 3, A: int = 4) -> dict[str, torch.Tensor]:
    np_inputs = _logits_inputs(T, B, A, seed=41)
    return {
        k: torch.as_tensor(v, dtype=torch.int64 if k == "actions" else torch.float32)
        for k, v in np_inputs.items()
    }


@pytest.mark.parametrize(
    ("name", "bad_shape"),
    [
        ("behaviour_policy_logits", (5, 3)),
        ("target_policy_logits", (5, 3, 5)),
        ("target_policy_logits", (5, 3)),
        ("discounts", (5, 2)),
        ("rewards", (3, 5)),
        ("values", (5, 3, 4)),
        ("bootstrap_value", (5, 3)),
    ],
)
def test_from_logits_bad_shapes(name, bad_shape):
    inputs = _valid_logits()
    inputs[name] = torch.zeros(bad_shape)
    with pytest.raises(ValueError, match=name) as excinfo:
        vtrace.from_logits(**inputs)
    assert str(tuple(bad_shape)) in str(excinfo.value)


@pytest.mark.parametrize("bad", [torch.zeros(5, 3, 1, dtype=torch.int64), torch.zeros(5)])
def test_from_logits_bad_actions_shape(bad):
    inputs = _valid_logits()
    inputs["actions"] = bad.long()
    with pytest.raises(ValueError, match="actions"):
        vtrace.from_logits(**inputs)


def test_from_logits_float_actions_raise():
    inputs = _valid_logits()
    inputs["actions"] = inputs["actions"].float()
    with pytest.raises(ValueError, match="actions"):
        vtrace.from_logits(**inputs)


def test_from_logits_invalid_lambda_raises():
    with pytest.raises(ValueError, match="lambda_"):
        vtrace.from_logits(**_valid_logits(), lambda_=2.0)


@pytest.mark.parametrize("horizon", [1, 2, 3, 7, 8, 80, 129])
def test_backward_recursion_is_the_sequential_recursion(horizon):
    """The parallel scan equals ``x_t = deltas_t + decay_t x_{t+1}`` step by step, episode ends
    (decay 0) included."""
    gen = torch.Generator().manual_seed(horizon)
    deltas = torch.randn(horizon, 5, generator=gen, dtype=torch.float64)
    decay = torch.rand(horizon, 5, generator=gen, dtype=torch.float64)
    decay[torch.rand(horizon, 5, generator=gen) < 0.1] = 0.0
    expected = torch.zeros_like(deltas)
    for b in range(5):
        acc = 0.0
        for t in reversed(range(horizon)):
            acc = float(deltas[t, b]) + float(decay[t, b]) * acc
            expected[t, b] = acc
    torch.testing.assert_close(
        vtrace.backward_recursion(deltas, decay), expected, rtol=1e-12, atol=1e-12
    )
