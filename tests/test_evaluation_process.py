"""The rollout evaluator in a process of its own (``rollout_evaluator.background=process``)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import time

import gymnasium as gym
import pytest
import torch

from impala_rl import checkpoint
from impala_rl.config import ConfigError, load_config
from impala_rl.envs import EnvFactory
from impala_rl.evaluation import ProcessEvaluator, evaluate
from impala_rl.nn.factory import build_model
from test_learners import _children_left
from test_trainer import _train

# Long enough for a spawned process to import torch and gymnasium on a loaded 2-core machine.
DEADLINE_S = 180.0


def _cartpole() -> tuple[torch.nn.Module, EnvFactory]:
    factory = EnvFactory("CartPole-v1")
    probe = factory()
    torch.manual_seed(0)
    model = build_model(load_config("cartpole").model, probe.observation_space, probe.action_space)
    probe.close()
    return model, factory


def _wait_for(evaluator: ProcessEvaluator):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        done = evaluator.poll()
        if done is not None:
            return done
        time.sleep(0.05)
    raise AssertionError(f"no evaluation result within {DEADLINE_S:.0f} s")


def test_process_evaluation_returns_what_evaluating_here_returns_for_the_snapshot():
    """The process evaluates the weights the model had at start() with the seed of the tag,
    so its episodes are those of the same evaluation in this process; the snapshot handed
    back holds those weights although the model changed since; its time is reported."""
    model, factory = _cartpole()
    seconds: list[float] = []
    evaluator = ProcessEvaluator(
        model, factory, lambda tag: 100 + tag, seconds.append, n_episodes=4, deterministic=False
    )
    try:
        expected = evaluate(model, factory, 4, deterministic=False, seed=103)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        evaluator.start(model, 3)
        assert evaluator.busy
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training goes on meanwhile
        tag, snapshot, result = _wait_for(evaluator)
        assert not evaluator.busy
        assert tag == 3
        assert result.returns == expected.returns and result.lengths == expected.lengths
        for key, value in snapshot.state_dict().items():
            assert torch.equal(value, before[key])
        assert len(seconds) == 1 and seconds[0] > 0
        evaluator.start(model, 4)  # the next one runs on the weights as they are now
        changed = evaluate(model, factory, 4, deterministic=False, seed=104)
        assert _wait_for(evaluator)[2].returns == changed.returns
    finally:
        evaluator.close()
    assert not evaluator.busy
    assert _children_left() == []


class SlowCartPole(gym.Wrapper):
    """CartPole that takes 50 ms a step: an evaluation that runs for a while."""

    def step(self, action):
        time.sleep(0.05)
        return self.env.step(action)


def make_slow_cartpole() -> gym.Env:
    return SlowCartPole(gym.make("CartPole-v1"))


def make_broken_cartpole() -> gym.Env:
    raise RuntimeError("this env cannot be built")


def test_process_evaluation_is_cancelled_and_closed_without_waiting_for_its_episodes():
    model, _ = _cartpole()
    evaluator = ProcessEvaluator(
        model,
        EnvFactory("test_evaluation_process:make_slow_cartpole"),
        lambda t: t,
        lambda s: None,
        n_episodes=10,
    )
    try:
        evaluator.start(model, 1)  # ~10 episodes of >= 8 steps of 50 ms: seconds
        time.sleep(1.0)
        t0 = time.monotonic()
        evaluator.cancel()
        assert not evaluator.busy
        assert evaluator.poll() is None
        evaluator.start(model, 2)  # the process serves the next evaluation
        t1 = time.monotonic()
    finally:
        evaluator.close()
    assert t1 - t0 < DEADLINE_S / 2
    assert _children_left() == []


def test_an_error_in_the_evaluation_process_is_raised_by_poll_with_its_traceback():
    model, _ = _cartpole()
    factory = EnvFactory("test_evaluation_process:make_broken_cartpole")
    evaluator = ProcessEvaluator(model, factory, lambda t: t, lambda s: None, n_episodes=2)
    try:
        evaluator.start(model, 1)
        with pytest.raises(RuntimeError, match="this env cannot be built"):
            evaluator.poll(wait=True)
    finally:
        evaluator.close()
    assert _children_left() == []


def test_training_with_the_evaluator_in_a_process_keeps_best_and_leaves_no_process(tmp_path):
    summary = _train(
        tmp_path,
        "algorithm.rollout_evaluator.background=process",
        "algorithm.n_epochs=4",
        "algorithm.epoch_length=2",
        "target_return=null",
    )
    assert summary["stopped_because"] == "n_epochs"
    # The final weights are evaluated before the run ends, in the process or here.
    assert summary["last_eval_return"] is not None and summary["best_eval_return"] is not None
    checkpoint.load(tmp_path / "checkpoints" / "best.pt")
    assert _children_left() == []
    assert mp.active_children() == []


def test_an_unknown_background_evaluation_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"rollout_evaluator\.background.*thread \| process"):
        load_config("cartpole", ["algorithm.rollout_evaluator.background=processes"])
    for value, kept in (("true", True), ("false", False), ("thread", "thread")):
        cfg = load_config("cartpole", [f"algorithm.rollout_evaluator.background={value}"])
        assert cfg.algorithm.rollout_evaluator.background == kept


def test_a_model_that_does_not_pickle_is_refused_naming_the_field():
    model, factory = _cartpole()
    model.not_picklable = threading.Lock()  # e.g. a lock kept on the user's network
    with pytest.raises(ValueError, match=r"background=process .* does not pickle"):
        ProcessEvaluator(model, factory, lambda t: t, lambda s: None, n_episodes=1)
    assert _children_left() == []


def test_a_script_from_stdin_is_refused_naming_the_setting_before_training(tmp_path):
    """The evaluation process imports the main module; a piped script has no file to import."""
    script = (
        "import impala_rl\n"
        "impala_rl.train('cartpole', ['algorithm.rollout_evaluator.background=process', "
        f"'max_env_steps=512', 'log.console=false'], run_dir={str(tmp_path / 'run')!r})\n"
    )
    done = subprocess.run(
        [sys.executable], input=script, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode != 0
    assert "is not a file (a script read from stdin?)" in done.stderr
    assert "background=thread" in done.stderr


def test_an_evaluation_sent_to_a_dead_process_names_its_epoch():
    model, factory = _cartpole()
    evaluator = ProcessEvaluator(model, factory, lambda t: t, lambda s: None, n_episodes=1)
    try:
        evaluator._process.kill()
        evaluator._process.join(DEADLINE_S)
        with pytest.raises(RuntimeError, match="evaluation of epoch 7"):
            evaluator.start(model, 7)  # refused here, or by poll when no answer comes
            evaluator.poll(wait=True)
    finally:
        evaluator.close()
    assert _children_left() == []
