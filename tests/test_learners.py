"""Several learners (``algorithm.num_learners``): a gloo group of learner processes on the CPU.

Each learner takes its own batches; gradients and update statistics are averaged over the
group before every step. Checked here: the group's step equals one learner's step on the
concatenated batches, every learner holds the same weights, CartPole learns with two learners
(subprocess actors and a local Ray), a run resumes with another number of learners, and a
learner that dies ends the run with its error named, the last good checkpoint kept and
nothing left running.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import impala_rl
from impala_rl import checkpoint, distributed
from impala_rl.config import ConfigError, ImpalaAlgorithmConfig, ModelConfig, load_config
from impala_rl.distributed import LearnerGroup, LearnerGroupError, Rendezvous, make_store
from impala_rl.envs import EnvFactory
from impala_rl.learner import Learner
from impala_rl.nn.factory import build_model
from impala_rl.rollout import ActorLoop, rollout_spec_for
from impala_rl.trainer import Trainer

T, ENVS, UPDATES = 8, 4, 3
# RMSProp's step hardly depends on the gradient's scale unless epsilon is large: with 1.0 a
# sum of the learners' gradients instead of their mean would show.
ALGORITHM = dict(lr=5e-2, optimizer_eps=1.0, max_grad_norm=None, entropy_coef=0.01)


def _model():
    torch.manual_seed(1)
    return build_model(
        ModelConfig(hidden_sizes=[16], normalize_obs=True, popart=True),
        gym.spaces.Box(-5, 5, (4,)),
        gym.spaces.Discrete(2),
    )


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """``UPDATES`` CartPole unrolls of learner ``rank`` (its own env seed)."""
    model = _model()
    factory = EnvFactory("CartPole-v1", {}, max_episode_steps=20)
    env = factory()
    spec = rollout_spec_for(model, env.observation_space, T, ENVS)
    env.close()
    loop = ActorLoop(factory, ENVS, copy.deepcopy(model), seed=10 + rank, unroll_length=T)
    out = []
    for _ in range(UPDATES):
        slot = spec.allocate()
        loop.unroll(slot)
        out.append({k: v.clone() for k, v in slot.items()})
    loop.close()
    return out


def _concat(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two batches side by side: columns are dim 1 of ``[T(+1), B, ...]``, dim 0 of ``[B]``."""
    return {k: torch.cat([a[k], b[k]], dim=1 if a[k].dim() >= 2 else 0) for k in a}


def _group_worker(rank: int, port: int, out: str) -> None:
    group = LearnerGroup(rank, Rendezvous("127.0.0.1", port, 2), torch.device("cpu"))
    torch.manual_seed(100 + rank)  # the learners' own random streams differ
    learner = Learner(_model(), ImpalaAlgorithmConfig(**ALGORITHM), group=group)
    for batch in _batches(rank):
        learner.update(batch)
    torch.save(learner.model.state_dict(), out)
    group.close()


def test_two_learners_take_one_learners_step_on_the_concatenated_batches(tmp_path):
    """Three updates on a gloo group of two: both learners end bit-identical, and equal (to
    float tolerance) to one learner updated on the two batches side by side. The model
    normalizes observations and has a PopArt head, so those statistics are merged too."""
    store = make_store("127.0.0.1", 2)
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_group_worker, args=(1, store.port, str(tmp_path / "1.pt")))
    peer.start()
    try:
        group = LearnerGroup(0, Rendezvous("127.0.0.1", store.port, 2), torch.device("cpu"), store)
        learner = Learner(_model(), ImpalaAlgorithmConfig(**ALGORITHM), group=group)
        for batch in _batches(0):
            learner.update(batch)
        group.close()
    finally:
        peer.join(60)
    assert peer.exitcode == 0
    leader, other = learner.model.state_dict(), torch.load(tmp_path / "1.pt")
    for name, value in leader.items():
        assert torch.equal(value, other[name]), name

    reference = Learner(_model(), ImpalaAlgorithmConfig(**ALGORITHM))
    for a, b in zip(_batches(0), _batches(1), strict=True):
        reference.update(_concat(a, b))
    start = _model().state_dict()
    for name, value in reference.model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(leader[name], value, rtol=1e-4, atol=1e-6, msg=name)
        if name.endswith("weight"):
            assert not torch.equal(value, start[name]), f"{name} did not move"
    assert int(leader["obs_norms.0.count"]) == 2 * UPDATES * T * ENVS


def test_num_learners_must_divide_a_given_num_actors():
    with pytest.raises(ConfigError, match="'algorithm.num_learners'.*a divisor of"):
        load_config("cartpole", ["algorithm.num_actors=4", "algorithm.num_learners=3"])


# -- whole runs ----------------------------------------------------------------------------------

FAST = ["log.console=false", "log.tensorboard=false"]


def _epochs(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(run_dir: Path) -> list[tuple[int, float | None]]:
    return [(r["env_steps"], r.get("train_return_recent")) for r in _epochs(run_dir)]


def _learning_record(run_dir: Path) -> str:
    """Every epoch's env steps, evaluation, training return, entropy and policy lag, as text: pytest
    prints a text message whole (a list's repr is cut after a few entries), so a run that did
    not learn shows how it went."""
    keys = ("eval_return/mean", "train_return_recent", "policy_entropy/0", "policy_lag/mean")
    lines = ["env_steps " + " ".join(keys)]
    for r in _epochs(run_dir):
        values = (r.get(k) for k in keys)
        lines.append(
            " ".join([str(r["env_steps"]), *("-" if v is None else f"{v:.3g}" for v in values)])
        )
    return "\n".join(lines)


def _our_shm() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(("psm_", "impala"))]


def _children_left() -> list[int]:
    """Live descendants of this process (zombies excluded) other than multiprocessing's
    helpers that live as long as it does (resource tracker, forkserver), from /proc."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, ppid in parent.items() if ppid == pid]
        found += kids
        frontier += kids
    return [pid for pid in found if not _helper(pid)]


def _helper(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # gone
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


@pytest.mark.parametrize("backend", ["subprocess", "ray"])
def test_cartpole_learns_with_two_learners(tmp_path, backend):
    """The ``cartpole`` preset with two learners of two actors each solves CartPole by the
    preset's own criterion (the deterministic policy's evaluation mean >= 475, its
    ``target_return``) within 400k env steps and stops there, with the training return of
    every learner's actors reported, and no process is left.

    It stops at the target as a user's run does, at the lr the preset advises for lagged
    actors (1e-3): these backends are not deterministic, and on a loaded machine the preset's
    2e-3 has a long tail. The evaluation first reached 475 at a median of 14-15k env steps,
    but a run can plateau at a training return of ~170 for 40k env steps before it gets
    there: with subprocess actors, under two busy loops beside two runs at a time, 4 of 150
    runs took over 30k (the slowest 83k), and one CI run never reached it within 150k; on Ray,
    two runs at a time, 4 of 40 (the slowest 87k). So the budget is ~27x the median
    (docs/experiments/cartpole.md)."""
    budget = 400_000
    summary = impala_rl.train(
        "cartpole",
        [*FAST, f"runner.backend={backend}", "algorithm.num_learners=2", "algorithm.lr=1e-3",
         "seed=0", f"max_env_steps={budget}"],
        run_dir=tmp_path,
    )  # fmt: skip
    evaluations = [r["eval_return/mean"] for r in _epochs(tmp_path) if "eval_return/mean" in r]
    assert summary["stopped_because"] == "target_return", _learning_record(tmp_path)
    assert summary["env_steps"] <= budget and evaluations[-1] >= 475, _learning_record(tmp_path)
    assert any(ret is not None for _, ret in _curve(tmp_path)), _curve(tmp_path)
    assert not _children_left()


def test_a_run_resumes_with_another_number_of_learners(tmp_path):
    """Two learners for two epochs, then one more epoch with one learner and one with two
    again: counters carry on, and the last checkpoint's weights are the group's."""
    common = [*FAST, "runner.backend=sequential", "target_return=null", "algorithm.epoch_length=5"]
    impala_rl.train(
        "cartpole", [*common, "algorithm.num_learners=2", "algorithm.n_epochs=2"], run_dir=tmp_path
    )
    first = checkpoint.load(tmp_path / "checkpoints" / "last.pt")["counters"]
    assert first["updates"] == 10 and first["epoch"] == 2
    for n, epochs in ((1, 3), (2, 4)):
        overrides = [f"algorithm.num_learners={n}", f"algorithm.n_epochs={epochs}"]
        summary = impala_rl.train(overrides=overrides, run_dir=tmp_path, resume=True)
        assert summary["epochs"] == epochs and summary["updates"] == 5 * epochs
    assert summary["env_steps"] > first["env_steps"]
    assert not _children_left()


def test_a_learner_killed_mid_run_ends_the_run_with_its_error_and_a_good_checkpoint(tmp_path):
    """SIGKILL the second learner after a few epochs: ``train`` raises naming learner 1 and
    how it ended, ``last.pt`` loads (from before the kill), and no process is left."""
    cfg = load_config(
        "cartpole",
        [
            *FAST,
            "runner.backend=subprocess",
            "algorithm.num_learners=2",
            "target_return=null",
            "max_env_steps=10000000",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            trainer.train()
        except BaseException as exc:  # the error under test
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while trainer.counters.epoch < 3 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    member = trainer.group_member
    assert member is not None and member.peers is not None and trainer.counters.epoch >= 3
    pid = member.peers.handles[0].pid
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    assert failure and isinstance(failure[0], LearnerGroupError), failure
    message = str(failure[0])
    assert "learner 1" in message and f"pid {pid}" in message and "-9" in message, message
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert saved["counters"]["epoch"] >= 2  # epoch 3 had started: 2 was written
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_because"] == "error" and "learner 1" in summary["error"]
    deadline = time.monotonic() + 30  # exits may lag on a busy machine; a leak stays
    while (_children_left() or _our_shm()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children_left()
    assert not _our_shm()


UNGUARDED_SCRIPT = """\
import impala_rl

impala_rl.train(
    "cartpole",
    ["algorithm.num_learners=2", "runner.backend=sequential", "log.console=false",
     "log.tensorboard=false", "algorithm.n_epochs=1", "algorithm.epoch_length=2"],
    run_dir={run_dir!r},
)
"""


def test_an_unguarded_script_is_told_to_guard_its_call_of_train(tmp_path):
    """Issue 41.4: a learner process imports the main module, so a script that calls
    ``impala_rl.train`` at module level starts it again there. The learner says so at once
    (it trains nothing, writes no run of its own), and the leader's error says what to do."""
    script = tmp_path / "train_unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.format(run_dir=str(tmp_path / "run")))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("impala_rl.distributed.LearnerGroupError: learner 1"), proc.stderr
    assert "if __name__ == '__main__':" in last and str(script) in last, last
    assert "no error reported" not in last
    # the learner's own error says the same, before it built or wrote anything
    assert proc.stderr.count("if __name__ == '__main__':") == 2, proc.stderr
    assert "RunDirError" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "train_unguarded.py"]


def test_a_group_that_cannot_form_is_a_learner_group_error(monkeypatch):
    """A learner group that fails to form (its rendezvous unreachable, a peer gone before the
    group's first handshake) is a :class:`LearnerGroupError` like a broken collective, naming
    the learner that failed where the leader can tell: ``impala train`` prints one line."""
    monkeypatch.setattr(distributed, "GROUP_TIMEOUT_S", 2.0)
    store = make_store("127.0.0.1", 2)
    port = store.port
    del store  # nobody listens there now
    with pytest.raises(LearnerGroupError, match="learner 1: the learner group") as info:
        LearnerGroup(1, Rendezvous("127.0.0.1", port, 2), torch.device("cpu"))
    # torch's message, without the C++ frames it carries: one line for impala train
    assert "timed out" in str(info.value) and "\n" not in str(info.value), str(info.value)

    def gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")  # gloo's handshake, a peer gone

    monkeypatch.setattr(distributed.dist, "init_process_group", gone)
    store = make_store("127.0.0.1", 2)
    failed = "learner 1 (pid 1 exited with code 1): EnvError: boom"
    with pytest.raises(LearnerGroupError, match=r"learner 1 \(pid 1 exited"):
        LearnerGroup(
            0, Rendezvous("127.0.0.1", store.port, 2), torch.device("cpu"), store, lambda: failed
        )
