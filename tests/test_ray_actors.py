"""The Ray actor backend's own tests, on a real Ray: the optional dependency, batches and
versions, stalls, two nodes, a killed trainer. What it shares with the subprocess backend (stale
drops, prefetch, failures, restarts, learning) is tested for both in ``test_actor_backends.py``.

Each test starts (and stops) its own local Ray, or, in the two-node test, its own two-node
cluster on this machine: a head and a second raylet started with ``ray start`` in their own
sessions, dedicated temp dirs and free ports, and killed by session id at the end (never
``ray stop``, which would stop every Ray on the machine). Every test has a SIGALRM deadline
and every wait its own timeout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

import impala_rl  # noqa: E402
import impala_rl.actors.ray as ray_backend  # noqa: E402
from actor_backends import make_actors, proc_stat, watch_actors  # noqa: E402
from deadlines import alarm_deadline, time_limit, wait_until  # noqa: E402
from impala_rl.actors.ray import PIPELINE  # noqa: E402

DEFAULT_TIME_LIMIT_S = 120.0
RAY_BIN = Path(sys.executable).parent / "ray"


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail (rather than hang) a test that runs past its deadline; never leave Ray connected."""
    try:
        with alarm_deadline(request, DEFAULT_TIME_LIMIT_S):
            yield
    finally:
        if ray.is_initialized():
            ray.shutdown()


def session_pids(session: int) -> list[int]:
    """Live processes of one session (``ps -s``): what one ``ray start`` left running."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == session:
                pids.append(int(entry.name))
    return pids


def kill_session(session: int) -> None:
    for pid in session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this test run: the OS may give the same
    just-released port twice, and two Ray components on one port fail to start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# ---------------------------------------------------------------------------------------------
# Optional dependency
# ---------------------------------------------------------------------------------------------


def test_importing_impala_rl_does_not_import_ray():
    code = "import sys, impala_rl, impala_rl.actors, impala_rl.trainer; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_without_ray_the_cli_says_how_to_install_it(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None\n"  # makes `import ray` fail as if not installed
        "from impala_rl.cli import main\n"
        f"sys.exit(main(['train', 'cartpole', 'runner.backend=ray', 'log.console=false', "
        f"'--run-dir', {str(tmp_path / 'run')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("impala: error:"), out.stderr
    assert "pip install 'impala-rl[ray]'" in lines[-1]


class _RecordingRay:
    """Stands in for the ``ray`` module: records ``ray.init``'s arguments, starts nothing."""

    def __init__(self):
        self.init_kwargs: dict = {}

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs):
        self.init_kwargs = kwargs


@pytest.mark.parametrize(("cores", "advertised"), [(6, 6), (1, 4)])
def test_a_local_ray_is_told_of_the_cores_the_run_may_use(monkeypatch, cores, advertised):
    """A local Ray gets the cores this process's affinity allows (a container's cpuset, not
    the host's count: Ray starts a worker per CPU it is told of), or what the actors ask for
    where that is more: here 8 actors of 0.5 CPU each, 4 CPUs."""
    monkeypatch.setattr(ray_backend, "available_cores", lambda: cores)
    monkeypatch.setattr(ray_backend, "start_watchdog", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    actors = make_actors("ray", num_actors=8, actors_batch_size=8)
    actors.ray = _RecordingRay()
    actors._prepare()
    assert actors.ray.init_kwargs["num_cpus"] == advertised


# ---------------------------------------------------------------------------------------------
# Batches, versions, the bounded queue
# ---------------------------------------------------------------------------------------------


def unrolls_per_actor(actors, batch, per_actor: dict[int, list[dict]]) -> None:
    """Split a batch into its rollouts (``envs_per_actor`` columns each), by actor index."""
    n = actors.cfg.envs_per_actor
    for start in range(0, batch["actor_index"].shape[0], n):
        cols = slice(start, start + n)
        block = {k: (v[cols] if v.ndim == 1 else v[:, cols]).clone() for k, v in batch.items()}
        per_actor.setdefault(int(block["actor_index"][0]), []).append(block)


def test_batches_match_the_other_backends_and_versions_are_bounded():
    wanted = 3  # rollouts per actor compared with the sequential backend's
    reference = make_actors("sequential", queue_out_of_sync_factor=1.5)
    expected: dict[int, list[dict]] = {}
    with reference:
        while any(len(expected.get(i, [])) < wanted for i in range(2)):
            unrolls_per_actor(reference, reference.collect_outputs("cpu").batch, expected)
    actors = make_actors("ray", queue_out_of_sync_factor=1.5)
    cfg = actors.cfg
    max_waiting = math.ceil(cfg.queue_out_of_sync_factor * cfg.actors_batch_size)
    state = actors._template.state_dict()
    handed: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # (version, learner's) by actor
    seen_actors: set[int] = set()
    with actors:
        assert ray.is_initialized()
        # Same seeds, same weights (no broadcast yet): each actor's rollouts are the sequential
        # backend's, field by field, in order (a Ray actor can start late: collect until both
        # delivered enough).
        got: dict[int, list[dict]] = {}
        deadline = time.monotonic() + 90
        while any(len(got.get(i, [])) < wanted for i in range(2)):
            assert time.monotonic() < deadline, (
                f"too few rollouts: { {i: len(g) for i, g in got.items()} }"
            )
            unrolls_per_actor(actors, actors.collect_outputs("cpu").batch, got)
        for index in range(2):
            for k in range(wanted):
                mine, theirs = got[index][k], expected[index][k]
                assert mine.keys() == theirs.keys()
                for name, value in theirs.items():
                    assert value.dtype == mine[name].dtype and value.shape == mine[name].shape
                    assert torch.equal(value, mine[name]), f"actor {index}, rollout {k}: {name}"
        assert any(u["terminated"].any() for i in range(2) for u in expected[i][:wanted])
        # at least 30 batches, and until both actors delivered (a Ray actor can start late)
        deadline = time.monotonic() + 90
        collected = 0
        while collected < 30 or seen_actors != {0, 1}:
            assert time.monotonic() < deadline, f"only actors {seen_actors} delivered"
            collected += 1
            out = actors.collect_outputs("cpu")
            assert out.batch.keys() == expected[0][0].keys()
            assert out.env_steps == cfg.actors_batch_size * cfg.envs_per_actor * 8
            now = actors.policy_version
            versions = out.batch["policy_version"]
            assert torch.all(versions <= now) and torch.all(versions >= 0)
            for col in range(0, versions.shape[0], cfg.envs_per_actor):  # one rollout each
                index = int(out.batch["actor_index"][col])
                handed[index].append((int(versions[col]), now))
            seen_actors.update(out.batch["actor_index"].tolist())
            assert cfg.actors_batch_size <= out.queue_size_before <= max_waiting
            assert 0 <= out.queue_size_after <= max_waiting
            assert actors.queue_size() <= max_waiting
            actors.broadcast_updated_policy(state)
        # the learner sleeps: the queue fills up to its bound and stays there
        wait_until(lambda: actors.queue_size() == max_waiting, 30, "the queue to fill")
        time.sleep(0.5)
        assert actors.queue_size() == max_waiting
        assert all(not a.refs or not actors.queue.is_blocked(a.index) for a in actors.actors)
        stats = actors.get_epoch_stats_aggregator().reduce()
    assert seen_actors == {0, 1}
    assert stats["actor_env_steps"] > 0 and stats["episode_return/count"] > 0
    # The weights reach the actors between unrolls: an actor's unroll is sent with the newest
    # weights when its rollout PIPELINE back enters the queue, at most one prefetched batch
    # and a queue of rollouts before the learner takes that one. (How far behind the learner a
    # rollout is depends on its actor's speed: on a loaded machine one actor can deliver while
    # the other waits for a core.)
    ahead = 1 + math.ceil(max_waiting / cfg.actors_batch_size)
    for index, rollouts in handed.items():
        for k in range(PIPELINE, len(rollouts)):
            version, earlier_taken_at = rollouts[k][0], rollouts[k - PIPELINE][1]
            assert version >= earlier_taken_at - ahead, (index, k, rollouts)
    assert not ray.is_initialized(), "stop() shuts down the Ray it started"


def test_stale_drop_after_a_long_pause_is_not_a_stall(monkeypatch):
    """A long evaluation: the queue fills and every actor waits for room, idle. The rollouts go
    stale with the next updates and are dropped; the actors get work again and are not stalled,
    although none delivered for longer than the stall timeout. (``max_policy_lag=1``: with 0,
    the batch prefetched during an update drops every rollout of the weights before it, and
    the queue never fills.)"""
    actors = make_actors("ray", max_policy_lag=1)
    state = actors._template.state_dict()
    with actors:
        actors.collect_outputs("cpu")  # the actors are up (starting one can take seconds)
        monkeypatch.setattr(ray_backend, "STALL_TIMEOUT_S", 3.0)  # an unroll takes milliseconds
        wait_until(
            lambda: (
                actors.queue_size() == actors.max_waiting
                and all(actors.queue.is_blocked(a.index) and not a.refs for a in actors.actors)
            ),
            30,
            "every actor to wait for queue room",
        )
        for _ in range(2):  # the last updates before the evaluation
            actors.broadcast_updated_policy(state)
        time.sleep(2 * ray_backend.STALL_TIMEOUT_S)  # the evaluation
        out = actors.collect_outputs("cpu")  # drops the whole queue, then waits for fresh ones
        assert out.dropped_stale >= actors.max_waiting
        assert torch.all(out.batch["policy_version"] == actors.policy_version)


# ---------------------------------------------------------------------------------------------
# Two nodes on one machine; the second one dies mid-run
# ---------------------------------------------------------------------------------------------

SLOT = "impala_test_slot"


class TwoNodeCluster:
    def __init__(self, auth_mode: str) -> None:
        # Short paths: Ray's unix sockets live under the temp dir.
        self.root = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
        self.sessions: dict[str, int] = {}
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            # one token-auth mode for every process of this cluster and for the test's own
            # (see two_node_cluster)
            "RAY_AUTH_MODE": auth_mode,
            # notice a dead node within a few seconds (default: tens of seconds)
            "RAY_health_check_initial_delay_ms": "1000",
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "4",
        }
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"

    def _start(self, name: str, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(RAY_BIN), "start", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # every process it starts stays in this session
            )
        self.sessions[name] = proc.pid
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, f"ray start ({name}) failed:\n{log.read_text()}"

    def _common(self, name: str, cpus: int, slots: int) -> list[str]:
        return [
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            f'--resources={{"{SLOT}": {slots}}}',
            f"--temp-dir={self.root / name}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
        ]

    def start(self) -> None:
        self._start(
            "head",
            [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                *self._common("head", cpus=1, slots=1),
            ],
        )
        self._start("worker", [f"--address={self.address}", *self._common("worker", 1, 2)])

    def kill(self, name: str) -> None:
        kill_session(self.sessions[name])

    def stop(self) -> None:
        for name in list(self.sessions):
            self.kill(name)
        for session in self.sessions.values():
            wait_until(lambda s=session: not session_pids(s), 20, "the Ray processes to exit")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def two_node_cluster(monkeypatch):
    # Ray 2.60 picks token auth per process: a head turns it on where ~/.ray/auth_token exists
    # but a worker joining it does not, and a local ray.init (an earlier test's) sets
    # RAY_AUTH_MODE=token in this process for good. A process of the other mode is refused
    # ("Missing authorization header"), and the actors it creates die at once. So the cluster
    # takes this process's mode, and a process without one takes "disabled".
    auth_mode = os.environ.get("RAY_AUTH_MODE") or "disabled"
    monkeypatch.setenv("RAY_AUTH_MODE", auth_mode)
    cluster = TwoNodeCluster(auth_mode)
    try:
        cluster.start()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


@time_limit(300)
def test_training_goes_on_when_a_node_dies(tmp_path, monkeypatch, two_node_cluster):
    cluster = two_node_cluster
    state = {"killed_at_update": None, "updates": 0, "nodes": None, "after_kill": set()}
    killer_error: list[BaseException] = []

    def kill_second_node(actors) -> None:
        try:
            wait_until(lambda: state["updates"] >= 5, 120, "the first updates")
            nodes = actors.actor_node_ids(timeout=60)
            state["nodes"] = nodes
            cluster.kill("worker")
            state["killed_at_update"] = state["updates"]
        except BaseException as exc:  # reported by the test below
            killer_error.append(exc)

    def on_returns(cfg, actors, returns):
        state["updates"] += 1
        if state["updates"] == 1:
            threading.Thread(target=kill_second_node, args=(actors,), daemon=True).start()
        if killer_error:
            cfg.max_env_steps = 1
        # stop once both lost actors were restarted (or failed to) and training went on
        if state["killed_at_update"] is not None and actors.restarts >= 2:
            state["after_kill"].add(state["updates"])
            if len(state["after_kill"]) >= 20:
                cfg.max_env_steps = 1

    created = watch_actors(monkeypatch, on_returns)
    run_dir = tmp_path / "run"
    summary = impala_rl.train(
        "cartpole",
        [
            "runner.backend=ray",
            f"runner.ray_address={cluster.address}",
            "runner.ray_num_cpus_per_actor=0.5",
            f"runner.ray_resources_per_actor.{SLOT}=1",
            # a restart that Ray places on the dying node before it is declared dead (a few
            # seconds) dies there at once and counts as another restart (backed off)
            "runner.max_actor_restarts=20",
            "algorithm.num_actors=3",
            "algorithm.epoch_length=10",
            "max_env_steps=10000000",
            "max_wall_time_s=200",
            "target_return=null",
            "log.console=false",
            "log.tensorboard=false",
        ],
        run_dir=run_dir,
    )
    assert not killer_error, killer_error
    nodes = state["nodes"]
    assert nodes is not None and None not in nodes and len(set(nodes)) == 2, nodes
    assert summary["stopped_because"] == "max_env_steps", summary
    assert len(state["after_kill"]) >= 20
    actors = created[0]
    assert 2 <= actors.restarts <= 20 and actors.lost >= 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(row.get("actor_restarts", 0) for row in rows) == actors.restarts
    assert sum(row.get("lost_rollouts", 0) for row in rows) == actors.lost
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert not ray.is_initialized()


# ---------------------------------------------------------------------------------------------
# A SIGKILLed trainer leaves no Ray process behind
# ---------------------------------------------------------------------------------------------


def _session(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[3])


def _session_pids(sid: int) -> list[int]:
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [pid for pid in pids if _session(pid) == sid]


@time_limit(180)
def test_sigkilled_trainer_leaves_no_ray_process(tmp_path):
    """Ray's dashboard and runtime-env agents outlive a killed driver; the watchdog the backend
    starts with its local Ray stops them (and itself) within seconds."""
    from test_cli import _cmd, _env

    run_dir = tmp_path / "run"
    args = [
        "train",
        "cartpole",
        "runner.backend=ray",
        "algorithm.num_actors=2",
        "target_return=null",
        "max_env_steps=100000000",
        "log.console=false",
        "log.tensorboard=false",
        "--run-dir",
        str(run_dir),
    ]
    proc = subprocess.Popen(
        _cmd(*args),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120, "an epoch")
        names = [Path(f"/proc/{p}/cmdline").read_bytes() for p in _session_pids(proc.pid)]
        assert any(n.startswith(b"ray::DashboardAgent") for n in names)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until(lambda: not _session_pids(proc.pid), 15, "the Ray processes to end")
    finally:
        if _session_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
