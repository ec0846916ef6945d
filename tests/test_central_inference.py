"""Central inference (``runner.inference=central``): one server process acts for the actors;
``runner.inference=learner``: the same server as a thread of the learner's process.

The server (its process, or its thread here) and its clients (here, in the test's process)
where a test compares numbers; the subprocess backend where it checks processes, restarts,
failures and training.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deadlines import alarm_deadline, wait_until
from impala_rl.actors.base import ActorError
from impala_rl.actors.inference import (
    CentralActing,
    InferenceProcess,
    InferenceThread,
    allocate_requests,
)
from impala_rl.actors.subprocess import (
    SharedWeights,
    SubprocessDistributedActors,
    start_forkserver,
)
from impala_rl.config import (
    ConfigError,
    ImpalaAlgorithmConfig,
    ModelConfig,
    RunnerConfig,
    load_config,
)
from impala_rl.decisions import LocalActing
from impala_rl.envs import EnvFactory
from impala_rl.learner import forward_batch
from impala_rl.nn import act
from impala_rl.nn.factory import build_model_for_env
from impala_rl.rollout import ActorLoop, ActorSplits, rollout_spec_for

T = 12


@pytest.fixture(autouse=True)
def _deadline(request):
    with alarm_deadline(request, 120.0):
        yield


def _model(factory: EnvFactory, **model: object):
    env = factory()
    torch.manual_seed(7)
    built = build_model_for_env(ModelConfig(hidden_sizes=[16], **model), env)  # type: ignore[arg-type]
    env.close()
    return built


def _assert_stopped(pids: list[int]) -> None:
    """Every one of ``pids`` (actors, servers) is stopped and joined: no such process left."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


PLACES = ["process", "learner"]  # the server's process, or a thread of this one


class _Served:
    """The inference process (or, ``place="learner"``, thread) as the backend starts it, and
    one client per actor here."""

    def __init__(self, model, num_envs: int, clients: int = 1, place: str = "process"):
        spec = rollout_spec_for(model, None, T, num_envs)
        self.requests = allocate_requests(spec, clients, spec.N)
        self.weights = SharedWeights(model.state_dict())
        self.weights.publish(model.state_dict(), 0)
        start_forkserver()  # as the backend does: its processes import the actor loop once
        self.ctx = mp.get_context("forkserver")
        self.model, self.pipes = model, [self.ctx.Pipe(duplex=True) for _ in range(clients)]
        self.clients = [
            CentralActing(b, {k: v[i] for k, v in self.requests.items()}, model)
            for i, (_, b) in enumerate(self.pipes)
        ]
        self.server: InferenceProcess | InferenceThread | None = None
        self.place = place

    def __enter__(self) -> _Served:
        if self.place == "learner":
            self.server = InferenceThread(self.model, self.requests, "cpu", seed=3, version=0)
        else:
            self.server = InferenceProcess(
                self.ctx, self.model, self.requests, "cpu", self.weights, seed=3
            )
        for i, (a, _) in enumerate(self.pipes):
            self.server.add_actor(i, a)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.check()  # no error while serving
        self.server.stop()
        if self.place == "learner":
            assert not self.server._thread.is_alive()
        else:
            assert self.server.process.exitcode == 0

    def publish(self, state_dict: dict, version: int) -> None:
        """As the learner's broadcast: into the shared weights, or copied into the thread's."""
        if self.place == "learner":
            self.server.load(state_dict, version)
        else:
            self.weights.publish(state_dict, version)

    @property
    def requests_served(self) -> float:
        stats = self.server.stats
        return stats["batches"] * stats["requests_per_batch"]


CASES = {
    "mlp": ("CartPole-v1", {}),
    "lstm+last_inputs+normalize_obs": (
        "CartPole-v1",
        {
            "core": "lstm",
            "shared_torso": True,
            "lstm_hidden_size": 8,
            "use_last_action_reward": True,
            "normalize_obs": True,
        },
    ),
    "structured+lstm": (
        "impala_rl.envs.examples:ItemPlacementEnv",
        {"core": "lstm", "shared_torso": True, "lstm_hidden_size": 8},
    ),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", ["mlp", "lstm+last_inputs+normalize_obs"])
def test_server_acts_as_the_policy_in_the_actor_would(case, place):
    env_id, settings = CASES[case]
    factory = EnvFactory(env_id, {"n_rounds": 2} if ":" in env_id else {})
    model = _model(factory, **settings)
    if model.observation_normalizer(0) is not None:  # statistics that change the answer
        model.observation_normalizer(0).update(torch.randn(64, 4) * 0.3 + 0.2)
    n = 5
    obs = torch.randn(n, 4)
    first = torch.tensor([True, False, True, False, False])
    state = model.initial_state(n)
    if state is not None:
        state = (torch.randn_like(state[0]), torch.randn_like(state[1]))
    extra = None
    if model.use_last_action_reward:
        extra = model.last_inputs(0, torch.tensor([0, 1, 1, 0, 1]), torch.randn(n))
        extra = extra.masked_fill(first.unsqueeze(-1), 0.0)
    with _Served(model, n, place=place) as served:
        remote = served.clients[0].act(0, obs, None, first, state, extra)
        value = served.clients[0].value(0, obs, extra, state)
    dist, local_state = model.act(0, obs, None, first, state, extra)
    torch.testing.assert_close(remote.log_prob, dist.log_prob(remote.action))
    assert list(remote.env_action) == model.action_head(0).to_env(remote.action).tolist()
    local_value = model.value(0, obs, extra, state)
    torch.testing.assert_close(value, local_value)
    if local_state is not None:
        torch.testing.assert_close(remote.core_state[0], local_state[0])
        torch.testing.assert_close(remote.core_state[1], local_state[1])
    # the mode through the one acting function agrees too
    mode = act(model, 0, obs, None, first, state, extra, deterministic=True).action
    assert mode.shape == remote.action.shape


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("case", ["mlp", "lstm+last_inputs+normalize_obs", "structured+lstm"])
def test_centrally_acted_unrolls_are_the_policy_s_own_across_unrolls(case, place):
    """Replaying the slots (core state carried from unroll to unroll, first flags, last inputs,
    every step key) through the learner's forward with the same weights gives back the
    behaviour log-probs: the server acted with exactly this policy on exactly these inputs."""
    env_id, settings = CASES[case]
    structured = ":" in env_id
    factory = EnvFactory(env_id, {"n_rounds": 2} if structured else {}, None if structured else 9)
    model = _model(factory, **settings)
    num_envs = 3
    with _Served(model, num_envs, place=place) as served:
        loop = ActorLoop(factory, num_envs, model, 0, T, acting=served.clients[0])
        spec = rollout_spec_for(model, None, T, num_envs)
        for unroll in range(3):
            slot = spec.allocate()
            loop.unroll(slot)
            out = forward_batch(model.eval(), slot)
            torch.testing.assert_close(
                out.log_prob[:-1], slot["behaviour_log_prob"], atol=1e-5, rtol=1e-5
            )
            assert int(slot["policy_version"][0]) == 0
            if not structured and unroll:  # truncation after 9 steps: values were asked for
                assert bool(slot["truncated"].any())
                assert bool((slot["truncation_value"][slot["truncated"]] != 0).all())
        loop.close()
    assert served.requests_served >= 3 * T


@pytest.mark.parametrize("place", PLACES)
def test_an_actor_gone_mid_request_leaves_the_others_served(place):
    factory = EnvFactory("CartPole-v1")
    model = _model(factory)
    with _Served(model, 2, clients=2, place=place) as served:
        gone, kept = served.clients
        obs = torch.randn(2, 4)
        gone.buffers["obs"][:2].copy_(obs)
        gone.conn.send(("act", 0, 2))  # a request whose sender dies before the answer
        gone.conn.close()
        for _ in range(5):
            acted = kept.act(0, obs, None, None, None, None)
            assert acted.action.shape == (2,)
        kept.act(0, obs, None, None, None, None)  # the broken pipe was dropped, not fatal


@pytest.mark.parametrize("place", PLACES)
def test_weights_loaded_into_the_server_act_with_their_version(place):
    factory = EnvFactory("CartPole-v1")
    model = _model(factory)
    with _Served(model, 2, place=place) as served:
        client = served.clients[0]
        client.act(0, torch.randn(2, 4), None, None, None, None)
        newer = {k: v + 0.5 for k, v in model.state_dict().items()}
        served.publish(newer, 4)  # as the learner does after an update
        obs = torch.randn(2, 4)
        acted = client.act(0, obs, None, None, None, None)  # answered before or after loading
        client.unroll_version(99)
        acted = client.act(0, obs, None, None, None, None)
        assert client.unroll_version(99) == 4  # loaded between two batches at the latest
    model.load_state_dict(newer)
    torch.testing.assert_close(acted.log_prob, model.policy(0, obs).log_prob(acted.action))


def _subprocess_actors(
    max_actor_restarts: int = 3, servers: int = 1, splits: int = 1, place: str = "central"
) -> SubprocessDistributedActors:
    factory = EnvFactory("CartPole-v1")
    model = _model(factory, core="lstm", shared_torso=True, lstm_hidden_size=8)
    cfg = ImpalaAlgorithmConfig(
        num_actors=2, envs_per_actor=2, n_rollout_steps=8, actors_batch_size=2
    )
    runner = RunnerConfig(
        inference=place,
        inference_servers=servers,
        env_splits=splits,
        max_actor_restarts=max_actor_restarts,
    )
    return SubprocessDistributedActors(factory, model, cfg, 0, runner=runner, device="cpu")


def _kill_actor_1_and_see_both_again(actors: SubprocessDistributedActors) -> None:
    """Kill actor 1 (most likely waiting on its server: mid-request), wait for its restart,
    and collect until both actors' unrolls came in again."""
    os.kill(actors.actors[1].process.pid, signal.SIGKILL)
    wait_until(lambda: actors.restarts == 1, 15, "the restart")
    seen: set[int] = set()
    deadline = time.monotonic() + 60  # the new process imports its env first
    while seen != {0, 1} and time.monotonic() < deadline:
        seen.update(actors.collect_outputs("cpu").batch["actor_index"].tolist())
    assert seen == {0, 1}


@pytest.mark.parametrize(("servers", "splits"), [(1, 1), (2, 1), (2, 2)])
def test_subprocess_actors_with_central_inference_survive_a_killed_actor(servers, splits):
    """With two servers actor 1 is the second's: its restart reaches that server again. With
    two env groups per actor each actor has a pipe to each server, and the restart reconnects
    both."""
    actors = _subprocess_actors(servers=servers, splits=splits)
    with actors:
        for _ in range(3):
            out = actors.collect_outputs("cpu")
            actors.broadcast_updated_policy(actors._template.state_dict())
        assert int(out.batch["policy_version"].max()) >= 1  # the server's versions are stamped
        _kill_actor_1_and_see_both_again(actors)
        assert len(actors.servers) == servers
        for server in actors.servers:
            server.check()  # the restarted actor's new pipe was served
        pids = [a.process.pid for a in actors.actors] + [s.process.pid for s in actors.servers]
    assert all(s.stats and s.stats["batches"] > 0 for s in actors.servers)  # each one served
    _assert_stopped(pids)  # the actors and the servers' processes are stopped and joined


@pytest.mark.parametrize("servers", [1, 2])
def test_a_killed_inference_process_ends_the_run_with_an_error_not_a_hang(servers):
    actors = _subprocess_actors(servers=servers)
    which = " 2 of 2" if servers == 2 else ""
    with actors:
        actors.collect_outputs("cpu")
        actors.broadcast_updated_policy(actors._template.state_dict())
        server_pid = actors.servers[-1].process.pid
        os.kill(server_pid, signal.SIGKILL)
        with pytest.raises(ActorError, match=f"inference process{which} exited with code -9"):
            for _ in range(50):  # a batch or two may have been prefetched before the kill
                actors.collect_outputs("cpu")
        pids = [a.process.pid for a in actors.actors if a.process is not None]
    _assert_stopped([*pids, server_pid])


@pytest.mark.parametrize("splits", [1, 2])
def test_inference_in_the_learner_serves_a_restarted_actor_and_stops_with_the_actors(splits):
    """``runner.inference=learner``: the broadcasts reach the thread's weights (their versions
    are stamped), a restarted actor's new pipes are served, and the thread ends with the
    actors, the actors' processes joined."""
    actors = _subprocess_actors(splits=splits, place="learner")
    with actors:
        [server] = actors.servers
        assert isinstance(server, InferenceThread)
        for _ in range(3):
            out = actors.collect_outputs("cpu")
            actors.broadcast_updated_policy(actors._template.state_dict())
        assert server.server.version >= 3
        assert int(out.batch["policy_version"].max()) >= 1
        _kill_actor_1_and_see_both_again(actors)
        server.check()
        pids = [a.process.pid for a in actors.actors]
    assert not server._thread.is_alive()
    assert server.stats is not None and server.stats["batches"] > 0
    _assert_stopped(pids)


def test_a_failing_inference_thread_ends_the_run_with_its_error_not_a_hang(monkeypatch):
    actors = _subprocess_actors(place="learner")
    with actors:
        actors.collect_outputs("cpu")
        [server] = actors.servers

        def broken(*args):
            raise RuntimeError("a broken forward")

        monkeypatch.setattr(server.server, "_serve_group", broken)
        with pytest.raises(ActorError, match=r"inference thread failed:(.|\n)*a broken forward"):
            for _ in range(50):  # a batch or two may have been prefetched
                actors.collect_outputs("cpu")
        pids = [a.process.pid for a in actors.actors if a.process is not None]
    _assert_stopped(pids)


def test_inference_in_the_learner_is_one_server_of_subprocess_actors():
    learner = ["runner.backend=subprocess", "runner.inference=learner"]
    with pytest.raises(ConfigError, match=r"runner\.inference.*runner\.backend=sequential"):
        load_config("cartpole", ["runner.inference=learner"])  # the preset is sequential
    with pytest.raises(ConfigError, match=r"runner\.inference_servers.*inference=learner"):
        load_config("cartpole", [*learner, "algorithm.num_actors=2", "runner.inference_servers=2"])
    cfg = load_config("cartpole", [*learner, "runner.env_splits=2"])
    assert (cfg.runner.inference, cfg.runner.env_splits) == ("learner", 2)


@pytest.mark.parametrize("servers", [1, 2, "in the learner"])
def test_the_server_reports_its_figures_when_it_stops(caplog, servers):
    """Each server's closing log line says how busy it was; benchmarks/gpu_box.py reads and
    sums them (the learner's thread's too)."""
    place = "learner" if servers == "in the learner" else "central"
    servers = 1 if place == "learner" else servers
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from gpu_box import server_figures
    finally:
        sys.path.pop(0)
    actors = _subprocess_actors(servers=servers, place=place)
    with caplog.at_level(logging.INFO, logger="impala_rl.actors.inference"):
        with actors:
            for _ in range(2):
                actors.collect_outputs("cpu")
                actors.broadcast_updated_policy(actors._template.state_dict())
    figures = server_figures(caplog.text)
    assert figures is not None, caplog.text
    assert figures["servers"] == servers
    # two batches of two actors' unrolls of 8 steps; with two servers, one actor each
    assert figures["batches"] >= 2 * 8 * servers
    assert 1.0 <= figures["requests_per_batch"] <= 2.0 / servers
    assert 0 <= figures["busy_percent"] <= 100


class _GatedActing(LocalActing):
    """Group 0's acting waits, at its first decision, until group 1 has decided twice."""

    def __init__(self, model, group: int, other_stepped: threading.Event, seed: int):
        super().__init__(model, torch.Generator().manual_seed(seed))
        self.group, self.other_stepped, self.calls = group, other_stepped, 0

    def act(self, *args):
        self.calls += 1
        if self.group == 0 and self.calls == 1:
            assert self.other_stepped.wait(60), "group 0 waited while no other group stepped"
        if self.group == 1 and self.calls == 2:
            self.other_stepped.set()
        return super().act(*args)


def test_env_splits_fill_each_groups_columns_as_that_group_alone_would():
    """Two groups of 2 envs, each a loop of its own seeds, fill columns 0-1 and 2-3 of a
    4-column slot exactly as each loop alone fills a 2-column slot, over several unrolls
    (episodes carried across them), with their episodes and env steps summed."""
    factory = EnvFactory("CartPole-v1", max_episode_steps=9)
    model = _model(factory, core="lstm", shared_torso=True, lstm_hidden_size=8)
    split = ActorSplits([ActorLoop(factory, 2, model, 5 + 2 * g, T) for g in range(2)])
    alone = [ActorLoop(factory, 2, model, 5 + 2 * g, T) for g in range(2)]
    for _ in range(3):
        slot = rollout_spec_for(model, None, T, 4).allocate()
        result = split.unroll(slot)
        own = [rollout_spec_for(model, None, T, 2).allocate() for _ in range(2)]
        results = [loop.unroll(o) for loop, o in zip(alone, own, strict=True)]
        for name, field in slot.items():
            joined = torch.cat([o[name] for o in own], dim=0 if field.ndim == 1 else 1)
            torch.testing.assert_close(field, joined, rtol=0, atol=0, msg=name)
        assert result.env_steps == 4 * T
        assert sorted(result.episode_returns) == sorted(
            r for res in results for r in res.episode_returns
        )
        assert result.episode_returns  # episodes of 9 steps ended in every unroll of 12
    split.close()
    for loop in alone:
        loop.close()


def test_a_group_steps_while_another_waits_for_its_answer():
    """The point of the groups: group 0's first decision is answered only after group 1 has
    decided twice (env steps of its own in between). Groups that took turns on one thread
    would wait here until the deadline and fail."""
    factory = EnvFactory("CartPole-v1")
    model = _model(factory)
    stepped = threading.Event()
    loops = [
        ActorLoop(factory, 2, model, g, T, acting=_GatedActing(model, g, stepped, g))
        for g in range(2)
    ]
    split = ActorSplits(loops)
    start = time.monotonic()
    split.unroll(rollout_spec_for(model, None, T, 4).allocate())
    assert stepped.is_set() and time.monotonic() - start < 60
    split.close()


def test_central_inference_with_env_splits_acts_every_column_with_the_policy():
    """One actor, two env groups, two servers: each group's requests go to its own server
    (both serve although there is one actor), and every column of every batch was acted by
    the published policy (the replayed log-probs match the behaviour ones)."""
    factory = EnvFactory("CartPole-v1")
    model = _model(factory)
    cfg = ImpalaAlgorithmConfig(
        num_actors=1, envs_per_actor=4, n_rollout_steps=8, actors_batch_size=1
    )
    runner = RunnerConfig(inference="central", inference_servers=2, env_splits=2)
    actors = SubprocessDistributedActors(factory, model, cfg, 0, runner=runner, device="cpu")
    with actors:
        for _ in range(3):
            batch = actors.collect_outputs("cpu").batch
            assert batch["behaviour_log_prob"].shape == (8, 4)
            out = forward_batch(model.eval(), batch)
            torch.testing.assert_close(
                out.log_prob[:-1], batch["behaviour_log_prob"], atol=1e-5, rtol=1e-5
            )
            assert bool((batch["behaviour_log_prob"] < 0).all())  # no column left unwritten
    assert all(s.stats and s.stats["batches"] > 0 for s in actors.servers)


def test_an_env_failing_in_a_second_group_ends_the_run_with_its_error():
    """Group 1's envs step on a worker thread: their exception reaches the actor's report (no
    hang), names the env's error, and every process is stopped."""
    factory = EnvFactory(
        "fault_envs:make_crashing_env", {"crash_after": 5, "crash_instance": 2}
    )  # instance 2 in an actor process: group 1's first env (group 0 builds 0 and 1)
    model = _model(EnvFactory("CartPole-v1"))
    cfg = ImpalaAlgorithmConfig(
        num_actors=1, envs_per_actor=4, n_rollout_steps=8, actors_batch_size=1
    )
    runner = RunnerConfig(inference="central", env_splits=2, max_actor_restarts=0)
    actors = SubprocessDistributedActors(factory, model, cfg, 0, runner=runner, device="cpu")
    with actors:
        with pytest.raises(ActorError, match="deliberate test crash"):
            for _ in range(20):
                actors.collect_outputs("cpu")
        pids = [a.process.pid for a in actors.actors if a.process is not None]
        pids += [s.process.pid for s in actors.servers]
    _assert_stopped(pids)


def test_env_splits_need_central_inference_and_divide_the_envs():
    central = ["runner.backend=subprocess", "runner.inference=central"]
    with pytest.raises(ConfigError, match=r"runner\.env_splits.*runner\.inference=actor"):
        load_config("cartpole", ["runner.backend=subprocess", "runner.env_splits=2"])
    with pytest.raises(ConfigError, match=r"runner\.env_splits.*envs_per_actor=4"):
        load_config("cartpole", [*central, "runner.env_splits=3"])
    with pytest.raises(ConfigError, match=r"runner\.env_splits"):
        load_config("cartpole", [*central, "runner.env_splits=0"])
    with pytest.raises(ConfigError, match=r"runner\.inference_servers.*at most 4"):
        load_config(
            "cartpole",
            [
                *central,
                "algorithm.num_actors=2",
                "runner.env_splits=2",
                "runner.inference_servers=5",
            ],
        )
    cfg = load_config(
        "cartpole",
        [*central, "algorithm.num_actors=1", "runner.env_splits=2", "runner.inference_servers=2"],
    )
    assert (cfg.runner.env_splits, cfg.runner.inference_servers) == (2, 2)


def test_central_inference_needs_the_subprocess_backend():
    with pytest.raises(ConfigError, match=r"runner\.inference"):
        load_config("cartpole", ["runner.inference=central"])  # the preset is sequential
    with pytest.raises(ConfigError, match=r"runner\.inference"):
        load_config("cartpole", ["runner.inference=gpu"])
    cfg = load_config("cartpole", ["runner.backend=subprocess", "runner.inference=central"])
    assert cfg.runner.inference == "central"


def test_several_inference_servers_need_central_inference_and_an_actor_each():
    central = ["runner.backend=subprocess", "runner.inference=central"]
    with pytest.raises(ConfigError, match=r"runner\.inference_servers.*runner\.inference=actor"):
        load_config("cartpole", ["runner.backend=subprocess", "runner.inference_servers=2"])
    with pytest.raises(ConfigError, match=r"runner\.inference_servers.*num_actors=2"):
        load_config("cartpole", [*central, "algorithm.num_actors=2", "runner.inference_servers=3"])
    with pytest.raises(ConfigError, match=r"runner\.inference_servers"):
        load_config("cartpole", [*central, "runner.inference_servers=0"])
    cfg = load_config(
        "cartpole", [*central, "algorithm.num_actors=2", "runner.inference_servers=2"]
    )
    assert cfg.runner.inference_servers == 2


def test_inference_servers_are_checked_against_each_learners_actors():
    """Issue 41.6: every learner runs ``inference_servers`` servers for its own share of the
    actors, so with two learners of 2 actors each, 4 servers leave 2 of each learner's idle."""
    central = ["runner.backend=subprocess", "runner.inference=central"]
    two = [*central, "algorithm.num_learners=2", "algorithm.num_actors=4"]
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [*two, "runner.inference_servers=4"])
    msg = str(info.value)
    assert "'runner.inference_servers'" in msg and "valid: at most 2" in msg
    assert "algorithm.num_learners=2" in msg
    assert (
        load_config("cartpole", [*two, "runner.inference_servers=2"]).runner.inference_servers == 2
    )


def _train_central(tmp_path, *overrides: str) -> dict:
    """A short CartPole run with central inference on the subprocess backend."""
    from impala_rl.trainer import Trainer

    settings = ["runner.backend=subprocess", "runner.inference=central", *overrides]
    settings += ["max_env_steps=6000", "target_return=null", f"log.run_dir={tmp_path / 'run'}"]
    cfg = load_config("cartpole", [*settings, "log.console=false", "log.tensorboard=false"])
    return Trainer(cfg).train()


@pytest.mark.parametrize("servers", [1, 2, "2 with env splits", "in the learner"])
def test_cartpole_trains_with_central_inference(tmp_path, servers):
    two = ["algorithm.num_actors=2", "runner.inference_servers=2"] if servers != 1 else []
    if servers == "2 with env splits":
        two.append("runner.env_splits=2")
    if servers == "in the learner":
        two = ["runner.inference=learner", "runner.env_splits=2"]
    assert _train_central(tmp_path, *two)["env_steps"] >= 6000
    assert threading.active_count() < 10  # the dispatcher thread is gone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_central_inference_acts_on_the_gpu(tmp_path):
    """LSTM + last inputs on a GPU learner: the server's weights and requests live on cuda."""
    lstm = ["model.core=lstm", "model.shared_torso=true", "model.use_last_action_reward=true"]
    assert _train_central(tmp_path, "algorithm.device=cuda", *lstm)["env_steps"] >= 6000
