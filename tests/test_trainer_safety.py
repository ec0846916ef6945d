"""The trainer keeps its promises under awkward settings and faults: burn-in and patience,
non-finite gradients, Ctrl-C with two learners, a second Ctrl-C, hard kills and resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from impala_rl import checkpoint, distributed
from impala_rl import trainer as trainer_mod
from impala_rl.config import ConfigError, load_config
from impala_rl.distributed import LearnerGroup
from impala_rl.evaluation import EvaluationResult
from impala_rl.learner import Learner, NonFiniteError
from impala_rl.policy import load_run_config
from impala_rl.trainer import Trainer
from test_cli import QUIET, _cmd, _env, _impala, _in_own_group, _process_group
from test_learners import _children_left
from test_trainer import FAST, STEPS_PER_UPDATE, _read_summary, _train

# Every evaluation of CartPole capped at 5 steps returns exactly 5.0 (it cannot fail sooner).
FLAT_EVAL = ["algorithm.rollout_evaluator.max_episode_steps=5", "target_return=null"]


def _resume(run_dir: Path, *overrides: str) -> Trainer:
    trainer = Trainer(load_run_config(run_dir, list(overrides)), run_dir=run_dir, resume=True)
    trainer.train()
    return trainer


# -- critic burn-in ------------------------------------------------------------------------------


def test_burn_in_epochs_count_neither_towards_patience_nor_the_best_model(tmp_path):
    summary = _train(
        tmp_path,
        *FLAT_EVAL,
        "algorithm.lr=1e-9",
        "algorithm.n_epochs=20",
        "algorithm.epoch_length=1",
        "algorithm.patience=2",
        "algorithm.critic_burn_in_epochs=5",
    )
    # Epoch 6 is the first with a policy update: it sets the best, 7 and 8 do not beat it.
    assert summary["stopped_because"] == "patience"
    assert summary["epochs"] == 5 + 1 + 2
    best = checkpoint.load(tmp_path / "checkpoints" / "best.pt")
    assert best["counters"]["epoch"] == 6
    assert best["counters"]["best_eval_return"] == 5.0


def test_burn_in_epochs_do_not_stop_at_the_target_return(tmp_path):
    summary = _train(
        tmp_path,
        "target_return=0",
        "algorithm.n_epochs=10",
        "algorithm.epoch_length=1",
        "algorithm.critic_burn_in_epochs=2",
    )
    assert summary["stopped_because"] == "target_return"
    assert summary["epochs"] == 3


# -- non-finite gradients ------------------------------------------------------------------------


def test_an_inf_gradient_with_a_finite_loss_stops_before_the_step(tmp_path, monkeypatch):
    """From the third update on, one critic weight's gradient is Inf while the loss is finite:
    no optimizer step is taken, the run stops with a clear error and last.pt stays the last
    good one (epoch 1, finite weights)."""
    learners: list[Learner] = []

    class InfGradientLearner(Learner):
        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            learners.append(self)
            weight = next(iter(model.critic_parameters()))
            weight.register_hook(
                lambda g: torch.full_like(g, float("inf")) if self.num_updates >= 2 else g
            )

    monkeypatch.setattr(trainer_mod, "Learner", InfGradientLearner)
    with pytest.raises(NonFiniteError, match="gradient norm is"):
        _train(tmp_path, "algorithm.n_epochs=5", "algorithm.epoch_length=2")
    summary = _read_summary(tmp_path)
    assert summary["stopped_because"] == "error"
    assert summary["updates"] == 2
    model = learners[0].model
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    last = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert last["counters"]["epoch"] == 1 and last["counters"]["updates"] == 2
    assert all(bool(torch.isfinite(t).all()) for t in last["model"].values())


def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = Trainer(load_config("cartpole", [*FAST, "algorithm.n_epochs=1"]), run_dir=tmp_path)
    trainer.train()
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    with torch.no_grad():
        next(iter(trainer.learner.model.parameters())).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="not finite"):
        trainer.save_checkpoint()
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


# -- a second Ctrl-C -----------------------------------------------------------------------------


def test_a_second_interrupt_right_after_the_optimizer_step_saves_a_consistent_checkpoint(
    tmp_path, monkeypatch
):
    """Two SIGINTs arrive just after the third optimizer step, before the learner and the
    trainer have counted it: the final checkpoint must count exactly the steps its weights have.
    """
    learners: list[Learner] = []

    class InterruptedLearner(Learner):
        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            learners.append(self)
            self.steps_taken = 0
            step = self.optimizer.step

            def step_then_interrupt(*a, **k):
                out = step(*a, **k)
                self.steps_taken += 1
                if self.steps_taken == 3:
                    for _ in range(2):
                        os.kill(os.getpid(), signal.SIGINT)
                        time.sleep(0.05)  # the handler runs before the next statement
                return out

            self.optimizer.step = step_then_interrupt

    monkeypatch.setattr(trainer_mod, "Learner", InterruptedLearner)
    summary = _train(tmp_path, "algorithm.n_epochs=5", "algorithm.epoch_length=2")
    learner = learners[0]
    assert summary["stopped_because"] == "interrupted"
    assert learner.steps_taken == 3
    last = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert last["counters"]["updates"] == 3
    assert last["counters"]["env_steps"] == 3 * STEPS_PER_UPDATE
    state = learner.model.state_dict()
    assert all(torch.equal(last["model"][k], state[k]) for k in state)


# -- Ctrl-C with several learners (issue 41.1) ---------------------------------------------------


def test_a_signal_inside_the_stop_vote_stops_every_learner_at_the_same_update(
    tmp_path, monkeypatch
):
    """SIGINT lands while the leader is inside its 6th ``control_sum``, where the learners
    share its stop flag: its handler runs as the call returns, after the flag went out as 0.
    Every learner must stop at the 7th update, where the flag is shared, and the run end
    within seconds as interrupted with that update's checkpoint; the leader must not stop
    alone at the 6th (it then waited in ``gather_to_leader``, the other learner in the next
    all-reduce, until ``GROUP_TIMEOUT_S``)."""
    # Lowered in this process (learner 0) only: a hang fails the test in 30 s, not 600.
    monkeypatch.setattr(distributed, "GROUP_TIMEOUT_S", 30.0)
    control_sum = LearnerGroup.control_sum
    calls, signalled_at = [0], []

    def signal_inside(self: LearnerGroup, values: list[float]) -> list[float]:
        out = control_sum(self, values)
        calls[0] += 1
        if calls[0] == 6:  # as if it came during the call: pthread_kill runs the handler now
            signalled_at.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return out

    monkeypatch.setattr(LearnerGroup, "control_sum", signal_inside)
    cfg = load_config(
        "cartpole",
        [
            *FAST,
            "algorithm.num_learners=2",
            "algorithm.epoch_length=5",
            "target_return=null",
            "max_env_steps=1000000000",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    summary = trainer.train()
    took = time.monotonic() - signalled_at[0]
    assert summary["stopped_because"] == "interrupted", summary
    assert summary["updates"] == 7 and calls[0] == 7
    assert took < 20, f"the run ended {took:.0f} s after the signal"
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")["counters"]
    assert saved["updates"] == 7 and saved["env_steps"] == summary["env_steps"]
    member = trainer.group_member
    assert member is not None and member.peers is not None
    assert member.peers.handles[0].exitcode == 0
    assert not _children_left()


def _signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` sent to process ``pid`` has not reached a handler yet (two signals
    of one kind sent before the first is delivered would count as one)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("backend", ["sequential", "subprocess"])
def test_a_second_signal_ends_a_run_whose_main_thread_waits_in_a_collective(tmp_path, backend):
    """Learner 1 stalls (its env blocks), so learner 0 waits inside a gloo all-reduce, where
    no Python signal handler runs. Two SIGINTs must still end the run within seconds, exit
    130, the last checkpoint intact, nothing it started left running (actor processes that
    die meanwhile are not restarted)."""
    run_dir, stall, stalled = tmp_path / "run", tmp_path / "stall", tmp_path / "stalled"
    last = run_dir / "checkpoints" / "last.pt"
    took = float("inf")
    with _in_own_group(
        "train",
        "cartpole",
        "--run-dir",
        str(run_dir),
        "env.id=nan_env:make_env_stalling_in_further_learners",
        f"env.kwargs.stall_file={stall}",
        f"env.kwargs.stalled_file={stalled}",
        "target_return=null",
        "max_env_steps=1000000000",
        "algorithm.epoch_length=2",
        "algorithm.num_learners=2",
        f"runner.backend={backend}",
        *QUIET,
        cwd=tmp_path,
    ) as proc:
        deadline = time.monotonic() + 120
        while not last.is_file() or not stalled.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint and no stall within 120 s"
            if last.is_file():
                stall.touch()
            time.sleep(0.1)
        for _ in range(2):
            os.kill(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while _signal_pending(proc.pid, signal.SIGINT):
                assert time.monotonic() < deadline, "SIGINT not delivered within 30 s"
                time.sleep(0.01)
        sent = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 60 s after the second SIGINT") from None
        took = time.monotonic() - sent

    assert proc.returncode == 130, err
    assert took < 20, f"it ended {took:.0f} s after the second SIGINT"
    assert checkpoint.load(last)["counters"]["updates"] >= 2
    assert not [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")]
    assert _process_group(proc.pid) == []


# -- resume ---------------------------------------------------------------------------------------


def test_resume_removes_the_temp_file_of_a_write_that_a_hard_kill_cut(tmp_path):
    _train(tmp_path, "algorithm.epoch_length=1", "algorithm.n_epochs=1", "target_return=null")
    stale = tmp_path / "checkpoints" / ".last.pt.4242.0123456789ab.tmp"
    stale.write_bytes(b"half a checkpoint")
    _resume(tmp_path, "algorithm.n_epochs=2")
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["counters"]["epoch"] == 2
    assert not stale.exists()


def test_resume_keeps_the_best_return_of_best_pt_when_last_pt_is_older(tmp_path, monkeypatch):
    """A hard kill can leave last.pt older than best.pt (best is written first, and last only
    every ``checkpoint_every_epochs``). The resumed run must still have to beat best.pt's return.
    """
    scripted: dict[int, float] = {}
    monkeypatch.setattr(
        Trainer, "_evaluate", lambda self, model, epoch: EvaluationResult([scripted[epoch]], [1])
    )
    common = ["algorithm.epoch_length=1", "target_return=null"]
    scripted.update({1: 10.0})
    _train(tmp_path, *common, "algorithm.n_epochs=1")
    last = tmp_path / "checkpoints" / "last.pt"
    shutil.copy(last, tmp_path / "epoch1.pt")

    scripted.update({2: 30.0, 3: 20.0})
    _resume(tmp_path, "algorithm.n_epochs=3")
    assert checkpoint.load(tmp_path / "checkpoints" / "best.pt")["counters"]["epoch"] == 2

    shutil.copy(tmp_path / "epoch1.pt", last)  # the kill: last.pt is still epoch 1's
    scripted.update({2: 25.0, 3: 15.0})
    trainer = _resume(tmp_path, "algorithm.n_epochs=3")
    best = checkpoint.load(tmp_path / "checkpoints" / "best.pt")["counters"]
    assert best["epoch"] == 2 and best["best_eval_return"] == 30.0
    assert trainer.counters.best_eval_return == 30.0
    assert _read_summary(tmp_path)["best_eval_return"] == 30.0


def test_resume_does_not_replay_the_first_runs_env_streams(tmp_path, monkeypatch):
    first_rows: list[torch.Tensor] = []
    update = Learner.update

    def recording_update(self, batch, train_policy=True, fresh=True, **kw):
        first_rows.append(batch["obs"][0].clone())
        return update(self, batch, train_policy=train_policy, fresh=fresh, **kw)

    monkeypatch.setattr(Learner, "update", recording_update)
    _train(tmp_path, "algorithm.n_epochs=1", "algorithm.epoch_length=1")
    _resume(tmp_path, "algorithm.n_epochs=2")
    assert len(first_rows) == 2
    # Both rows are the actors' first observations after their envs' reset.
    assert not torch.equal(first_rows[0], first_rows[1])

    # A new run with the same seed does replay them: runs stay reproducible.
    _train(tmp_path / "again", "algorithm.n_epochs=1", "algorithm.epoch_length=1")
    assert torch.equal(first_rows[0], first_rows[2])


def test_resume_keeps_the_window_of_recent_training_returns(tmp_path):
    _train(tmp_path, "algorithm.n_epochs=1", "algorithm.epoch_length=4")
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")["recent_returns"]
    assert saved, "CartPole episodes end within the first epoch's unrolls"
    trainer = _resume(tmp_path, "algorithm.n_epochs=2", "algorithm.epoch_length=1")
    window = list(trainer.recent_returns)
    assert window[: len(saved)] == saved[-100:][: len(window)]


def test_optimizer_overrides_on_resume_are_applied(tmp_path):
    _train(tmp_path, "algorithm.n_epochs=1", "algorithm.epoch_length=1")
    trainer = _resume(
        tmp_path,
        "algorithm.n_epochs=2",
        "algorithm.adam_betas=[0.5,0.9]",
        "algorithm.optimizer_eps=1e-5",
    )
    group = trainer.learner.optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.5, 0.9)
    assert group["eps"] == 1e-5
    assert trainer.counters.epoch == 2


def test_rmsprop_momentum_switched_on_at_resume_starts_from_zero(tmp_path):
    _train(
        tmp_path, "algorithm.n_epochs=1", "algorithm.epoch_length=1", "algorithm.optimizer=rmsprop"
    )
    trainer = _resume(
        tmp_path,
        "algorithm.n_epochs=2",
        "algorithm.rmsprop_alpha=0.9",
        "algorithm.rmsprop_momentum=0.5",
    )
    group = trainer.learner.optimizer.param_groups[0]
    assert (group["alpha"], group["momentum"]) == (0.9, 0.5)
    assert trainer.counters.updates == 2


def test_changing_the_optimizer_on_resume_is_refused_by_name(tmp_path):
    _train(tmp_path, "algorithm.n_epochs=1", "algorithm.epoch_length=1")
    with pytest.raises(ConfigError, match=r"algorithm\.optimizer='rmsprop'.*'adam'"):
        _resume(tmp_path, "algorithm.n_epochs=2", "algorithm.optimizer=rmsprop")
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["counters"]["epoch"] == 1


# -- impala eval ---------------------------------------------------------------------------------


def test_eval_honours_the_evaluators_max_episode_steps(tmp_path):
    _train(tmp_path / "run", "algorithm.n_epochs=1", "algorithm.epoch_length=1", *FLAT_EVAL)
    proc = _impala("eval", str(tmp_path / "run"), "--episodes", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["max_return"] == 5.0
    proc = _impala(
        "eval", str(tmp_path / "run"), "--episodes", "3", "--max-episode-steps", "7", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["max_return"] == 7.0


# -- hard kills ----------------------------------------------------------------------------------


def _wait_for_epoch(last: Path, proc: subprocess.Popen, epoch: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        if last.is_file() and checkpoint.load(last)["counters"]["epoch"] >= epoch:
            return
        assert time.monotonic() < deadline, f"no checkpoint of epoch {epoch} in {timeout} s"
        time.sleep(0.05)


def _wait_for_no_processes(pgid: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while _process_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _process_group(pgid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_sigkill_mid_epoch_twice_then_resume_only_moves_forward(tmp_path):
    """The trainer (subprocess actors) is SIGKILLed mid-epoch twice and resumed each time; the
    counters, the best return and best.pt stay consistent and never move backwards, and the
    actor processes of a killed trainer do not outlive it."""
    run_dir = tmp_path / "run"
    last = run_dir / "checkpoints" / "last.pt"
    settings = [
        "log.console=false",
        "log.tensorboard=false",
        "target_return=null",
        "algorithm.n_epochs=1000",
        "algorithm.epoch_length=6",
        "algorithm.rollout_evaluator.n_episodes=2",
    ]
    commands = [
        ["train", "cartpole", "--run-dir", str(run_dir), *settings],
        ["train", "--resume", str(run_dir)],
    ]
    seen: list[dict] = []
    for attempt in range(2):
        with _in_own_group(*commands[min(attempt, 1)], cwd=tmp_path) as proc:
            target = (seen[-1]["last"]["epoch"] if seen else 0) + 2
            _wait_for_epoch(last, proc, target)
            time.sleep(0.2)  # into the next epoch
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert _wait_for_no_processes(proc.pid) == [], "actors outlived the killed trainer"
        seen.append(
            {
                "last": checkpoint.load(last)["counters"],
                "best": checkpoint.load(run_dir / "checkpoints" / "best.pt")["counters"],
            }
        )
    final_epochs = seen[-1]["last"]["epoch"] + 2
    proc = subprocess.run(
        _cmd("train", "--resume", str(run_dir), f"algorithm.n_epochs={final_epochs}"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    seen.append(
        {
            "last": checkpoint.load(last)["counters"],
            "best": checkpoint.load(run_dir / "checkpoints" / "best.pt")["counters"],
        }
    )
    assert summary["epochs"] == final_epochs == seen[-1]["last"]["epoch"]
    for key in ("epoch", "updates", "env_steps", "wall_time_s"):
        values = [s["last"][key] for s in seen]
        assert values == sorted(values) and len(set(values)) == len(values), (key, values)
    # A resume restarts every env, so a policy that balances longer than the ~48 steps per env
    # of two epochs ends no episode in them: the episode count may stand still, never go back.
    episodes = [s["last"]["episodes"] for s in seen]
    assert episodes == sorted(episodes), episodes
    best_returns = [s["best"]["best_eval_return"] for s in seen]
    assert best_returns == sorted(best_returns)
    for s in seen:  # best.pt is written just before last.pt: a kill can fall in between
        assert s["best"]["best_eval_return"] >= s["last"]["best_eval_return"]
        assert s["best"]["epoch"] <= s["last"]["epoch"] + 1
    assert summary["best_eval_return"] == best_returns[-1]
    assert np.isfinite(best_returns[-1])


def test_restored_optimizer_state_keeps_the_channels_last_layout(tmp_path):
    """A resumed run's optimizer moments must be laid out like its (channels-last) parameters,
    or every later step pays for a layout conversion."""
    import gymnasium as gym

    from impala_rl.learner import load_optimizer_state
    from impala_rl.nn.factory import build_model

    cfg = load_config("pong")
    spaces = (gym.spaces.Box(0, 255, (4, 84, 84), dtype=np.uint8), gym.spaces.Discrete(6))
    learners = [Learner(build_model(cfg.model, *spaces), cfg.algorithm) for _ in range(2)]
    for p in learners[0].model.parameters():
        p.grad = torch.ones_like(p)
    learners[0].optimizer.step()
    path = tmp_path / "last.pt"
    state = {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "optimizer": learners[0].optimizer.state_dict(),
    }
    checkpoint.save_atomic(state, path)
    load_optimizer_state(learners[1].optimizer, checkpoint.load(path)["optimizer"], cfg.algorithm)
    conv = [p for p in learners[1].model.parameters() if p.ndim == 4]
    assert conv and all(p.is_contiguous(memory_format=torch.channels_last) for p in conv)
    for p in learners[1].model.parameters():
        assert learners[1].optimizer.state[p]["square_avg"].stride() == p.stride()


# -- evaluation in the background ----------------------------------------------------------------

BACKGROUND = ["algorithm.rollout_evaluator.background=true", "target_return=null"]


def _weights_sum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.state_dict().values()))


def test_background_evaluation_keeps_the_evaluated_snapshot_as_best(tmp_path, monkeypatch):
    """Training goes on while a snapshot is evaluated, and best.pt holds the evaluated
    snapshot's weights and epoch, not the learner's weights when the result arrived."""
    seen: dict[int, dict] = {}

    def slow_evaluate(self, model, epoch):
        updates_before = self.counters.updates
        time.sleep(0.5)
        seen[epoch] = {
            "weights": _weights_sum(model),
            "updates_during": self.counters.updates - updates_before,
        }
        return EvaluationResult([float(epoch)], [1])  # every result is a new best

    monkeypatch.setattr(Trainer, "_evaluate", slow_evaluate)
    trainer = Trainer(
        load_config(
            "cartpole", [*FAST, *BACKGROUND, "algorithm.n_epochs=6", "algorithm.epoch_length=2"]
        ),
        run_dir=tmp_path,
    )
    summary = trainer.train()
    assert summary["stopped_because"] == "n_epochs"
    assert max(seen) == 6  # the last epoch's weights are evaluated before the run ends
    assert 1 < len(seen) < 6  # epochs that end while an evaluation runs are not evaluated
    assert any(s["updates_during"] > 0 for s in seen.values())  # training did not wait
    best = checkpoint.load(tmp_path / "checkpoints" / "best.pt")
    assert best["counters"]["epoch"] == 6 and best["counters"]["best_eval_return"] == 6.0
    assert float(sum(t.double().sum() for t in best["model"].values())) == pytest.approx(
        seen[6]["weights"], rel=1e-12
    )
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["time_evaluation"] < 0.5 for row in metrics)
    # The evaluation of the last epoch finished after its row: the row is written again with it.
    assert metrics[-1]["epoch"] == 6 and metrics[-1]["eval_return/mean"] == 6.0
    assert metrics[-1]["episode_return/mean"] == metrics[-2]["episode_return/mean"]


def test_background_evaluation_patience_counts_evaluations(tmp_path, monkeypatch):
    def flat_evaluate(self, model, epoch):
        time.sleep(0.2)
        return EvaluationResult([5.0], [5])

    monkeypatch.setattr(Trainer, "_evaluate", flat_evaluate)
    summary = _train(
        tmp_path,
        *BACKGROUND,
        "algorithm.n_epochs=200",
        "algorithm.epoch_length=1",
        "algorithm.patience=2",
    )
    assert summary["stopped_because"] == "patience"
    best = checkpoint.load(tmp_path / "checkpoints" / "best.pt")["counters"]
    assert best["best_eval_return"] == 5.0
    last = checkpoint.load(tmp_path / "checkpoints" / "last.pt")["counters"]
    assert last["epochs_without_improvement"] == 2
    assert last["epoch"] > best["epoch"]


def test_background_evaluation_of_the_real_evaluator_learns_cartpole_budget(tmp_path):
    summary = _train(
        tmp_path,
        "algorithm.rollout_evaluator.background=true",
        "algorithm.n_epochs=4",
        "algorithm.epoch_length=2",
    )
    assert summary["stopped_because"] in ("n_epochs", "target_return")
    assert summary["last_eval_return"] is not None and summary["best_eval_return"] is not None
    checkpoint.load(tmp_path / "checkpoints" / "best.pt")


def test_a_run_directory_in_use_is_refused(tmp_path):
    """A second training process in a run directory (e.g. a resume started while the run still
    goes) is refused before it writes anything: it would interleave metrics and checkpoints."""
    import fcntl

    from impala_rl.config import load_config
    from impala_rl.rundir import RunDirError
    from impala_rl.trainer import Trainer

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cfg = load_config("cartpole", ["log.console=false", "log.tensorboard=false"])
        with pytest.raises(RunDirError, match="in use by another training process"):
            Trainer(cfg, run_dir=tmp_path).train()
    assert not (tmp_path / "metrics.jsonl").exists()
