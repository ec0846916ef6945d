"""Run config: presets, overrides, validation messages, round trips, field docs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from impala_rl import config as config_module
from impala_rl.config import (
    PRESETS_DIR,
    RULES,
    ConfigError,
    ImpalaAlgorithmConfig,
    RunConfig,
    config_from_dict,
    list_presets,
    load_config,
    max_waiting_rollouts,
    to_dict,
    to_yaml,
)

# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------


def test_cartpole_preset_loads_by_name():
    assert "cartpole" in list_presets()
    cfg = load_config("cartpole")
    assert isinstance(cfg, RunConfig)
    assert cfg.env.id == "CartPole-v1"
    assert cfg.target_return == 475
    assert cfg.algorithm.lr == pytest.approx(2e-3)  # the preset's value, not the default 5e-4
    assert cfg.algorithm.epoch_length == 10
    assert cfg.algorithm.rollout_evaluator.n_episodes == 10  # untouched default


def test_preset_loads_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("seed: 7\nalgorithm:\n  lr: 2.0e-4\n  gamma: 0.5\nenv:\n  id: Acrobot-v1\n")
    for ref in (path, str(path)):
        cfg = load_config(ref)
        assert cfg.seed == 7
        assert cfg.algorithm.lr == pytest.approx(2e-4)
        assert cfg.algorithm.gamma == pytest.approx(0.5)
        assert cfg.env.id == "Acrobot-v1"


def test_no_preset_gives_the_defaults():
    assert load_config() == RunConfig()


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        load_config("no_such_preset")
    msg = str(info.value)
    assert "no_such_preset" in msg
    for name in list_presets():
        assert name in msg


def test_missing_yaml_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


def test_unknown_key_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("algorithm:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"algorithm\.learning_rate"):
        load_config(path)


# ---------------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------------


def test_overrides_apply():
    cfg = load_config(
        "cartpole",
        [
            "seed=5",
            "algorithm.lr=3e-4",
            "algorithm.rollout_evaluator.n_episodes=3",
            "algorithm.rollout_evaluator.deterministic=false",
            "env.kwargs.foo=1",
            "env.kwargs.name=bar",
            "algorithm.max_grad_norm=null",
            "algorithm.vtrace_clip_c_threshold=null",
            "model.hidden_sizes=[32,16]",
            "target_return=null",
        ],
    )
    assert cfg.seed == 5
    assert cfg.algorithm.lr == pytest.approx(3e-4)
    assert cfg.algorithm.rollout_evaluator.n_episodes == 3
    assert cfg.algorithm.rollout_evaluator.deterministic is False
    assert cfg.env.kwargs == {"foo": 1, "name": "bar"}
    assert cfg.algorithm.max_grad_norm is None
    assert cfg.algorithm.vtrace_clip_c_threshold is None
    assert cfg.model.hidden_sizes == [32, 16]
    assert cfg.target_return is None
    # untouched values keep the preset's
    assert cfg.algorithm.epoch_length == 10


def test_later_overrides_win_and_overrides_beat_the_preset():
    cfg = load_config("cartpole", ["algorithm.gamma=0.5", "algorithm.gamma=0.7"])
    assert cfg.algorithm.gamma == pytest.approx(0.7)


def test_malformed_override():
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", ["algorithm.lr"])
    assert "algorithm.lr" in str(info.value)
    assert "key=value" in str(info.value)


# ---------------------------------------------------------------------------------------------
# validation: unknown keys, wrong types, ranges and choices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field, valid_hint",
    [
        ("algorithm.learning_rate=0.1", "algorithm.learning_rate", "lr"),
        ("bogus=1", "bogus", "algorithm"),
        ("algorithm.rollout_evaluator.bad=1", "algorithm.rollout_evaluator.bad", "n_episodes"),
        ("model.depth=3", "model.depth", "hidden_sizes"),
    ],
)
def test_unknown_keys_name_the_field_and_the_valid_keys(override, field, valid_hint):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    msg = str(info.value)
    assert repr(field) in msg
    assert "valid keys" in msg and valid_hint in msg


@pytest.mark.parametrize(
    "override, field, type_name",
    [
        ("algorithm.lr=abc", "algorithm.lr", "float"),
        ("algorithm.num_actors=1.5", "algorithm.num_actors", "integer"),
        ("algorithm.n_epochs=many", "algorithm.n_epochs", "integer"),
        (
            "algorithm.rollout_evaluator.deterministic=maybe",
            "algorithm.rollout_evaluator.deterministic",
            "bool",
        ),
        ("seed=x", "seed", "integer"),
    ],
)
def test_wrong_types_name_the_field(override, field, type_name):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    msg = str(info.value)
    assert f"'{field}'" in msg
    assert type_name in msg.lower()
    if field in RULES:  # and what is valid there
        assert msg.endswith(f"; valid: {RULES[field].valid}")


@pytest.mark.parametrize(
    "override, field",
    [("algorithm.adam_betas=3", "algorithm.adam_betas"), ("env.kwargs=3", "env.kwargs")],
)
def test_scalar_for_a_container_names_the_field(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config("cartpole", [override])


@pytest.mark.parametrize("override, field", [("model=3", "model"), ("runner=x", "runner")])
def test_scalar_for_a_section_names_the_field(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config("cartpole", [override])


@pytest.mark.parametrize(
    "overrides, field, valid",
    [
        (["algorithm.lr=0"], "algorithm.lr", "> 0"),
        (["algorithm.lr=-1e-3"], "algorithm.lr", "> 0"),
        (["algorithm.gamma=1.01"], "algorithm.gamma", "[0, 1]"),
        (["algorithm.gamma=-0.1"], "algorithm.gamma", "[0, 1]"),
        (["algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef", ">= 0"),
        (["algorithm.value_loss_coef=-1"], "algorithm.value_loss_coef", ">= 0"),
        (["algorithm.policy_loss_coef=-1"], "algorithm.policy_loss_coef", ">= 0"),
        (["algorithm.optimizer=sgd"], "algorithm.optimizer", "adam | rmsprop"),
        (["algorithm.reward_clipping=bad"], "algorithm.reward_clipping", "abs_one"),
        (["runner.backend=bad"], "runner.backend", "sequential"),
        (["algorithm.vtrace_lambda=2"], "algorithm.vtrace_lambda", "[0, 1]"),
        (["algorithm.adv_mode=rllib"], "algorithm.adv_mode", "official | acme"),
        (["algorithm.num_actors=0"], "algorithm.num_actors", ">= 1"),
        (["algorithm.envs_per_actor=0"], "algorithm.envs_per_actor", ">= 1"),
        (["algorithm.n_rollout_steps=0"], "algorithm.n_rollout_steps", ">= 1"),
        (["algorithm.vtrace_clip_rho_threshold=0"], "algorithm.vtrace_clip_rho_threshold", "> 0"),
        (["algorithm.adam_betas=[0.9]"], "algorithm.adam_betas", "two numbers"),
        (["algorithm.device=tpu"], "algorithm.device", "cuda"),
        (["algorithm.device=cuda:x"], "algorithm.device", "cuda:N"),
        (["algorithm.device=cudaa"], "algorithm.device", "cuda:N"),
        (["model.activation=sigmoid"], "model.activation", "tanh"),
        (["model.hidden_sizes=[]"], "model.hidden_sizes", "non-empty"),
        (
            ["algorithm.rollout_evaluator.n_episodes=0"],
            "algorithm.rollout_evaluator.n_episodes",
            ">= 1",
        ),
        (["env.max_episode_steps=0"], "env.max_episode_steps", ">= 1"),
        (["log.checkpoint_every_epochs=0"], "log.checkpoint_every_epochs", ">= 1"),
        (["max_env_steps=0"], "max_env_steps", ">= 1"),
        (
            ["algorithm.lr_schedule=linear", "max_env_steps=null"],
            "algorithm.lr_decay_env_steps",
            "max_env_steps",
        ),
        (["algorithm.lr_schedule=cosine"], "algorithm.lr_schedule", "constant | linear"),
        (
            ["algorithm.entropy_schedule=linear", "max_env_steps=null"],
            "algorithm.entropy_decay_env_steps",
            "max_env_steps",
        ),
        (["algorithm.entropy_schedule=exp"], "algorithm.entropy_schedule", "constant | linear"),
        (["algorithm.entropy_coef_final=-0.1"], "algorithm.entropy_coef_final", ">= 0"),
        (["algorithm.entropy_decay_env_steps=0"], "algorithm.entropy_decay_env_steps", ">= 1"),
    ],
)
def test_out_of_range_values_name_the_field_and_what_is_valid(overrides, field, valid):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", overrides)
    msg = str(info.value)
    assert f"'{field}'" in msg
    assert "valid" in msg
    assert valid in msg


@pytest.mark.parametrize(
    "factor, batch_size, bound",
    [
        ("0.4", 2, "> 0.5"),
        ("0.5", 2, "> 0.5"),  # ceil(0.5 * 2) = 1 place for a batch of 2
        ("0.74", 4, "> 0.75"),
        ("0", 2, "> 0.5"),
        ("-1", 2, "> 0.5"),
        ("inf", 2, "> 0.5"),
        ("nan", 2, "> 0.5"),
    ],
)
def test_queue_out_of_sync_factor_that_can_never_form_a_batch_is_refused(factor, batch_size, bound):
    overrides = [
        f"algorithm.queue_out_of_sync_factor={factor}",
        f"algorithm.actors_batch_size={batch_size}",
    ]
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", overrides)
    msg = str(info.value)
    assert "'algorithm.queue_out_of_sync_factor'" in msg
    if not float(factor) > 0 or float(factor) == float("inf"):  # the key's own range first
        assert "valid: a number > 0" in msg
        return
    assert "ceil(factor * actors_batch_size) >= actors_batch_size" in msg and bound in msg


@pytest.mark.parametrize("factor, batch_size", [("0.51", 2), ("0.76", 4), ("1.0", 3), ("8", 2)])
def test_queue_out_of_sync_factor_with_room_for_a_batch_is_accepted(factor, batch_size):
    cfg = load_config(
        "cartpole",
        [
            f"algorithm.queue_out_of_sync_factor={factor}",
            f"algorithm.actors_batch_size={batch_size}",
        ],
    )
    assert max_waiting_rollouts(cfg.algorithm) >= batch_size


def test_linear_schedule_is_fine_with_a_horizon():
    # the cartpole preset sets max_env_steps
    assert load_config("cartpole", ["algorithm.lr_schedule=linear"]).algorithm.lr_schedule == (
        "linear"
    )
    cfg = load_config(None, ["algorithm.lr_schedule=linear", "algorithm.lr_decay_env_steps=1000"])
    assert cfg.algorithm.lr_decay_env_steps == 1000
    with pytest.raises(ConfigError, match="algorithm.lr_decay_env_steps"):
        load_config(None, ["algorithm.lr_schedule=linear"])


def test_boundary_values_are_accepted():
    cfg = load_config(
        "cartpole",
        [
            "algorithm.gamma=1.0",
            "algorithm.vtrace_lambda=0",
            "algorithm.entropy_coef=0",
            "algorithm.optimizer=rmsprop",
            "algorithm.reward_clipping=soft_asymmetric",
            "algorithm.device=cuda:1",
        ],
    )
    assert cfg.algorithm.gamma == 1.0 and cfg.algorithm.vtrace_lambda == 0.0


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------


def test_to_dict_config_from_dict_round_trip():
    cfg = load_config(
        "cartpole",
        [
            "env.kwargs.foo=1",
            "algorithm.rollout_evaluator.n_episodes=3",
            "algorithm.max_grad_norm=null",
            "log.run_dir=/tmp/x",
        ],
    )
    data = to_dict(cfg)
    assert isinstance(data, dict) and isinstance(data["algorithm"], dict)
    assert data["algorithm"]["rollout_evaluator"]["n_episodes"] == 3
    assert data["env"]["kwargs"] == {"foo": 1}
    back = config_from_dict(data)
    assert back == cfg
    assert to_dict(back) == data
    assert "n_episodes: 3" in to_yaml(cfg)


def test_config_from_dict_validates():
    data = to_dict(load_config("cartpole"))
    data["algorithm"]["gamma"] = 2.0
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        config_from_dict(data)
    data = to_dict(load_config("cartpole"))
    data["algorithm"]["unknown"] = 1
    with pytest.raises(ConfigError, match="algorithm.unknown"):
        config_from_dict(data)


@pytest.mark.parametrize(
    "learners, actors, envs",
    [(2, 2, 4), (4, 4, 2), (3, 3, 8)],  # 8 envs shared where they divide, else 8 each
)
def test_a_presets_actors_are_shared_among_learners_that_do_not_divide_them(learners, actors, envs):
    """``any_env``'s one actor of 8 envs: each learner gets actors of its own, stepping the
    preset's envs between them where they divide."""
    one = load_config("any_env").algorithm
    a = load_config("any_env", [f"algorithm.num_learners={learners}"]).algorithm
    assert (one.num_actors, one.envs_per_actor) == (1, 8)
    assert (a.num_actors, a.envs_per_actor) == (actors, envs)
    assert a.actors_batch_size == one.actors_batch_size
    if actors * envs == 8:  # an optimizer step on the preset's env steps
        step = learners * a.actors_batch_size * a.envs_per_actor * a.n_rollout_steps
        assert step == one.actors_batch_size * one.envs_per_actor * one.n_rollout_steps


def test_a_saved_configs_actor_count_is_kept_as_given():
    """A resumed run's config holds its own actors: refused, not reshaped under it."""
    saved = to_dict(load_config("any_env"))
    with pytest.raises(ConfigError, match="'algorithm.num_learners'"):
        load_config(base=saved, overrides=["algorithm.num_learners=2"])


def test_a_given_envs_per_actor_is_kept_when_actors_are_shared(caplog):
    with caplog.at_level("INFO", logger="impala_rl.config"):
        a = load_config("any_env", ["algorithm.num_learners=2", "algorithm.envs_per_actor=8"])
    assert (a.algorithm.num_actors, a.algorithm.envs_per_actor) == (2, 8)
    assert "algorithm.num_learners=2: 2 actors x 8 envs, 1 a learner" in caplog.text


def test_base_plus_overrides():
    base = to_dict(load_config("cartpole"))
    cfg = load_config(base=base, overrides=["algorithm.lr=0.01"])
    assert cfg.algorithm.lr == pytest.approx(0.01)
    assert cfg.target_return == 475


# ---------------------------------------------------------------------------------------------
# every field is documented
# ---------------------------------------------------------------------------------------------


def _dataclass_nodes(tree: ast.Module) -> list[ast.ClassDef]:
    def is_dataclass_decorator(node: ast.expr) -> bool:
        target = node.func if isinstance(node, ast.Call) else node
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        return name == "dataclass"

    return [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and any(map(is_dataclass_decorator, node.decorator_list))
    ]


def test_every_config_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    classes = _dataclass_nodes(tree)
    names = {c.name for c in classes}
    # the AST walk sees every dataclass of the module, nested sections included
    expected = {
        cls.__name__
        for cls in vars(config_module).values()
        if inspect.isclass(cls)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == config_module.__name__
    }
    assert names == expected
    assert {"RunConfig", "ImpalaAlgorithmConfig", "RolloutEvaluatorConfig"} <= names

    undocumented = []
    for cls in classes:
        fields = 0
        for i, stmt in enumerate(cls.body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            fields += 1
            nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
            documented = (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
                and nxt.value.value.strip() != ""
            )
            if not documented:
                undocumented.append(f"{cls.name}.{stmt.target.id}")
        # the AST saw exactly the dataclass's fields
        assert fields == len(dataclasses.fields(getattr(config_module, cls.name))), cls.name
    assert undocumented == []


def test_algorithm_defaults_are_valid():
    cfg = RunConfig(algorithm=ImpalaAlgorithmConfig())
    config_module.validate(cfg)


@pytest.mark.parametrize(
    "preset, overrides, suggestion",
    [
        ("cartpol", [], "did you mean 'cartpole'?"),
        ("minatar_breakuot", [], "did you mean 'minatar_breakout'?"),
        ("cartpole", ["algorithm.entropy_coeff=0.1"], "did you mean 'entropy_coef'?"),
        ("cartpole", ["model.hiden_sizes=[8]"], "did you mean 'hidden_sizes'?"),
        ("cartpole", ["algorithm.rollout_evaluator.n_episode=3"], "did you mean 'n_episodes'?"),
    ],
)
def test_mistyped_presets_and_keys_suggest_the_nearest_valid_name(preset, overrides, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides)
    assert suggestion in str(info.value)


def test_names_far_from_every_valid_one_get_no_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", ["model.depth=3"])
    assert "did you mean" not in str(info.value)


def test_the_top_level_configs_folder_holds_the_presets():
    top = Path(__file__).resolve().parents[1] / "configs"
    assert sorted(p.stem for p in top.glob("*.yaml")) == list_presets()
    assert (top / "cartpole.yaml").read_text() == (PRESETS_DIR / "cartpole.yaml").read_text()


def test_every_rule_names_a_config_field_and_the_defaults_pass():
    cfg = RunConfig()
    for key in RULES:
        target = cfg
        for part in key.split("."):
            assert hasattr(target, part), key
            target = getattr(target, part)
    config_module.validate(cfg)


def test_queue_out_of_sync_factor_accepts_one_batch_and_more():
    for value in (1, 1.5, 4):
        cfg = load_config("cartpole", [f"algorithm.queue_out_of_sync_factor={value}"])
        assert cfg.algorithm.queue_out_of_sync_factor == value


@pytest.mark.parametrize(
    "override", ["algorithm.lr=inf", "algorithm.gamma=nan", "runner.shutdown_timeout_s=inf"]
)
def test_numbers_must_be_finite(override):
    with pytest.raises(ConfigError, match=repr(override.split("=")[0])):
        load_config("cartpole", [override])


def test_choice_tuples_are_defined_once():
    from impala_rl import losses
    from impala_rl.nn import actor_critic, core, encoders

    assert encoders.ENCODERS is config_module.ENCODERS
    assert encoders.ACTIVATIONS is config_module.ACTIVATIONS
    assert core.CORES is actor_critic.CORES is config_module.CORES
    assert actor_critic.PRECISIONS is config_module.PRECISIONS
    assert actor_critic.CRITIC_MODES is config_module.CRITIC_MODES
    assert losses.REWARD_CLIPPING_MODES is config_module.REWARD_CLIPPING_MODES
    choices = " | ".join(config_module.ENCODERS)
    assert RULES["model.encoder"].valid == f"{choices} | package.module:Class (your own encoder)"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model.shared_torso=true", "model.actor_hidden_sizes=[8]"], "model.actor_hidden_sizes"),
        (
            ["model.encoder=nature_cnn", "model.critic_hidden_sizes=[8]"],
            "model.critic_hidden_sizes",
        ),  # noqa: E501
        (["model.actor_hidden_sizes=[]"], "model.actor_hidden_sizes"),
        (["model.encoder=minatar_cnn", "model.normalize_obs=true"], "model.normalize_obs"),
        (["model.init=xavier"], "model.init"),
        (["model.popart=true", "model.popart_sigma_min=0"], "model.popart_sigma_min"),
    ],
)
def test_model_knobs_that_cannot_apply_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("cartpole", overrides)


def test_max_policy_lag_below_the_extra_passes_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.max_policy_lag.*num_passes - 1 = 2"):
        load_config("cartpole", ["algorithm.num_passes=3", "algorithm.max_policy_lag=1"])


def test_a_config_file_can_start_from_a_preset(tmp_path):
    """``base: PRESET`` in a YAML: the preset's settings, then the file's."""
    path = tmp_path / "mine.yaml"
    path.write_text("base: cartpole\nalgorithm:\n  lr: 0.001\n")
    cfg, cartpole = load_config(str(path)), load_config("cartpole")
    assert cfg.algorithm.lr == 0.001 and cartpole.algorithm.lr != 0.001
    assert cfg.algorithm.num_actors == cartpole.algorithm.num_actors
    assert cfg.runner.backend == cartpole.runner.backend == "sequential"
    loop = tmp_path / "loop.yaml"
    loop.write_text(f"base: {loop}\n")
    with pytest.raises(ConfigError, match="refers back to itself"):
        load_config(str(loop))


def test_a_changed_setting_whose_switch_is_off_gets_a_warning_naming_both(caplog, tmp_path):
    with caplog.at_level("WARNING", logger="impala_rl.config"):
        load_config("cartpole", ["model.normalize_obs_center=false", "model.popart_beta=0.01"])
    assert "model.normalize_obs_center has no effect" in caplog.text
    assert "model.normalize_obs=true" in caplog.text
    assert "model.popart_beta has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="impala_rl.config"):
        load_config("cartpole", ["model.normalize_obs=true", "model.normalize_obs_center=false"])
        # a saved config reused as a file holds every key, the defaults included
        saved = tmp_path / "saved.yaml"
        saved.write_text(to_yaml(load_config("cartpole")))
        load_config(saved)
    assert "has no effect" not in caplog.text
