"""One set of tests for both multi-actor backends (subprocess and Ray, behind one supervisor):
policy lag and stale drops, prefetch and the bounded queue, failures, restarts and learning.

What only one backend has stays in its own file (``test_subprocess_actors.py``: shared memory,
processes and signals; ``test_ray_actors.py``: Ray clusters and nodes). Every Ray test starts
(and stops) its own local Ray. Every test has a SIGALRM deadline and every wait its own timeout,
so a hung actor fails a test instead of hanging the suite.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest

import impala_rl
from actor_backends import (
    BACKENDS,
    CRASH_ENV,
    actor_pid,
    make_actors,
    pid_alive,
    stop_once_train_return_reaches,
)
from deadlines import alarm_deadline, time_limit, wait_until
from impala_rl.actors import ActorError
from impala_rl.actors.rollout_queue import Rollout, RolloutQueue
from impala_rl.config import ImpalaAlgorithmConfig

DEFAULT_TIME_LIMIT_S = 120.0
EPISODE_LENGTH = 3  # the scripted env's episodes, for ``env_kwargs={"episode_lengths": [3]}``


@pytest.fixture(autouse=True)
def _deadline(request):
    """Fail (rather than hang) a test that runs past its deadline."""
    with alarm_deadline(request, DEFAULT_TIME_LIMIT_S):
        yield


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend's name; Ray's tests are skipped without Ray and never leave it connected."""
    name = request.param
    if name != "ray":
        yield name
        return
    ray = pytest.importorskip("ray")
    try:
        yield name
    finally:
        if ray.is_initialized():
            ray.shutdown()


def assert_released(backend: str) -> None:
    """The backend gave back what it started with the actors (a local Ray: stopped)."""
    if backend == "ray":
        import ray

        assert not ray.is_initialized(), "stop() shuts down the Ray it started"


# ---------------------------------------------------------------------------------------------
# Policy lag, stale drops, prefetch and the bounded queue
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, max_policy_lag, broadcasts",
    [
        ("sequential", 0, 1),
        ("subprocess", 0, 1),  # the trainer: one broadcast per update
        ("subprocess", 1, 1),
        ("subprocess", 0, 4),  # several: a prefetched batch goes stale before its hand-out
        ("subprocess", 2, 4),
        ("ray", 0, 3),
        ("ray", 1, 1),
    ],
    indirect=["backend"],
)
def test_max_policy_lag_drops_stale_rollouts(backend, max_policy_lag, broadcasts):
    actors = make_actors(backend, max_policy_lag=max_policy_lag)
    state = actors._template.state_dict()
    dropped = 0
    with actors:
        for _ in range(8):
            out = actors.collect_outputs("cpu")
            # as the learner measures it: its update count (the actors' version) minus the
            # rollout's version, for every rollout of every batch
            lags = (actors.policy_version - out.batch["policy_version"]).tolist()
            assert 0 <= min(lags) and max(lags) <= max_policy_lag, lags
            dropped += out.dropped_stale
            time.sleep(0.3)  # a slow learner: actors fill the queue and block meanwhile
            for _ in range(broadcasts):
                actors.broadcast_updated_policy(state)
    if backend == "sequential":
        assert dropped == 0  # it acts with the newest policy: nothing is ever stale
    else:
        assert dropped > 0


@pytest.mark.parametrize("backend", ["sequential", *BACKENDS], indirect=True)
def test_dropped_rollouts_count_in_episodes_and_env_steps_alike(backend):
    """Collect 6 batches, each followed by a pause (actors fill the queue with rollouts that
    will be stale) and two broadcasts; whatever is recorded, taken or dropped, the finished
    episodes fit the env steps counted and the actors' and the batches' env steps agree."""
    actors = make_actors(
        backend,
        env_id="scripted_envs:make_env",
        env_kwargs={"episode_lengths": [EPISODE_LENGTH]},
        max_policy_lag=0,
    )
    state = actors._template.state_dict()
    env_steps = dropped = 0
    with actors:
        for _ in range(6):
            out = actors.collect_outputs("cpu")
            env_steps += out.env_steps
            dropped += out.dropped_stale
            time.sleep(0.3)
            for _ in range(2):
                actors.broadcast_updated_policy(state)
        stats = actors.get_epoch_stats_aggregator().reduce()
    cfg = actors.cfg
    columns = cfg.num_actors * cfg.envs_per_actor
    rollout_steps = cfg.n_rollout_steps * cfg.envs_per_actor
    assert env_steps == (6 * cfg.actors_batch_size + dropped) * rollout_steps
    assert stats["actor_env_steps"] == env_steps
    assert stats["episode_length/max"] == stats["episode_length/min"] == EPISODE_LENGTH
    episodes = stats["episode_return/count"]
    # every counted step of a column belongs to a finished episode but its last (< 3) steps
    assert env_steps - columns * (EPISODE_LENGTH - 1) <= episodes * EPISODE_LENGTH <= env_steps
    assert (dropped == 0) if backend == "sequential" else (dropped > 0)


@pytest.mark.parametrize(
    "backend, factor",
    [("subprocess", 0.6), ("subprocess", 1.0), ("subprocess", 1.5), ("ray", 1.0)],
    indirect=["backend"],
)
def test_queue_is_bounded_while_the_learner_sleeps(backend, factor):
    batch_size = 2
    actors = make_actors(backend, queue_out_of_sync_factor=factor, actors_batch_size=batch_size)
    # ready queue <= max_waiting; each actor may additionally hold full (blocked) rollouts,
    # and one prefetched batch may wait already copied out of the queue.
    max_waiting = math.ceil(factor * batch_size)
    with actors:
        outs = [actors.collect_outputs("cpu")]
        wait_until(
            lambda: (
                actors.queue_size() == max_waiting
                and all(actors.queue.is_blocked(a.index) for a in actors.actors)
                and len(actors._batches) == 1
            ),
            30,
            "the actors to fill the queue and block",
        )
        time.sleep(0.2)  # a Ray actor's second call may still return (and block too)
        delivered = [a.delivered for a in actors.actors]
        sizes = []
        t_end = time.monotonic() + 1.0  # the learner "sleeps" for 1 s
        while time.monotonic() < t_end:
            sizes.append(actors.queue_size())
            time.sleep(0.01)
        assert max(sizes) == min(sizes) == max_waiting
        # blocked actors do not step their envs: no rollout arrived meanwhile
        assert [a.delivered for a in actors.actors] == delivered
        outs += [actors.collect_outputs("cpu") for _ in range(6)]
        assert actors.queue_size() <= max_waiting
    # queue_size_before counts the taken batch: batch_size <= before <= max_waiting
    for out in outs:
        assert batch_size <= out.queue_size_before <= max_waiting
        assert 0 <= out.queue_size_after <= max_waiting
    # outs[1] was prefetched right after outs[0]; outs[2] was assembled from the full queue
    assert outs[2].queue_size_before == max_waiting
    assert_released(backend)


def test_while_the_learner_is_the_bound_every_actor_takes_its_turn():
    """Four actors faster than the learner: before every batch all of them wait blocked, and
    the room a batch frees goes to the oldest blocked rollouts, so each actor delivers in turn
    (in actor order the first two would take all the room, and the last two would wait)."""
    batches, batch_size = 12, 2
    actors = make_actors("subprocess", num_actors=4, actors_batch_size=batch_size)
    max_waiting = math.ceil(actors.cfg.queue_out_of_sync_factor * batch_size)
    columns = {i: 0 for i in range(4)}
    with actors:
        for _ in range(batches):
            wait_until(
                lambda: (
                    actors.queue_size() == max_waiting
                    and all(actors.queue.is_blocked(a.index) for a in actors.actors)
                ),
                60,
                "every actor to wait blocked",
            )
            out = actors.collect_outputs("cpu")
            for i in out.batch["actor_index"].tolist():
                columns[int(i)] += 1
    per_actor = actors.cfg.envs_per_actor
    fair = batches * batch_size * per_actor / 4
    assert all(n >= fair / 2 for n in columns.values()), columns
    assert_released("subprocess")


def test_the_queue_hands_the_room_to_the_oldest_blocked_rollout_whichever_its_actor():
    queue = RolloutQueue(ImpalaAlgorithmConfig(num_actors=4, actors_batch_size=2))
    assert queue.max_waiting == 2
    for actor in (3, 1, 2, 0, 3):  # 3 and 1 fill the queue; 2, 0 and 3 wait in that order
        queue.put(actor, Rollout(actor, 0, None))
    assert [r.payload for r in queue.take(2)] == [3, 1]
    queue.unblock()
    assert [r.payload for r in queue.take(2)] == [2, 0]  # in actor order: 0, then 2
    queue.unblock()
    assert [r.payload for r in queue.take(1)] == [3]
    assert not any(queue.is_blocked(i) for i in range(4))


# ---------------------------------------------------------------------------------------------
# Failures and restarts
# ---------------------------------------------------------------------------------------------


def test_env_exception_surfaces_as_actor_error(backend):
    actors = make_actors(
        backend,
        env_id=CRASH_ENV,
        env_kwargs={"crash_after": 20, "crash_instance": 1, "message": "boom-from-env"},
    )
    actors.start()
    try:
        pids = [actor_pid(actors, i) for i in range(2)]
        with pytest.raises(ActorError) as info:
            for _ in range(100):
                actors.collect_outputs("cpu")
        message = str(info.value)
        assert "boom-from-env" in message and "env 1" in message
        assert "actor " in message and 'File "' in message  # the actor and its traceback
    finally:
        t0 = time.monotonic()
        actors.stop()
        stop_time = time.monotonic() - t0
    assert stop_time < (5.0 if backend == "subprocess" else 15.0)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 15, "the actor processes to exit")
    assert_released(backend)


def test_killed_actor_is_restarted(backend):
    actors = make_actors(backend, max_actor_restarts=3)
    with actors:
        for _ in range(3):
            actors.collect_outputs("cpu")
        victim = actor_pid(actors, 0)
        os.kill(victim, signal.SIGKILL)
        # the restart happens while the learner keeps collecting
        seen_after_restart: set[int] = set()
        deadline = time.monotonic() + 60
        while not (actors.restarts == 1 and seen_after_restart == {0, 1}):
            assert time.monotonic() < deadline, "no restart, or no rollouts from both actors"
            out = actors.collect_outputs("cpu")
            if actors.restarts:
                seen_after_restart.update(out.batch["actor_index"].tolist())
        assert actors.restarts == 1
        new_pid = actor_pid(actors, 0)
        assert new_pid != victim and pid_alive(new_pid)
        assert not pid_alive(victim)
        stats = actors.get_epoch_stats_aggregator().reduce()
        assert stats["actor_restarts"] == 1
        if backend == "ray":  # its calls in flight are lost with it, and counted
            assert actors.lost >= 1 and stats["lost_rollouts"] == actors.lost
        pids = [new_pid, actor_pid(actors, 1)]
    wait_until(lambda: not any(pid_alive(p) for p in pids), 15, "the actor processes to exit")
    assert_released(backend)


def test_too_many_deaths_stop_collection(backend):
    actors = make_actors(backend, max_actor_restarts=1)
    actors.start()
    try:
        actors.collect_outputs("cpu")
        first = actor_pid(actors, 0)
        os.kill(first, signal.SIGKILL)
        # an actor whose rollouts wait for queue room is found dead late: keep consuming
        deadline = time.monotonic() + 30
        while actors.restarts < 1:
            assert time.monotonic() < deadline, "timed out waiting for the first restart"
            actors.collect_outputs("cpu")
        second = actor_pid(actors, 0)  # waits until the new actor is up
        assert second != first
        pids = [second, actor_pid(actors, 1)]
        os.kill(second, signal.SIGKILL)
        limit = r"actor 0 died .* restart limit runner\.max_actor_restarts=1"
        with pytest.raises(ActorError, match=limit):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                actors.collect_outputs("cpu")
    finally:
        actors.stop()
    wait_until(lambda: not any(pid_alive(p) for p in pids), 15, "the actor processes to exit")
    assert_released(backend)


def test_trainer_stops_with_error_and_saves_final_checkpoint(tmp_path, backend):
    run_dir = tmp_path / "run"
    with pytest.raises(ActorError, match="deliberate test crash"):
        impala_rl.train(
            "cartpole",
            [
                f"runner.backend={backend}",
                "runner.max_actor_restarts=0",
                f"env.id={CRASH_ENV}",
                "env.kwargs.crash_after=40",
                "log.console=false",
                "log.tensorboard=false",
            ],
            run_dir=run_dir,
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_because"] == "error"
    assert "ActorError" in summary["error"]
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert_released(backend)


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------

LEARNING_BUDGET = 200_000  # env steps
SOLVED_TRAIN_RETURN = 195.0
# The subprocess backend runs the preset as it is: its unclipped policy-gradient importance
# weight keeps runs at lr 2e-3 from collapsing to one action under the backend's lag (~5
# updates; clipped, 5 of 6 runs collapsed once solved, one in CI before its training mean
# reached 195; docs/experiments/cartpole.md). Ray keeps two unroll calls queued per actor, so
# with the preset's 4 actors a rollout is ~8-9 updates old (up to 21): the learning rate halved
# (at 2e-3 a few runs first dipped and stalled for up to 111k steps; at 1e-3 5 of 30 for up to
# 62k) and 2 actors of 8 envs (the same 64 env steps an update, half the lag: at 1e-3 with 4
# actors one CI run never recovered, 135 at 200k after an evaluation of 497). 12 runs each, 4
# actors reached 195 at 26k-85k env steps (median 28k, 51 s), 2 actors at 31k-60k (34k, 30 s).
# The subprocess backend: 40 runs, two at a time, at 22.1k-56.7k (median 25.0k; a 2-core
# Intel Xeon).
LEARNING_OVERRIDES = {
    "subprocess": [],
    "ray": ["algorithm.lr=1e-3", "algorithm.num_actors=2", "algorithm.envs_per_actor=8"],
}


@time_limit(400)
def test_cartpole_learns(tmp_path, monkeypatch, backend):
    """Within the budget the mean of the last 100 training episodes (the summary's
    ``train_return_recent``) reaches 195.

    The run stops as soon as it does (:func:`stop_once_train_return_reaches`): the evaluation
    target (475, deterministic policy) is usually met earlier, while the sampled training
    returns still lag, and at the end of a fixed budget they may be in a dip again, so
    ``target_return`` is off.
    """
    stop_once_train_return_reaches(monkeypatch, SOLVED_TRAIN_RETURN)
    summary = impala_rl.train(
        "cartpole",
        [
            f"runner.backend={backend}",
            *LEARNING_OVERRIDES[backend],
            "seed=0",
            f"max_env_steps={LEARNING_BUDGET}",
            "target_return=null",
            "log.console=false",
            "log.tensorboard=false",
        ],
        run_dir=tmp_path / "run",
    )
    assert summary["env_steps"] <= LEARNING_BUDGET + 2 * 8 * 32  # at most one batch over
    assert summary["train_return_recent"] >= SOLVED_TRAIN_RETURN, summary
    assert_released(backend)
