"""Runs saved by an earlier version (``tests/fixtures/earlier_runs``, see
``checkpoint_fixtures.py``) load and act as they did then, run under ``impala eval`` and resume
with their optimizer state."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoint_fixtures import RUNS, copy_run, expected, play
from impala_rl import checkpoint, train
from impala_rl.cli import main
from impala_rl.policy import load_policy

NAMES = list(RUNS)


@pytest.mark.parametrize("name", NAMES)
def test_an_earlier_versions_run_acts_as_it_did(name, tmp_path):
    """Every decision of the recorded episodes: the same step key and action, the same
    log-probability, entropy and value (to float32 rounding on another CPU)."""
    then, now = expected(name), play(copy_run(name, tmp_path))
    assert torch.equal(now["step_key"], then["step_key"])
    # a discrete action is an integer (any change is >= 1); a continuous one is a float32
    # mean, rounded per CPU like the other figures
    for field in ("action", "log_prob", "entropy", "value"):
        torch.testing.assert_close(now[field], then[field], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["cartpole", "multistep"])
def test_impala_eval_runs_an_earlier_versions_run(name, tmp_path, capsys):
    run = copy_run(name, tmp_path)
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 2


# A plain env's parameters listed (and their optimizer state saved) in the earlier order:
# policy torso, value torso, [core], policy head, value head.
SAVED_AS = {
    "cartpole": {
        "policy_torso.mlp.layers.0.weight": "policies.0.torso.mlp.layers.0.weight",
        "value_torso.mlp.layers.2.bias": "critics.0.torso.mlp.layers.2.bias",
        "policy_head.logits.weight": "policies.0.action_head.logits.weight",
        "value_head.weight": "critics.0.head.weight",
    },
    "pendulum": {
        "policy_head.log_std": "policies.0.action_head.log_std",
        "value_head.linear.weight": "critics.0.head.linear.weight",
        "value_torso.mlp.layers.0.weight": "critics.0.torso.mlp.layers.0.weight",
    },
    "cartpole-lstm": {
        "core.lstm.weight_hh_l0": "core.lstm.weight_hh_l0",
        "policy_head.logits.bias": "policies.0.action_head.logits.bias",
        "value_head.weight": "critics.0.head.weight",
    },
}


@pytest.mark.parametrize("name", list(SAVED_AS))
def test_resuming_an_earlier_versions_run_gives_each_parameter_its_optimizer_state(
    name, tmp_path, monkeypatch
):
    """The optimizer state was saved in the earlier parameter order; on resume each
    parameter gets its own moments (checked by name), and the run carries on."""
    run = copy_run(name, tmp_path)
    saved = checkpoint.load(run / "checkpoints" / "last.pt")
    saved_params = [n for n in saved["model"] if _is_param(n)]
    seen: dict[str, torch.Tensor] = {}
    from impala_rl import trainer as trainer_module

    original = trainer_module.load_optimizer_state

    def spy(optimizer, state, cfg, saved_order=None, order=None):
        original(optimizer, state, cfg, saved_order, order)
        params = optimizer.param_groups[0]["params"]
        for i, param_name in enumerate(order):
            key = "exp_avg" if "exp_avg" in optimizer.state[params[i]] else "square_avg"
            seen[param_name] = optimizer.state[params[i]][key].clone()

    monkeypatch.setattr(trainer_module, "load_optimizer_state", spy)
    env_steps = saved["counters"]["env_steps"]
    summary = train(run_dir=run, resume=True, overrides=[f"max_env_steps={env_steps + 256}"])
    assert summary["env_steps"] > env_steps
    state = saved["optimizer"]["state"]
    key = "exp_avg" if "exp_avg" in state[0] else "square_avg"
    for old_name, new_name in SAVED_AS[name].items():
        index = saved_params.index(old_name)
        assert torch.equal(seen[new_name], state[index][key]), (old_name, new_name)


def _is_param(name: str) -> bool:
    """A parameter of an earlier plain model (not a buffer: statistics and PopArt moments)."""
    buffers = ("obs_norm.", "value_head.mu", "value_head.nu")
    return not name.startswith(buffers)


def test_a_loaded_earlier_run_is_todays_one_class(tmp_path):
    policy = load_policy(copy_run("cartpole", tmp_path))
    names = list(policy.model.state_dict())
    assert names and all(n.startswith(("policies.0.", "critics.0.")) for n in names)
