"""The subprocess actor backend's own tests: same data as the sequential one, policy lag,
restart races, unpicklable factories, shutdown, signals and shared memory. What it shares with
the Ray backend (stale drops, prefetch, failures, restarts, learning) is tested for both in
``test_actor_backends.py``.

Actor processes start with ``forkserver``; the env factories they need live in
:mod:`fault_envs` (importable in the children: they inherit ``sys.path``). Every test is bounded
by a SIGALRM deadline (see ``_deadline``) and every wait in it has its own timeout, so a hung
actor fails a test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import impala_rl
from actor_backends import make_actors, pid_alive, proc_stat
from deadlines import alarm_deadline, time_limit, wait_until
from impala_rl.actors import ActorError, DistributedActors
from impala_rl.actors.subprocess import SubprocessDistributedActors
from impala_rl.config import ConfigError, ImpalaAlgorithmConfig, ModelConfig, RunnerConfig
from impala_rl.envs import EnvFactory
from impala_rl.nn.factory import build_model

DEFAULT_TIME_LIMIT_S = 120.0


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail (rather than hang) a test that runs past its deadline."""
    with alarm_deadline(request, DEFAULT_TIME_LIMIT_S):
        yield


def actor_pids(actors: SubprocessDistributedActors) -> list[int]:
    return [a.process.pid for a in actors.actors if a.process is not None]


def split_by_slot(batch: dict[str, torch.Tensor], n: int) -> list[tuple[int, dict]]:
    """The batch's column blocks of ``n`` envs (one actor unroll each), with the actor index."""
    width = batch["actor_index"].shape[0]
    blocks = []
    for start in range(0, width, n):
        cols = slice(start, start + n)
        block = {k: (v[cols] if v.ndim == 1 else v[:, cols]).clone() for k, v in batch.items()}
        index = block["actor_index"]
        assert torch.all(index == index[0]), "one slot's columns come from one actor"
        blocks.append((int(index[0]), block))
    return blocks


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def new_shm_entries(before: set[str], our_pids: set[int]) -> set[str]:
    """Entries in /dev/shm that were not there before and stay (others' tests run alongside, so
    transient entries and ``torch_<pid>_*`` files of processes that are not ours are ignored)."""

    def foreign(name: str) -> bool:
        parts = name.split("_")
        return (len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit()) and int(
            parts[1]
        ) not in our_pids

    new = {n for n in shm_entries() - before if not foreign(n)}
    deadline = time.monotonic() + 30  # removal may lag on a busy machine: a leak stays
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new &= shm_entries()
    return new


# ---------------------------------------------------------------------------------------------
# Same data as the sequential backend
# ---------------------------------------------------------------------------------------------


def collect_unrolls_per_actor(
    actors: DistributedActors, n: int, num_actors: int, per_actor_wanted: int
) -> dict[int, list[dict]]:
    """Collect until every actor has contributed ``per_actor_wanted`` unrolls (at most 500
    batches: subprocess actors start at different times, so early batches may come from a
    subset of them)."""
    per_actor: dict[int, list[dict]] = defaultdict(list)
    with actors:
        for _ in range(500):
            if all(len(per_actor[i]) >= per_actor_wanted for i in range(num_actors)):
                break
            out = actors.collect_outputs("cpu")
            # the sequential backend reuses its batch buffer: split_by_slot copies
            for index, block in split_by_slot(out.batch, n):
                per_actor[index].append(block)
    return per_actor


def test_subprocess_matches_sequential_exactly():
    settings = dict(
        num_actors=3,
        envs_per_actor=4,
        n_rollout_steps=16,
        actors_batch_size=2,
        max_episode_steps=25,  # truncations too: truncation_value uses the model
        seed=7,
    )
    wanted = 4
    sequential = collect_unrolls_per_actor(make_actors("sequential", **settings), 4, 3, wanted)
    parallel = collect_unrolls_per_actor(make_actors("subprocess", **settings), 4, 3, wanted)
    assert sorted(sequential) == sorted(parallel) == [0, 1, 2]
    for index in range(3):
        seq, par = sequential[index][:wanted], parallel[index][:wanted]
        assert len(seq) == len(par) == wanted, f"actor {index}: too few unrolls"
        for k in range(wanted):
            assert seq[k].keys() == par[k].keys()
            for name, expected in seq[k].items():
                assert torch.equal(expected, par[k][name]), (
                    f"actor {index}, unroll {k}: field {name!r} differs"
                )
    # episodes ended and were cut by the time limit somewhere in the compared unrolls
    compared = [u for i in range(3) for u in sequential[i][:wanted]]
    assert any(u["terminated"].any() for u in compared)
    assert any(u["truncated"].any() for u in compared)


def test_observation_statistics_reach_every_backend_alike():
    """The model's normalization statistics travel with its weights: subprocess actors act
    exactly as sequential ones, and differently from a model without the statistics."""
    settings = dict(num_actors=2, envs_per_actor=2, n_rollout_steps=8, actors_batch_size=2, seed=3)
    normed = collect_unrolls_per_actor(
        make_actors("sequential", normalize_obs=True, **settings), 2, 2, 2
    )
    parallel = collect_unrolls_per_actor(
        make_actors("subprocess", normalize_obs=True, **settings), 2, 2, 2
    )
    plain = collect_unrolls_per_actor(make_actors("sequential", **settings), 2, 2, 2)
    for index in (0, 1):
        for k in range(2):
            for name, expected in normed[index][k].items():
                assert torch.equal(expected, parallel[index][k][name]), (index, k, name)
    logp = "behaviour_log_prob"
    assert not torch.equal(normed[0][0][logp], plain[0][0][logp])


# ---------------------------------------------------------------------------------------------
# Policy lag and the bounded queue
# ---------------------------------------------------------------------------------------------


def learner_lags(actors: DistributedActors, out) -> list[int]:
    """Policy lag of every rollout (column) of a batch as the learner measures it: its update
    count (the actors' version when it takes the batch) minus the rollout's version."""
    return (actors.policy_version - out.batch["policy_version"]).tolist()


@pytest.mark.parametrize("backend", ["sequential", "subprocess"])
@pytest.mark.parametrize("max_policy_lag", [1, 3])
def test_policy_lag_is_non_negative_and_bounded(backend, max_policy_lag):
    actors = make_actors(backend, max_policy_lag=max_policy_lag)
    state = actors._template.state_dict()
    lags: list[int] = []
    with actors:
        for _ in range(40):
            out = actors.collect_outputs("cpu")
            batch_lags = learner_lags(actors, out)
            assert min(batch_lags) >= 0, batch_lags
            assert max(batch_lags) <= max_policy_lag, batch_lags
            lags.extend(batch_lags)
            time.sleep(0.002)  # a (very fast) learner update
            actors.broadcast_updated_policy(state)
    assert len(lags) == 40 * actors.cfg.actors_batch_size * actors.cfg.envs_per_actor


@pytest.mark.parametrize("max_policy_lag, num_passes", [(0, 1), (1, 1), (2, 3)])
def test_trainer_reports_policy_lag_within_max_policy_lag(tmp_path, max_policy_lag, num_passes):
    """The learner's own policy_lag statistics of a subprocess run respect the setting, on
    every pass over a batch."""
    run_dir = tmp_path / "run"
    summary = impala_rl.train(
        "cartpole",
        [
            "runner.backend=subprocess",
            f"algorithm.max_policy_lag={max_policy_lag}",
            f"algorithm.num_passes={num_passes}",
            "algorithm.epoch_length=4",
            "algorithm.rollout_evaluator.n_episodes=1",
            "max_env_steps=8192",
            "target_return=null",
            "log.console=false",
            "log.tensorboard=false",
        ],
        run_dir=run_dir,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "policy_lag/max" in row]
    assert len(rows) >= 2
    assert all(0 <= row["policy_lag/min"] for row in rows)
    assert max(row["policy_lag/max"] for row in rows) <= max_policy_lag, rows
    # the actors' env steps are the trainer's: trained and dropped rollouts alike
    assert sum(row["actor_env_steps"] for row in rows) == summary["env_steps"]


@pytest.mark.parametrize("backend", ["sequential", "subprocess"])
def test_backends_refuse_a_queue_smaller_than_a_batch_when_built_without_validation(backend):
    with pytest.raises(ConfigError, match="algorithm.queue_out_of_sync_factor"):
        make_actors(backend, queue_out_of_sync_factor=0.4, actors_batch_size=2)


# ---------------------------------------------------------------------------------------------
# Restarts and failures
# ---------------------------------------------------------------------------------------------


def test_each_kill_is_one_restart_and_no_replacement_is_killed(caplog):
    """A dead actor's pipe and sentinel can both be ready in one wait; the replacement's
    sentinel may reuse the dead one's fd number. Neither may count as a second death (which
    stalled 5 s and then killed the healthy replacement: 35 restarts for 27 kills in a soak)."""
    kills = 20  # the race hits about one kill in eight
    actors = make_actors("subprocess", max_actor_restarts=100)
    with actors, caplog.at_level("WARNING", logger="impala_rl.actors.subprocess"):
        actors.collect_outputs("cpu")
        for k in range(kills):
            actor = actors.actors[k % 2]
            # a running actor (one killed as it starts would be restarted after a back-off)
            wait_until(lambda actor=actor: actor.up, 30, f"actor {k % 2} to come up")
            os.kill(actor.process.pid, signal.SIGKILL)
            wait_until(lambda k=k: actors.restarts >= k + 1, 10, f"restart {k + 1}")
            actors.collect_outputs("cpu")
        replacements = actor_pids(actors)
        deadline = time.monotonic() + 6.0  # past the 5 s join of a wrongly reaped replacement
        while time.monotonic() < deadline:
            actors.collect_outputs("cpu")
        assert actors.restarts == kills
        assert actor_pids(actors) == replacements and all(map(pid_alive, replacements))
        deaths = [r for r in caplog.records if "died (exit code -9)" in r.getMessage()]
        assert len(deaths) == kills


def test_an_actor_dying_before_it_comes_up_is_restarted_with_a_back_off(caplog):
    """An actor that dies at every start (an env that crashes as it is built; under Ray, a
    restart placed on a dying node) would spend the restart budget at once: each death in a
    row before the actor came up doubles the wait before the next restart."""
    from impala_rl.actors.supervisor import RESTART_BACKOFF_S

    actors = make_actors(
        "subprocess",
        env_id="fault_envs:make_env_dying_at_start",
        env_kwargs={"parent_pid": os.getpid()},
        max_actor_restarts=3,
        num_actors=1,
        actors_batch_size=1,
    )
    with caplog.at_level("WARNING", logger="impala_rl.actors.supervisor"):
        actors.start()
        try:
            with pytest.raises(ActorError, match=r"restart limit runner\.max_actor_restarts=3"):
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    actors.collect_outputs("cpu")
        finally:
            actors.stop()
    deaths = [r for r in caplog.records if "died" in r.getMessage()]
    delays = [RESTART_BACKOFF_S * 2**k for k in range(3)]
    assert len(deaths) == 3, [r.getMessage() for r in deaths]
    for record, delay in zip(deaths, delays, strict=True):
        assert f"restarting it in {delay:g} s" in record.getMessage()
    # each restart waited its back-off: the next death comes no sooner
    for before, after, delay in zip(deaths[:-1], deaths[1:], delays[:2], strict=True):
        assert after.created - before.created >= delay
    assert actors.restarts == 3


def test_unpicklable_env_factory_is_named():
    factory = EnvFactory("CartPole-v1")
    env = factory()
    model = build_model(ModelConfig(hidden_sizes=[8]), env.observation_space, env.action_space)
    env.close()
    actors = SubprocessDistributedActors(
        lambda: factory(),
        model,
        ImpalaAlgorithmConfig(num_actors=1, envs_per_actor=1, actors_batch_size=1),
        0,
        runner=RunnerConfig(backend="subprocess"),
    )
    with pytest.raises(ActorError, match="env factory") as info:
        actors.start()
    assert "<lambda>" in str(info.value)
    actors.stop()  # nothing was started: a no-op


# ---------------------------------------------------------------------------------------------
# Shutdown, signals, resources
# ---------------------------------------------------------------------------------------------


def test_stop_joins_every_actor_process():
    actors = make_actors("subprocess", num_actors=3)
    actors.start()
    pids = actor_pids(actors)
    assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    for _ in range(3):
        actors.collect_outputs("cpu")
    t0 = time.monotonic()
    actors.stop()
    assert time.monotonic() - t0 < 5.0
    assert all(a.process is None for a in actors.actors)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 2, "the actor processes to exit")
    actors.stop()  # twice is fine


def _impala_command() -> list[str]:
    script = Path(sys.executable).parent / "impala"
    return [str(script)] if script.exists() else [sys.executable, "-m", "impala_rl.cli"]


def _processes_left(session: int, run_dir: Path) -> list[str]:
    """Processes of the session or naming the run, zombies included: a helper that outlived
    its parent ends as one where PID 1 does not reap orphans."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat(int(entry.name))
        if fields is None or fields[0] == "X":
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[3]) == session or str(run_dir) in cmdline:
            left.append(f"{entry.name}: {cmdline[:120]}")
    return left


@time_limit(180)
@pytest.mark.parametrize(
    "how", ["completed", "sigint_to_group", "sigterm_to_main", "sigterm_to_group"]
)
def test_cli_leaves_no_process_behind_when_it_exits(tmp_path, how):
    """Checked the moment `impala train` exits, not some seconds later, zombies included: the
    forkserver and the resource tracker it started are stopped and joined too (left alone, they
    outlived it, the forkserver by ~2 s)."""
    run_dir = tmp_path / "run"
    log_path = tmp_path / "output.txt"
    budget = "max_env_steps=3000" if how == "completed" else "max_env_steps=10000000"
    command = [
        *_impala_command(),
        "train",
        "cartpole",
        "runner.backend=subprocess",
        budget,
        "target_return=null",
        "log.console=false",
        "log.tensorboard=false",
        "--run-dir",
        str(run_dir),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    session = proc.pid  # a new session's id is its leader's pid
    try:
        if how != "completed":
            last = run_dir / "checkpoints" / "last.pt"
            deadline = time.monotonic() + 120
            while not last.exists():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "no checkpoint within 120 s"
                time.sleep(0.1)
        if how == "sigint_to_group":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        elif how == "sigterm_to_main":
            os.kill(proc.pid, signal.SIGTERM)
        elif how == "sigterm_to_group":  # a `kill` of the group, Slurm's scancel, systemd's stop
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=120 if how == "completed" else 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within the time of {how}:\n{log_path.read_text()}")
        left = _processes_left(session, run_dir)
        output = log_path.read_text()
        summary = json.loads((run_dir / "summary.json").read_text())
        if how == "completed":
            assert code == 0, output
            assert summary["stopped_because"] == "max_env_steps"
        else:
            assert code == 130, output
            assert summary["stopped_because"] == "interrupted"
            assert "died" not in output  # the actors were stopped, not lost and restarted
            assert "Traceback" not in output
        assert not left, f"processes of the run still there when it exited: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        try:  # our own session only: whatever might have been left behind
            os.killpg(session, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_many_slots_and_parameters_reach_actor_processes():
    """An actor process gets one file descriptor per slot field, not per slot or parameter:
    the forkserver refuses 256 or more, which 16 actors with a batch of 4 unrolls reached."""
    actors = make_actors(
        "subprocess",
        hidden_sizes=(8,) * 130,  # 262 parameter tensors
        envs_per_actor=1,
        n_rollout_steps=2,
        actors_batch_size=64,  # 130 slots
    )
    with actors:
        assert len(actors.slots) >= 130
        out = actors.collect_outputs("cpu")
    assert out.batch["action"].shape == (3, 64)
    assert out.env_steps == 128


def test_no_shared_memory_left_behind():
    before = shm_entries()
    actors = make_actors("subprocess")
    with actors:
        ours = {os.getpid(), *actor_pids(actors)}
        for _ in range(3):
            actors.collect_outputs("cpu")
    assert not new_shm_entries(before, ours)

    actors = make_actors("subprocess")
    with actors:
        ours |= set(actor_pids(actors))
        actors.collect_outputs("cpu")
        os.kill(actors.actors[1].process.pid, signal.SIGKILL)
        wait_until(lambda: actors.restarts == 1, 10, "the restart")
        for _ in range(3):
            actors.collect_outputs("cpu")
        ours |= set(actor_pids(actors))
    assert not new_shm_entries(before, ours)


# ---------------------------------------------------------------------------------------------
# The main module and the helper modules in actor processes
# ---------------------------------------------------------------------------------------------


def test_fault_envs_importable_in_actor_processes():
    """The module the actor processes import is a plain module on sys.path."""
    import fault_envs

    env = fault_envs.make_crashing_env(crash_after=2)
    assert isinstance(env, gym.Env)
    env.reset(seed=0)
    env.step(0)
    with pytest.raises(RuntimeError, match="deliberate test crash"):
        env.step(0)


def test_a_script_from_stdin_gets_a_clear_error(tmp_path):
    """Actor processes import the main module; a script piped to python has no file to import."""
    script = (
        "import impala_rl\n"
        "impala_rl.train('cartpole', ['runner.backend=subprocess', 'max_env_steps=512', "
        f"'log.console=false'], run_dir={str(tmp_path / 'run')!r})\n"
    )
    done = subprocess.run(
        [sys.executable], input=script, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "is not a file (a script read from stdin?)" in done.stderr
    assert "runner.backend=sequential" in done.stderr


TRAIN_AND_RETURN = """
import sys
import impala_rl

if __name__ == "__main__":
    impala_rl.train("cartpole", [
        "runner.backend=subprocess", "max_env_steps=3000", "target_return=null",
        "log.console=false", "log.tensorboard=false",
    ], run_dir=sys.argv[1])
"""


@time_limit(180)
def test_a_script_that_trains_leaves_no_process_behind_when_it_returns(tmp_path):
    """The library's way, with no `impala` command to clean up: a script that trains and
    returns. Checked the moment it exits: the forkserver and the resource tracker are stopped
    and joined at interpreter exit, after the actors (left alone, they outlived it)."""
    run_dir = tmp_path / "run"
    script = tmp_path / "train_and_return.py"
    script.write_text(TRAIN_AND_RETURN)
    log_path = tmp_path / "output.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    session = proc.pid
    try:
        code = proc.wait(timeout=150)
        left = _processes_left(session, run_dir)
        assert code == 0, log_path.read_text()
        assert json.loads((run_dir / "summary.json").read_text())["env_steps"] >= 3000
        assert not left, f"processes of the script still there when it exited: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        try:
            os.killpg(session, signal.SIGKILL)
        except ProcessLookupError:
            pass
