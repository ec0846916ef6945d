"""``env.vector=async``: an actor's envs each in a process of their own, stepped at once
(Gymnasium's ``AsyncVectorEnv``), for envs whose step is slow; the same episodes as ``python``."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from impala_rl.config import ConfigError, load_config
from impala_rl.envs import EnvFactory
from impala_rl.nn import ActorCritic
from impala_rl.rollout import ActorLoop, rollout_spec_for
from test_cli import QUIET, _impala, _in_own_group, _process_group

ENV_ID = "scripted_envs:make_env"
KWARGS = {"episode_lengths": [3, 5, 30], "terminate": True}  # the 30-step one is truncated


def _rollouts(vector: str, n_unrolls: int = 3) -> list[dict[str, torch.Tensor]]:
    factory = EnvFactory(ENV_ID, KWARGS, max_episode_steps=12, vector=vector)
    probe = factory()
    torch.manual_seed(0)
    model = ActorCritic(probe.observation_space, probe.action_space, hidden_sizes=(16,))
    probe.close()
    loop = ActorLoop(factory, 3, model, seed=4, unroll_length=10)
    slots = []
    try:
        if vector == "async":
            assert isinstance(loop.envs, gym.vector.AsyncVectorEnv)
        spec = rollout_spec_for(model, loop.envs.single_observation_space, 10, 3)
        for _ in range(n_unrolls):
            slot = spec.allocate()
            loop.unroll(slot)
            slots.append(slot)
    finally:
        loop.close()
    return slots


def test_async_envs_give_the_rollouts_of_envs_stepped_in_turn():
    """Terminations, truncations (with their final observations' values), first flags and the
    policy's samples: field for field what the one-process vector env gives."""
    python, in_processes = _rollouts("python"), _rollouts("async")
    for a, b in zip(python, in_processes, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    truncated = torch.cat([s["truncated"] for s in python])
    assert truncated.any() and torch.cat([s["terminated"] for s in python]).any()
    assert not multiprocessing.active_children()  # closing the loop joined its env processes


def test_async_is_refused_where_actors_have_processes_of_their_own():
    with pytest.raises(ConfigError, match=r"'env.vector'.*runner.backend=subprocess"):
        load_config("cartpole", ["env.vector=async", "runner.backend=subprocess"])
    assert load_config("cartpole", ["env.vector=async"]).env.vector == "async"


def test_a_slow_env_trains_with_its_envs_in_processes_and_leaves_none(tmp_path):
    """``env.id=ID`` of an env whose step takes 2 ms: the console says each env runs in its
    own process, training and evaluation run, and no process is left."""
    run_dir = tmp_path / "run"
    proc = _impala(
        "train",
        f"env.id={ENV_ID}",
        "env.kwargs.step_sleep_s=0.002",
        "max_env_steps=2048",
        "algorithm.num_passes=1",
        "algorithm.num_minibatches=1",
        "log.console=false",
        "log.tensorboard=false",
        "--run-dir",
        str(run_dir),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["best_eval_return"] is not None
    assert "each env in its own process (a step takes" in " ".join(proc.stderr.split())
    leftover = subprocess.run(
        ["pgrep", "-f", str(run_dir)], capture_output=True, text=True
    ).stdout.split()
    assert not leftover


def test_the_evaluator_steps_its_envs_as_training_does_with_the_same_episodes():
    """A run whose envs step in processes of their own evaluates the same way (a slow env's
    evaluation is its steps: CarRacing's 10 episodes took 0.65-0.68x the time), and the
    episodes are those of the envs stepped in turn: the sampled actions, so the returns and
    lengths."""
    from impala_rl.evaluation import evaluate
    from impala_rl.startup import probe_env

    assert probe_env(load_config("cartpole", ["env.vector=async"])).eval_env_factory.vector == (
        "async"
    )
    probe = EnvFactory("CartPole-v1", {})()
    torch.manual_seed(0)
    model = ActorCritic(probe.observation_space, probe.action_space, hidden_sizes=(16,))
    probe.close()
    results = [
        evaluate(model, EnvFactory("CartPole-v1", {}, vector=v), 4, deterministic=False, seed=3)
        for v in ("python", "async")
    ]
    assert results[0] == results[1]
    assert len(set(results[0].lengths)) > 1  # the sampled actions ended episodes in turn
    assert not multiprocessing.active_children()


def _leaves_its_stop_to_its_parent(pid: int) -> bool:
    """Whether the process ignores SIGINT and handles or ignores SIGTERM (``SigIgn``, ``SigCgt``
    in /proc; a process gone: it does not matter, so yes)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = dict(line.split(":", 1) for line in status.splitlines() if line.startswith("Sig"))
    ignored, caught = int(masks["SigIgn"], 16), int(masks["SigCgt"], 16)
    return bool(
        ignored & (1 << (signal.SIGINT - 1)) and (ignored | caught) & (1 << (signal.SIGTERM - 1))
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_whole_group_stops_a_run_whose_envs_and_evaluation_have_processes(
    tmp_path, signum
):
    """A terminal's Ctrl-C reaches the whole process group, and a SIGTERM may too (a ``kill``
    of the group, Slurm's scancel, systemd's stop): training's env processes and the
    evaluation's (in a process of its own, each env in one) leave it to the learner, so the
    run stops as interrupted, with no worker's traceback and nothing left running."""
    with _in_own_group(
        "train",
        f"env.id={ENV_ID}",
        "env.kwargs={step_sleep_s: 0.002, terminate: false}",
        "env.max_episode_steps=1500",  # an evaluation of 10 episodes takes seconds
        "max_env_steps=100000000",
        "algorithm.num_passes=1",
        "algorithm.num_minibatches=1",
        "algorithm.rollout_evaluator.max_time_share=null",
        "algorithm.epoch_length=1",
        "--run-dir",
        str(tmp_path / "run"),
        *QUIET,
        cwd=tmp_path,
    ) as proc:
        # the learner, 8 env processes, the evaluation's process and its 10: an evaluation
        # runs, every env process built (each takes its signals from its env's build on)
        deadline = time.monotonic() + 180
        while True:
            group = _process_group(proc.pid)
            others = [p for p in group if p != proc.pid]
            if len(group) >= 20 and all(_leaves_its_stop_to_its_parent(p) for p in others):
                break
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, (
                "no evaluation with every env process taking its signals within 180 s"
            )
            time.sleep(0.1)
        os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "leaked" not in err, err  # every process closed what it held
    assert json.loads(out)["stopped_because"] == "interrupted"
    assert _process_group(proc.pid) == []
