"""model.precision (bf16 autocast, fp32 weights) and model.channels_last."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from impala_rl.actors.subprocess import SharedWeights
from impala_rl.config import ConfigError, ImpalaAlgorithmConfig, ModelConfig, load_config
from impala_rl.learner import Learner
from impala_rl.nn import ActorCritic
from impala_rl.nn import core as core_module
from impala_rl.nn.factory import build_model

FRAMES = gym.spaces.Box(0, 255, (4, 36, 36), dtype=np.uint8)
VECTOR = gym.spaces.Box(-np.inf, np.inf, (4,), dtype=np.float32)
ACTIONS = gym.spaces.Discrete(3)
NCHW_VS_NHWC = {"atol": 1e-4, "rtol": 1e-4}  # other kernels, other summation order


def _pair(space: gym.Space, core: str = "none", **kwargs) -> tuple[ActorCritic, ActorCritic]:
    """A fp32 model and one built with ``kwargs`` holding the same weights."""
    torch.manual_seed(0)
    encoder = "nature_cnn" if space is FRAMES else "mlp"
    base = ModelConfig(encoder=encoder, shared_torso=True, core=core, lstm_hidden_size=32)
    ref = build_model(base, space, ACTIONS)
    other = build_model(ModelConfig(**{**base.__dict__, **kwargs}), space, ACTIONS)
    other.load_state_dict(ref.state_dict())
    return ref, other


def _obs(space: gym.Space, T: int = 5, B: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if space is FRAMES:
        return torch.randint(0, 256, (T, B, *space.shape), dtype=torch.uint8, generator=g)
    return torch.randn(T, B, *space.shape, generator=g)


def _outputs(model: ActorCritic, obs: torch.Tensor):
    """Logits and values over a time-major batch ``[T, B]``, and the core state after it (a
    core: the encoder, the core along the columns, the heads; else ``None``)."""
    if model.core is None:
        dist, value = model.policy_value(0, obs)
        return dist.logits, value, None
    first = torch.zeros(obs.shape[:2], dtype=torch.bool)
    y, state = model.core(model.encode(0, obs), first, None)
    dist, value = model.heads(0, y)
    return dist.logits, value, state


def test_precision_and_core_are_validated_with_the_valid_values():
    with pytest.raises(ConfigError, match=r"model.precision.*'fp16'.*fp32 \| bf16"):
        load_config("cartpole", ["model.precision=fp16"])
    with pytest.raises(ConfigError, match=r"model.lstm_hidden_size"):
        load_config("cartpole", ["model.lstm_hidden_size=0"])
    with pytest.raises(ValueError, match="precision"):
        ActorCritic(VECTOR, ACTIONS, precision="half")


@pytest.mark.parametrize("space", [FRAMES, VECTOR], ids=["cnn", "mlp"])
@pytest.mark.parametrize("core", ["none", "lstm"])
def test_bf16_autocast_keeps_fp32_weights_and_outputs_close_to_fp32(space, core):
    ref, bf16 = _pair(space, core, precision="bf16")
    obs = _obs(space)
    with torch.no_grad():
        a_logits, a_value, _ = _outputs(ref, obs)
        b_logits, b_value, b_state = _outputs(bf16, obs)
    assert b_value.dtype == torch.float32 and b_logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    if core == "lstm":
        assert b_state[0].dtype == b_state[1].dtype == torch.float32
    # bf16 keeps ~3 significant digits: close, not equal
    torch.testing.assert_close(b_logits, a_logits, atol=0.05, rtol=0.05)
    torch.testing.assert_close(b_value, a_value, atol=0.05, rtol=0.05)
    assert not torch.equal(b_value, a_value)
    # one acting step gives the first row of the sequence, its state in float32
    with torch.no_grad():
        first = torch.ones(obs.shape[1], dtype=torch.bool)
        dist, state = bf16.act(0, obs[0], None, first, bf16.initial_state(obs.shape[1]))
    assert dist.logits.dtype == torch.float32
    torch.testing.assert_close(dist.logits, b_logits[0])
    if core == "lstm":
        assert state[0].dtype == state[1].dtype == torch.float32


@pytest.mark.parametrize("cpu_has_bf16_lstm", [True, False])
def test_bf16_runs_the_core_under_autocast_where_the_cpu_can(monkeypatch, cpu_has_bf16_lstm):
    """Under bf16 autocast where the CPU's oneDNN has a bf16 LSTM, else in fp32 (an AVX2-only
    CPU refuses the bf16 LSTM primitive); outputs float32 either way."""
    if cpu_has_bf16_lstm and not core_module.bf16_lstm_supported("cpu"):
        pytest.skip("this CPU has no bf16 LSTM kernels (oneDNN needs AVX-512)")
    monkeypatch.setattr(core_module, "_cpu_has_bf16_lstm", lambda: cpu_has_bf16_lstm)
    ref, bf16 = _pair(VECTOR, "lstm", precision="bf16")
    seen = []
    bf16.core.lstm.register_forward_hook(lambda module, args, out: seen.append(out[0].dtype))
    obs = _obs(VECTOR)
    with torch.no_grad():
        out = _outputs(bf16, obs)
        bf16.act(0, obs[0], None, None, bf16.initial_state(obs.shape[1]))
    expected = torch.bfloat16 if cpu_has_bf16_lstm else torch.float32
    assert seen == [expected, expected]
    assert all(x.dtype == torch.float32 for x in out if isinstance(x, torch.Tensor))


def test_a_bf16_learner_update_trains_fp32_weights():
    _, model = _pair(FRAMES, precision="bf16")
    T, B = 4, 2
    batch = {
        "obs": _obs(FRAMES, T + 1, B),
        "first": torch.zeros(T + 1, B, dtype=torch.bool),
        "action": torch.randint(0, 3, (T + 1, B)),
        "behaviour_log_prob": torch.full((T, B), -float(np.log(3))),
        "reward": torch.ones(T, B),
        "terminated": torch.zeros(T, B, dtype=torch.bool),
        "truncated": torch.zeros(T, B, dtype=torch.bool),
        "truncation_value": torch.zeros(T, B),
        "policy_version": torch.zeros(B, dtype=torch.int64),
        "actor_index": torch.zeros(B, dtype=torch.int64),
    }
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = Learner(model, ImpalaAlgorithmConfig()).update(batch)
    assert np.isfinite(stats.total_loss)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and not torch.equal(v, before[k]), k


def test_channels_last_gives_the_same_outputs_and_survives_weight_transfer():
    ref, cl = _pair(FRAMES, channels_last=True)
    conv = cl.policies["0"].torso.convs[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    obs = _obs(FRAMES)
    with torch.no_grad():
        torch.testing.assert_close(
            cl.policy(0, obs).logits, ref.policy(0, obs).logits, **NCHW_VS_NHWC
        )
        torch.testing.assert_close(cl.value(0, obs), ref.value(0, obs), **NCHW_VS_NHWC)
    # the subprocess backend's flat weight buffer: publish from one layout, read into the other
    shared = SharedWeights(cl.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    shared.publish(ref.state_dict(), 1)
    assert shared.read_into(cl, 0) == 1
    assert cl.policies["0"].torso.convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(
            cl.policy(0, obs).logits, ref.policy(0, obs).logits, **NCHW_VS_NHWC
        )


def test_orthogonal_init_builds_a_channels_last_cnn_with_the_same_weights():
    """``init: orthogonal`` (any_env's) on a channels-last CNN: torch's ``orthogonal_`` views
    the weight as rows, which a channels-last weight refuses."""
    built = {}
    for channels_last in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(encoder="nature_cnn", init="orthogonal", channels_last=channels_last)
        built[channels_last] = build_model(cfg, FRAMES, ACTIONS)
    conv = built[True].policies["0"].torso.convs[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    contiguous, channels_last = (built[k].state_dict() for k in (False, True))
    assert contiguous.keys() == channels_last.keys()
    for name, weight in contiguous.items():
        torch.testing.assert_close(channels_last[name], weight, rtol=0, atol=0, msg=name)
    rows = conv.reshape(conv.shape[0], -1)
    gram = rows @ rows.T / 2.0  # gain sqrt(2) on the hidden layers
    torch.testing.assert_close(gram, torch.eye(conv.shape[0]), atol=1e-5, rtol=0)
