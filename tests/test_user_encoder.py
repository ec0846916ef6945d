"""A user's encoder by import path (``model.encoder=package.module:Class``): built from the
observation space and ``model.encoder_kwargs``, under the built-in heads, core, last inputs,
PopArt, bf16 and central inference; rebuilt from the recorded config by ``--resume``,
``impala eval`` and ``load_policy``; bad paths and wrong shapes refused naming the field.

The encoders live in ``tests/user_nets.py``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import impala_rl
import user_nets
from impala_rl import cli
from impala_rl.config import ConfigError, ModelConfig, load_config
from impala_rl.envs import EnvFactory
from impala_rl.nn.encoders import MLPEncoder
from impala_rl.nn.factory import build_model, build_model_for_env

BOX = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACTIONS = gym.spaces.Discrete(2)
FAST = ["log.console=false", "log.tensorboard=false"]


def _inner(torso: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside the model's torso."""
    return torso.module


def test_an_encoder_by_import_path_is_built_with_its_kwargs_for_both_torsos():
    cfg = ModelConfig(encoder="user_nets:Torso", encoder_kwargs={"width": 12, "depth": 2})
    model = build_model(cfg, BOX, ACTIONS)
    for torso in (model.policies["0"].torso, model.critics["0"].torso):
        assert type(_inner(torso)) is user_nets.Torso
        assert torso.out_features == 12
    assert _inner(model.policies["0"].torso) is not _inner(model.critics["0"].torso)
    dist, values = model.policy_value(0, torch.zeros(3, 5, 4))
    assert values.shape == (3, 5) and dist.sample().shape == (3, 5)
    # the user's module sees one batch dimension, whatever the model is given
    assert _inner(model.policies["0"].torso).batch_shapes[-1] == (15, 4)


def test_the_value_torso_takes_its_own_class_and_kwargs_or_a_built_in():
    cfg = ModelConfig(
        encoder="user_nets:Torso",
        value_encoder="user_nets:ValueTorso",
        value_encoder_kwargs={"units": 6},
    )
    model = build_model(cfg, BOX, ACTIONS)
    assert type(_inner(model.policies["0"].torso)) is user_nets.Torso
    assert type(_inner(model.critics["0"].torso)) is user_nets.ValueTorso
    assert model.critics["0"].torso.out_features == 6
    assert model.value(0, torch.zeros(2, 4)).shape == (2,)

    mixed = build_model(ModelConfig(encoder="user_nets:Torso", value_encoder="mlp"), BOX, ACTIONS)
    assert isinstance(mixed.critics["0"].torso, MLPEncoder)
    assert type(_inner(mixed.policies["0"].torso)) is user_nets.Torso


def test_a_structured_env_builds_each_key_s_encoder_from_the_path():
    env = EnvFactory("impala_rl.envs.examples:ItemPlacementEnv")()
    cfg = ModelConfig(encoder="user_nets:Torso", value_encoder="user_nets:ValueTorso")
    model = build_model_for_env(cfg, env)
    env.close()
    for k in model.step_keys:
        assert type(_inner(model._policy_net(k).torso)) is user_nets.Torso
        assert type(_inner(model.critics[str(k)].torso)) is user_nets.ValueTorso


BAD_ENCODERS = {
    "module missing": ("impala_no_such_nets:Torso", {}, "cannot import module"),
    "attribute missing": ("user_nets:Missing", {}, "has no attribute 'Missing'"),
    "not a class": ("user_nets:NOT_A_CLASS", {}, "not callable"),
    "not a module": ("user_nets:NotAModule", {}, "not a torch.nn.Module"),
    "no width": ("user_nets:NoWidth", {}, "out_features"),
    "wrong width": ("user_nets:WrongWidth", {}, r"\[2, 5\].*\[N, out_features\] = \[2, 6\]"),
    "raises": ("user_nets:Raising", {}, "only images, please"),
    "bad kwargs": ("user_nets:Torso", {"colour": 1}, "colour"),
}


@pytest.mark.parametrize("case", BAD_ENCODERS)
@pytest.mark.parametrize("side", ["encoder", "value_encoder"])
def test_bad_encoders_are_refused_naming_the_field(case, side):
    path, kwargs, message = BAD_ENCODERS[case]
    if side == "encoder":
        cfg = ModelConfig(encoder=path, encoder_kwargs=kwargs)
    else:
        cfg = ModelConfig(
            encoder="user_nets:Torso", value_encoder=path, value_encoder_kwargs=kwargs
        )
    with pytest.raises(ConfigError, match=rf"model\.{side}='{path}'.*{message}"):
        build_model(cfg, BOX, ACTIONS)


def test_a_wrong_shape_stops_the_run_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.encoder='user_nets:WrongWidth'"):
        impala_rl.train(
            "cartpole",
            [*FAST, "runner.backend=sequential", "model.encoder=user_nets:WrongWidth"],
            run_dir=tmp_path / "run",
        )


CONFIG_ERRORS = {
    "unknown name": (["model.encoder=resnet50"], "model.encoder", "package.module:Class"),
    "kwargs of a built-in": (
        ["model.encoder=mlp", "model.encoder_kwargs.width=3"],
        "model.encoder_kwargs",
        "encoder given by import path",
    ),
    "value encoder with a shared torso": (
        ["model.shared_torso=true", "model.value_encoder=user_nets:ValueTorso"],
        "model.value_encoder",
        "null when model.shared_torso is true",
    ),
    "value kwargs without a value encoder": (
        ["model.value_encoder_kwargs.units=3"],
        "model.value_encoder_kwargs",
        "encoder given by import path",
    ),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_the_config_refuses_what_cannot_build(case):
    overrides, key, valid = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError, match=rf"{key}.*valid: .*{valid}"):
        load_config("cartpole", overrides)


def test_a_user_encoder_trains_resumes_evaluates_and_loads_from_the_recorded_path(tmp_path):
    """Shared torso under an LSTM core with last inputs, PopArt and bf16; the run directory
    records the path and kwargs, from which resume, ``impala eval`` and ``load_policy``
    rebuild the model."""
    run_dir = tmp_path / "run"
    model = [
        "model.encoder=user_nets:Torso",
        "model.encoder_kwargs.width=10",
        "model.shared_torso=true",
        "model.core=lstm",
        "model.lstm_hidden_size=8",
        "model.use_last_action_reward=true",
        "model.popart=true",
        "model.precision=bf16",
    ]
    budget = ["algorithm.n_epochs=1", "algorithm.epoch_length=2", "runner.backend=sequential"]
    budget += ["algorithm.rollout_evaluator.n_episodes=2"]
    first = impala_rl.train("cartpole", [*FAST, *model, *budget], run_dir=run_dir)
    assert first["updates"] == 2
    resumed = impala_rl.train(resume=True, run_dir=run_dir, overrides=["algorithm.n_epochs=2"])
    assert resumed["updates"] == 4

    policy = impala_rl.load_policy(run_dir, which="last")
    torso = policy.model.policies["0"].torso
    assert type(_inner(torso)) is user_nets.Torso and torso.out_features == 10
    action = policy.act(np.zeros(4, np.float32))
    assert ACTIONS.contains(int(action))

    assert cli.main(["eval", str(run_dir), "--which", "last", "--episodes", "2"]) == 0


def test_a_user_encoder_acts_under_central_inference_with_separate_torsos(tmp_path):
    cfg = load_config(
        "cartpole",
        [
            *FAST,
            "runner.backend=subprocess",
            "runner.inference=central",
            "model.encoder=user_nets:Torso",
            "model.value_encoder=user_nets:ValueTorso",
            "model.value_encoder_kwargs.units=4",
            "max_env_steps=2000",
            "target_return=null",
            "algorithm.rollout_evaluator.n_episodes=2",
            f"log.run_dir={tmp_path / 'run'}",
        ],
    )
    from impala_rl.trainer import Trainer

    summary = Trainer(cfg).train()
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["env_steps"] >= 2000
    assert "user_nets:ValueTorso" in (tmp_path / "run" / "config.yaml").read_text()
