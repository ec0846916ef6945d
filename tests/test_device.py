"""The learner on ``algorithm.device``: CPU always, CUDA where a GPU is present (else skipped).

Actors act on CPU copies of the weights while the learner trains on its device, so each case
goes through every place a tensor crosses: the batch handed to the learner, the weights
broadcast back, evaluation, checkpoints (saved from the device, loaded on CPU) and resume.
"""

from __future__ import annotations

import pytest
import torch

import impala_rl
from batches import vector_batch
from impala_rl import checkpoint
from impala_rl.policy import load_policy

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]
FAST = ["log.console=false", "log.tensorboard=false", "algorithm.epoch_length=2"]
# Every model input the learner moves to its device: a core state, last action/reward,
# observation statistics and PopArt's statistics.
CARTPOLE_EVERY_INPUT = [
    "model.core=lstm",
    "model.shared_torso=true",
    "model.use_last_action_reward=true",
    "model.normalize_obs=true",
    "model.popart=true",
]
CASES = {
    "cartpole": ("cartpole", ["runner.backend=sequential"]),
    "cartpole-lstm-last-normalize-popart": (
        "cartpole",
        ["runner.backend=sequential", *CARTPOLE_EVERY_INPUT],
    ),
    "cartpole-subprocess": ("cartpole", ["runner.backend=subprocess"]),
    "multistep-structured": ("multistep_example", ["model.core=lstm", "model.shared_torso=true"]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_learner_on_device_trains_checkpoints_and_resumes(tmp_path, device, case):
    preset, overrides = CASES[case]
    run_dir = tmp_path / "run"
    first = impala_rl.train(
        preset,
        [*FAST, *overrides, f"algorithm.device={device}", "algorithm.n_epochs=1"],
        run_dir=run_dir,
    )
    assert first["updates"] == 2

    last = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert all(t.device.type == "cpu" for t in last["model"].values())
    before = {k: t.clone() for k, t in last["model"].items()}

    resumed = impala_rl.train(resume=True, run_dir=run_dir, overrides=["algorithm.n_epochs=2"])
    assert resumed["updates"] == 4
    after = checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]
    moved = [
        k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])
    ]
    assert moved, "the resumed updates on the device changed no weight"
    for t in after.values():
        assert not t.is_floating_point() or bool(torch.isfinite(t).all())

    policy = load_policy(run_dir)  # a checkpoint trained on the device acts on CPU
    assert next(policy.model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("policy_loss", ["impala", "appo"])
def test_an_update_reads_its_figures_from_the_device_in_one_copy(monkeypatch, policy_loss):
    """Every ``float(x)``/``bool(x)``/``x.item()``/``x.tolist()`` of a tensor on a GPU waits for
    the GPU: an update of a plain env makes one read for its figures and one for the check of
    float observations, whatever the number of losses, norms and columns (the optimizer's own
    CPU step counter is not the learner's)."""
    import math
    import sys

    import gymnasium as gym

    from impala_rl.config import ImpalaAlgorithmConfig, ModelConfig
    from impala_rl.learner import Learner
    from impala_rl.nn.factory import build_model

    reads: list[str] = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if "impala_rl" in sys._getframe(1).f_code.co_filename:
                reads.append(name)
            return original(self, *args, **kwargs)

        return read

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(hidden_sizes=[8]), gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2)
    )
    learner = Learner(model, ImpalaAlgorithmConfig(policy_loss=policy_loss))
    batch = vector_batch(5, 4)
    batch["policy_version"] = torch.tensor([0, 0, 1, 1])
    learner.update(batch)  # version 1
    for name in ("__float__", "__bool__", "__int__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    stats = learner.update(batch)
    assert sorted(reads) == ["__bool__", "tolist"]
    assert stats.policy_lag == [1, 1, 0, 0]
    assert math.isfinite(stats.total_loss) and stats.grad_norm > 0
    assert set(stats.policy_loss) == set(stats.critic_grad_norm) == {0}


@pytest.mark.parametrize(
    ("name", "cuda", "gpus", "mps"),
    [
        ("cuda", False, 0, False),
        ("cuda:0", False, 0, False),
        ("cuda:2", True, 2, False),
        ("mps", False, 0, False),
    ],
)
def test_a_device_this_machine_lacks_is_a_config_error_naming_the_field(
    monkeypatch, name, cuda, gpus, mps
):
    """Issue 41.3: refused with what this machine has, before anything starts."""
    from impala_rl.config import ConfigError
    from impala_rl.startup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    with pytest.raises(ConfigError) as info:
        resolve_device(name)
    msg = str(info.value)
    assert f"'algorithm.device': '{name}'" in msg and "valid: " in msg and "cpu" in msg
    assert resolve_device("auto") == torch.device("cuda" if cuda else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
