"""``impala train env.id=ID`` without a preset: defaults that fit the env, said on the console,
and evaluation kept to a share of the wall time (``rollout_evaluator.max_time_share``)."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest
from gymnasium import spaces
from omegaconf import OmegaConf

from impala_rl import checkpoint
from impala_rl.config import ConfigError, list_presets, load_config
from impala_rl.env_defaults import (
    FAMILY_PRESETS,
    GENERIC_PRESET,
    IMAGE_REUSE,
    SHORT_BUDGET,
    SLOW_STEP_S,
    describe_spaces,
    env_family,
    has_image,
    resolve_config,
    reward_threshold,
    step_seconds,
)
from impala_rl.envs import EnvFactory
from impala_rl.evaluation import EvaluationResult
from impala_rl.learner import scheduled_lr
from impala_rl.plot import load_metrics
from impala_rl.trainer import Trainer, evaluation_due
from test_cli import _cmd, _env
from test_trainer import FAST

# -- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_id", "target"),
    [
        ("Acrobot-v1", -100.0),
        ("MountainCar-v0", -110.0),
        ("Pendulum-v1", None),
        ("CartPole-v1", 475.0),
    ],
)
def test_without_a_preset_target_return_follows_the_env_spec(env_id, target):
    assert resolve_config(None, [f"env.id={env_id}"]).target_return == target


def test_ids_without_a_spec_have_no_target():
    assert reward_threshold("scripted_envs:make_env") is None  # a factory
    assert reward_threshold("NoSuchEnv-v0") is None
    cfg = resolve_config(None, ["env.id=scripted_envs:make_env"])
    assert cfg.target_return is None


@pytest.mark.parametrize(("given", "expected"), [("-50", -50.0), ("null", None), ("600", 600.0)])
def test_an_explicit_target_return_wins(given, expected):
    cfg = resolve_config(None, ["env.id=Acrobot-v1", f"target_return={given}"])
    assert cfg.target_return == expected
    # before or after env.id, and over any other setting the defaults choose
    cfg = resolve_config(
        None, [f"target_return={given}", "env.id=Acrobot-v1", "runner.backend=ray"]
    )
    assert cfg.target_return == expected and cfg.runner.backend == "ray"


def test_no_preset_runs_the_any_env_preset_not_cartpoles_settings():
    cfg = resolve_config(None, ["env.id=scripted_envs:make_env"])
    cartpole, any_env = load_config("cartpole"), load_config(GENERIC_PRESET)
    assert cfg.env.id == "scripted_envs:make_env"
    assert cfg.algorithm.policy_loss == "appo" != cartpole.algorithm.policy_loss
    assert cfg.algorithm.num_passes == any_env.algorithm.num_passes > 1
    assert cfg.algorithm.lr == any_env.algorithm.lr != cartpole.algorithm.lr
    ev = cfg.algorithm.rollout_evaluator
    assert ev.background == "process" and ev.max_time_share == 0.1
    assert cfg.algorithm.patience == 0 and cfg.max_env_steps == 1_000_000
    assert cfg.model.encoder == "auto"  # an MLP for these vectors


@pytest.mark.parametrize(
    ("env_id", "family"),
    [
        ("Acrobot-v1", "classic_control"),
        ("Pendulum-v1", "classic_control"),
        ("LunarLander-v3", "box2d"),
        ("HalfCheetah-v5", "mujoco"),
        ("ALE/Pong-v5", None),
        ("scripted_envs:make_env", None),
        ("NoSuchEnv-v0", None),
    ],
)
def test_an_env_of_a_known_family_gets_its_preset(env_id, family):
    assert env_family(env_id) == family
    if family is None:
        return
    cfg = resolve_config(None, [f"env.id={env_id}"])
    preset = load_config(family)
    assert cfg.env.id == env_id and cfg.algorithm == preset.algorithm and cfg.model == preset.model
    assert cfg.target_return == reward_threshold(env_id)  # the env's, not the preset's env's


def test_presets_keep_their_evaluation_schedule():
    """The presets evaluate as before: every epoch (cartpole in the pause, for its time to
    solve); only runs without a preset, and the family presets chosen for them, share out
    their evaluation time."""
    for preset in list_presets():
        ev = load_config(preset).algorithm.rollout_evaluator
        if preset in (*FAMILY_PRESETS, GENERIC_PRESET):
            assert ev.background and ev.max_time_share == 0.1, preset
        else:
            assert ev.max_time_share is None, preset
    cartpole = load_config("cartpole")
    assert not cartpole.algorithm.rollout_evaluator.background
    assert cartpole.target_return == 475


def test_neither_preset_nor_env_id_runs_the_cartpole_preset():
    assert resolve_config(None, ["seed=3"]) == load_config("cartpole", ["seed=3"])
    assert resolve_config("minatar", []) == load_config("minatar")


@pytest.mark.parametrize("schedule", ["lr_schedule", "entropy_schedule"])
@pytest.mark.parametrize("env_id", ["Pendulum-v1", "scripted_envs:make_env"])
def test_a_linear_schedule_decays_over_the_budget_the_chosen_defaults_set(schedule, env_id):
    """Issue 41.2: the family preset (or the defaults for an env without one) sets
    ``max_env_steps``, the horizon of a linear schedule; the overrides are validated once, on
    the config that runs, not on the bare defaults."""
    cfg = resolve_config(None, [f"env.id={env_id}", f"algorithm.{schedule}=linear"])
    assert getattr(cfg.algorithm, schedule) == "linear"
    assert cfg.max_env_steps == 1_000_000
    horizon = schedule.replace("schedule", "decay_env_steps")
    with pytest.raises(ConfigError, match=f"algorithm.{horizon}"):
        resolve_config(
            None, [f"env.id={env_id}", f"algorithm.{schedule}=linear", "max_env_steps=null"]
        )


@pytest.mark.parametrize(
    ("override", "field"),
    [("env.max_episode_steps=0", "env.max_episode_steps"), ("env.id=''", "env.id")],
)
def test_a_bad_env_setting_is_refused_by_name_before_the_env_is_built(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'.*valid"):
        resolve_config(None, ["env.id=CartPole-v1", override])


def test_max_time_share_is_validated():
    with pytest.raises(ConfigError, match="max_time_share"):
        load_config(overrides=["algorithm.rollout_evaluator.max_time_share=0"])
    with pytest.raises(ConfigError, match="max_time_share"):
        load_config(overrides=["algorithm.rollout_evaluator.max_time_share=1.5"])


def _env_with(obs: spaces.Space, action: spaces.Space) -> SimpleNamespace:
    return SimpleNamespace(observation_space=obs, action_space=action)


def test_spaces_choose_the_encoder():
    """The model's view of the observation: every image is ``[C, H, W]`` by then."""
    vector = spaces.Box(-1, 1, (4,), np.float32)
    text, model = describe_spaces(_env_with(vector, spaces.Box(-1, 1, (2,), np.float32)))
    assert text == "continuous actions, vector observations" and model == {}
    atari = spaces.Box(0, 255, (4, 84, 84), np.uint8)
    text, model = describe_spaces(_env_with(atari, spaces.Discrete(6)))
    assert text == "discrete actions, image observations [4, 84, 84]"
    assert model == {"encoder": "nature_cnn", "shared_torso": True, "normalize_obs": False}
    small = spaces.Box(0, 255, (4, 10, 10), np.uint8)
    assert describe_spaces(_env_with(small, spaces.Discrete(3)))[1]["encoder"] == "minatar_cnn"
    grid = spaces.Dict({"pos": spaces.Box(0, 4, (2,), np.float32), "door": spaces.Discrete(2)})
    text, model = describe_spaces(_env_with(grid, spaces.Discrete(4)))
    assert text == "discrete actions, Dict observations (an encoder per entry)" and model == {}
    codes = spaces.Dict({"image": atari, "door": spaces.Discrete(2)})  # nothing to normalize
    text, model = describe_spaces(_env_with(codes, spaces.Discrete(4)))
    assert "a CNN per image" in text and model == {"normalize_obs": False}


def test_an_env_whose_step_is_slow_gets_each_env_in_its_own_process(caplog):
    """A step of 2 ms (a physics simulator, a game engine): an actor's envs step at once, each
    in its own process (``env.vector=async``), under ``any_env`` or a family preset that steps
    them in one; a step of microseconds keeps them in one; an explicit setting wins."""
    slow = ["env.id=scripted_envs:make_env", "env.kwargs.step_sleep_s=0.002"]
    assert step_seconds(EnvFactory.of(resolve_config(None, slow).env)()) >= 0.002
    assert resolve_config(None, slow).env.vector == "async"
    assert resolve_config(None, ["env.id=scripted_envs:make_env"]).env.vector == "python"
    assert resolve_config(None, [*slow, "env.vector=python"]).env.vector == "python"
    given = resolve_config(None, [*slow, "runner.backend=subprocess"])  # actors in processes
    assert given.env.vector == "python" and given.runner.backend == "subprocess"
    with caplog.at_level(logging.INFO, logger="impala_rl.env_defaults"):
        resolve_config(None, slow)
    assert "sequential backend, each env in its own process (a step takes" in caplog.text
    # a family preset that steps an actor's envs in one process is timed the same way:
    # CarRacing (a Box2D world and a rendered frame, milliseconds a step) under `box2d`, not
    # CartPole (microseconds) under `classic_control`; ALE's preset has its own vector env
    assert resolve_config(None, ["env.id=CarRacing-v3"]).env.vector == "async"
    assert resolve_config(None, ["env.id=CartPole-v1"]).env.vector == "python"
    assert resolve_config(None, ["env.id=ALE/Pong-v5"]).env.vector == "python"


def test_timing_a_step_reads_its_cost_not_a_busy_machines_waits():
    """A step of 0.1 ms of CPU that waits 20 ms one step in four, as a step waits for a core
    other processes hold on a busy machine: its mean wall time is ~5 ms, its cost 0.1 ms, and it
    keeps its envs in one process; a step that waits on every step (a simulator's own thread)
    has that wait counted (the test above: 2 ms of sleep a step reads as >= 2 ms)."""

    class Busy(SimpleNamespace):
        steps = 0

        def reset(self, seed=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            self.steps += 1
            start = time.thread_time()
            while time.thread_time() - start < 1e-4:
                pass
            if self.steps % 4 == 0:
                time.sleep(0.02)
            return np.zeros(2, np.float32), 0.0, False, False, {}

    env = Busy(
        observation_space=spaces.Box(-1, 1, (2,), np.float32), action_space=spaces.Discrete(3)
    )
    assert 1e-4 <= step_seconds(env, budget_s=10.0, max_steps=40) < SLOW_STEP_S


def test_timing_a_step_does_not_fail_on_an_env_that_refuses_random_actions():
    """An env whose step raises on some actions (masked moves) is timed as 0: the run starts
    with its envs in one process and meets the env's error, if any, where training steps it."""

    class Refusing(SimpleNamespace):
        def reset(self, seed=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            raise ValueError("illegal move")

    env = Refusing(
        observation_space=spaces.Box(-1, 1, (2,), np.float32), action_space=spaces.Discrete(3)
    )
    assert step_seconds(env) == 0.0


def test_a_cnn_given_for_vector_observations_is_refused_naming_the_encoder():
    """``model.encoder=nature_cnn`` on CartPole: the error names the encoder and the env's
    observations, not the family preset's ``normalize_obs`` that a CNN refuses; an image env
    takes any built-in CNN."""
    with pytest.raises(ConfigError) as info:
        resolve_config(None, ["env.id=CartPole-v1", "model.encoder=nature_cnn"])
    message = str(info.value)
    assert "'model.encoder': 'nature_cnn'" in message and "auto | mlp" in message
    assert "CartPole-v1" in message and "shape (4,)" in message
    given = ["env.id=impala_rl.envs.samples:Catch", "model.encoder=impala_resnet"]
    assert resolve_config(None, given).model.encoder == "impala_resnet"


def test_a_channels_last_pixel_env_gets_a_cnn_on_channels_first_frames():
    cfg = resolve_config(None, ["env.id=impala_rl.envs.samples:Catch"])
    assert cfg.model.encoder == "nature_cnn" and cfg.model.shared_torso  # 40 x 40 frames
    assert not cfg.model.normalize_obs
    env = EnvFactory.of(cfg.env)()
    assert env.observation_space.shape == (3, 40, 40)


CATCH = "env.id=impala_rl.envs.samples:Catch"


@pytest.fixture
def two_cores(monkeypatch):
    """A machine of 2 cores, other processes leaving ``idle`` of them (``two_cores(idle)``)."""
    monkeypatch.setattr("impala_rl.env_defaults.available_cores", lambda: 2)

    def leave_idle(idle: float) -> None:
        monkeypatch.setattr("impala_rl.env_defaults.idle_cores", lambda: idle)

    return leave_idle


def test_a_cnn_learner_gets_the_idle_core(monkeypatch, caplog, two_cores):
    """The sequential backend leaves the actors' core idle while the learner trains: a CNN's
    learner (an image, plain or in a Dict) takes 2 threads where the machine has 2 cores, an
    MLP's keeps one, a one-core machine one, actors in processes leave it the preset's one, and
    an explicit setting wins."""
    two_cores(1.9)
    with caplog.at_level(logging.INFO, logger="impala_rl.env_defaults"):
        assert resolve_config(None, [CATCH]).runner.learner_threads == 2
    assert "sequential backend, 2 learner threads for the CNN" in caplog.text
    grid = "env.id=impala_rl.envs.samples:GridWorld"  # a Dict of vectors
    assert resolve_config(None, [grid]).runner.learner_threads == 1
    given = resolve_config(None, [CATCH, "runner.learner_threads=1"])
    assert given.runner.learner_threads == 1
    in_processes = resolve_config(None, [CATCH, "runner.backend=subprocess"])  # cores taken
    assert in_processes.runner.learner_threads == 1
    monkeypatch.setattr("impala_rl.env_defaults.available_cores", lambda: 1)
    assert resolve_config(None, [CATCH]).runner.learner_threads == 1
    frames = spaces.Box(0, 255, (3, 40, 40), np.uint8)
    assert has_image(_env_with(spaces.Dict({"frame": frames, "speed": spaces.Discrete(3)}), None))
    assert not has_image(_env_with(spaces.Box(0, 1, (40, 40), np.float32), None))


def test_a_cnn_learner_keeps_one_thread_beside_a_busy_process(caplog, two_cores):
    """A second thread on the core another process keeps busy waits at every op (Catch's run
    took 3.5x one thread's beside one busy process): the console says why it has one."""
    two_cores(1.0)
    with caplog.at_level(logging.INFO, logger="impala_rl.env_defaults"):
        assert resolve_config(None, [CATCH]).runner.learner_threads == 1
    assert "1 learner thread for the CNN (1.0 of 2 cores idle at start-up)" in caplog.text
    given = resolve_config(None, [CATCH, "runner.learner_threads=2"])
    assert given.runner.learner_threads == 2


@pytest.mark.parametrize(
    ("env_id", "preset"),
    [
        ("MiniGrid-DoorKey-5x5-v0", "minigrid"),
        ("MiniGrid-Empty-5x5-v0", "minigrid"),
        ("MinAtar/Breakout-v1", "minatar_breakout"),
        ("MinAtar/Asterix-v1", "minatar"),
        ("ALE/Breakout-v5", "pong_appo"),
        ("BreakoutNoFrameskip-v4", "pong_appo"),  # the legacy id older tutorials type
        ("Taxi-v4", GENERIC_PRESET),
        ("impala_rl.envs.samples:GridWorld", GENERIC_PRESET),
    ],
)
def test_ids_of_a_family_choose_its_preset(env_id, preset):
    ale = env_id.startswith("ALE/") or "NoFrameskip" in env_id
    for prefix, package in (("MiniGrid-", "minigrid"), ("MinAtar/", "minatar")):
        if env_id.startswith(prefix):
            pytest.importorskip(package)
    if ale:
        pytest.importorskip("ale_py")
    cfg = resolve_config(None, [f"env.id={env_id}", "runner.size_to_machine=false"])
    assert cfg.env.id == env_id
    chosen = load_config(preset, [f"env.id={env_id}"])
    assert cfg.algorithm.policy_loss == chosen.algorithm.policy_loss
    assert cfg.algorithm.num_passes == chosen.algorithm.num_passes
    assert cfg.algorithm.lr == chosen.algorithm.lr
    assert cfg.model.encoder == chosen.model.encoder or preset == GENERIC_PRESET
    if ale:  # the game is the id; its own sticky actions
        assert "game" not in cfg.env.kwargs and "repeat_action_probability" not in cfg.env.kwargs
        assert cfg.target_return is None  # not Pong's 20


@pytest.mark.parametrize(
    ("budget", "preset"),
    [
        (None, "minatar"),
        (300_000, "minatar_short"),
        (SHORT_BUDGET, "minatar_short"),
        (SHORT_BUDGET + 1, "minatar"),
    ],
)
def test_a_minatar_id_on_a_short_budget_reuses_its_batches(budget, preset, caplog):
    """One IMPALA pass per batch is the MinAtar choice for millions of env steps; a budget of
    at most 1M given as ``max_env_steps`` gets PPO's sample reuse (Breakout included)."""
    pytest.importorskip("minatar")
    given = [] if budget is None else [f"max_env_steps={budget}"]
    for env_id in ("MinAtar/Freeway-v1", "MinAtar/Breakout-v1"):
        overrides = [f"env.id={env_id}", "runner.size_to_machine=false", *given]
        caplog.clear()
        with caplog.at_level("INFO"):
            cfg = resolve_config(None, overrides)
        if preset == "minatar":
            assert cfg.algorithm.num_passes == 1 and cfg.algorithm.policy_loss == "impala"
            continue
        assert cfg == load_config(preset, [f"env.id={env_id}", *given])
        assert cfg.algorithm.num_passes == 10 and cfg.algorithm.policy_loss == "appo"
        assert cfg.model.encoder == "minatar_cnn" and cfg.max_env_steps == budget
        # The lr decays to 0 over the budget given, not over the one-pass preset's 5M.
        assert scheduled_lr(cfg.algorithm, 0, cfg.max_env_steps) == cfg.algorithm.lr
        assert scheduled_lr(cfg.algorithm, budget // 2, cfg.max_env_steps) == pytest.approx(
            cfg.algorithm.lr * (budget - budget // 2) / budget
        )
        assert scheduled_lr(cfg.algorithm, budget, cfg.max_env_steps) == 0.0
        assert f"lr 0.0003 decaying to 0 over {budget:,} env steps" in caplog.text


def test_the_console_says_which_family_chose_the_settings(caplog):
    pytest.importorskip("minigrid")
    with caplog.at_level("INFO"):
        resolve_config(None, ["env.id=MiniGrid-DoorKey-5x5-v0"])
    assert "the minigrid preset (MiniGrid env)" in caplog.text


@pytest.mark.parametrize(
    "overrides, compiled",
    [
        (["max_env_steps=100000"], True),  # 15,625 optimizer steps win the compile back
        (["max_env_steps=20000"], False),  # 3,125 do not
        (["max_env_steps=100000", "algorithm.compile_update=false"], False),
        (["max_env_steps=20000", "algorithm.compile_update=true"], True),
    ],
)
def test_the_console_says_when_an_mlps_update_is_compiled(caplog, overrides, compiled):
    with caplog.at_level("INFO"):
        cfg = resolve_config(None, ["env.id=impala_rl.envs.samples:PointGoal", *overrides])
    assert ("the update compiled" in caplog.text) == compiled
    assert cfg.algorithm.compile_update in (None, compiled)


@pytest.mark.parametrize(
    "refused", ["model.core=lstm model.shared_torso=true", "algorithm.num_learners=2"]
)
def test_the_console_does_not_say_compiled_where_the_learner_refuses(caplog, refused):
    """The console reads the learner's own refusals: an LSTM core or several learners run the
    update eagerly even when ``compile_update=true`` asks for it."""
    overrides = ["env.id=impala_rl.envs.samples:PointGoal", "algorithm.compile_update=true"]
    if refused.startswith("algorithm.num_learners"):
        overrides += ["algorithm.num_actors=2", "runner.backend=subprocess"]
    with caplog.at_level("INFO"):
        resolve_config(None, [*overrides, *refused.split()])
    assert "no preset of its family" in caplog.text
    assert "the update compiled" not in caplog.text


def test_a_pixel_envs_update_is_not_said_compiled(caplog):
    with caplog.at_level("INFO"):
        resolve_config(None, ["env.id=impala_rl.envs.samples:Catch", "max_env_steps=1000000"])
    assert "the update compiled" not in caplog.text


# -- the evaluation schedule ---------------------------------------------------------------------


def test_evaluation_due():
    assert evaluation_due(None, 100.0, 10.0, 1.0)  # no share: every epoch
    assert evaluation_due(0.1, 0.0, 0.0, 0.0)  # the first evaluation
    assert not evaluation_due(0.1, 1.0, 1.0, 19.0)
    assert evaluation_due(0.1, 1.0, 1.0, 20.0)


EVAL_S = 0.3


@pytest.mark.parametrize("background", [False, True])
def test_max_time_share_bounds_the_evaluation_time(tmp_path, monkeypatch, background):
    """Evaluations that cost far more than an epoch run only as often as the share allows; the
    final weights are still evaluated and kept as best."""
    evaluated: list[int] = []

    def slow_evaluate(self, model, epoch):
        time.sleep(EVAL_S)
        evaluated.append(epoch)
        return EvaluationResult([float(epoch)], [1])  # every result is a new best

    monkeypatch.setattr(Trainer, "_evaluate", slow_evaluate)
    overrides = [
        *FAST,
        "target_return=null",
        "algorithm.epoch_length=1",
        "algorithm.n_epochs=60",
        "algorithm.rollout_evaluator.max_time_share=0.1",
        f"algorithm.rollout_evaluator.background={str(background).lower()}",
    ]
    summary = Trainer(load_config("cartpole", overrides), run_dir=tmp_path).train()
    assert summary["stopped_because"] == "n_epochs"
    assert evaluated[0] == 1 and evaluated[-1] == 60  # the first and the final weights
    assert len(evaluated) < 60 / 2
    # within the share, but for the first evaluation and the final one
    assert (len(evaluated) - 2) * EVAL_S <= 0.1 * summary["wall_time_s"] + EVAL_S
    best = checkpoint.load(tmp_path / "checkpoints" / "best.pt")["counters"]
    assert best["epoch"] == 60 and best["best_eval_return"] == 60.0


def test_without_a_preset_the_cli_says_what_it_chose(tmp_path):
    """stderr names the settings chosen; stdout is the summary JSON alone; the run's config
    holds the evaluation settings it named."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        _cmd(
            "train",
            "env.id=scripted_envs:make_env",
            "max_env_steps=3000",
            "algorithm.epoch_length=2",
            "runner.backend=sequential",
            "log.console=false",
            "log.tensorboard=false",
            "--run-dir",
            str(run_dir),
        ),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["best_eval_return"] is not None
    stderr = " ".join(proc.stderr.split())  # rich wraps long lines
    assert (
        "no preset of its family: the any_env preset for scripted_envs:make_env (discrete "
        "actions, vector observations); no target_return (the env spec has no "
        "reward_threshold); evaluation at most 10% of the time in a process of its own" in stderr
    )
    # What it said is what ran: the run's config (that a resume reads) holds the choice. That
    # a background evaluation does not hold training up is shown, with events rather than
    # wall-time shares, by test_background_evaluation_keeps_the_evaluated_snapshot_as_best.
    evaluator = OmegaConf.load(run_dir / "config.yaml").algorithm.rollout_evaluator
    assert evaluator.background == "process" and evaluator.max_time_share == 0.1
    rows = load_metrics(run_dir)
    assert any("eval_return/mean" in row for row in rows)


def test_a_cnn_gets_ppos_atari_reuse_and_an_explicit_setting_wins(caplog):
    catch = "env.id=impala_rl.envs.samples:Catch"
    with caplog.at_level(logging.INFO, logger="impala_rl.env_defaults"):
        cfg = resolve_config(None, [catch])
    assert (cfg.algorithm.num_passes, cfg.algorithm.num_minibatches) == IMAGE_REUSE == (4, 4)
    assert (
        "4 passes x 4 minibatches of single decisions (PPO's Atari reuse for the CNN)"
        in caplog.text
    )
    given = resolve_config(None, [catch, "algorithm.num_passes=10"])
    assert (given.algorithm.num_passes, given.algorithm.num_minibatches) == (10, 4)
    vectors = resolve_config(None, ["env.id=impala_rl.envs.samples:GridWorld"])
    any_env = load_config(GENERIC_PRESET).algorithm
    assert (vectors.algorithm.num_passes, vectors.algorithm.num_minibatches) == (
        any_env.num_passes,
        any_env.num_minibatches,
    )


def test_any_env_draws_single_decisions_unless_the_user_asks_for_a_core():
    """PPO's minibatches for an env of no family; a core (one torso feeds it) trains on whole
    columns (the LSTM needs sequences), and ``steps`` set beside a core is refused."""
    grid = "env.id=impala_rl.envs.samples:GridWorld"
    assert resolve_config(None, [grid]).algorithm.minibatch_of == "steps"
    lstm = [grid, "model.core=lstm"]  # and one torso to feed it, which the user need not say
    cfg = resolve_config(None, lstm)
    assert cfg.algorithm.minibatch_of == "columns" and cfg.model.shared_torso
    with pytest.raises(ConfigError, match=r"algorithm\.minibatch_of"):
        resolve_config(None, [*lstm, "algorithm.minibatch_of=steps"])
