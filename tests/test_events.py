"""Monitoring: every event is recorded with correct values, reduced per epoch and written.

A short real run (sequential backend, cartpole preset) is checked through ``metrics.jsonl``
and TensorBoard's own reader; a scripted backend pins queue sizes, policy lag and dropped
rollouts to known values; the learner's gradient norms are checked against
``torch.nn.utils.clip_grad_norm_``; the reducers and grouping are unit-tested.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from impala_rl import cli
from impala_rl import learner as learner_module
from impala_rl import trainer as trainer_mod
from impala_rl import writers as writers_mod
from impala_rl.actors import SequentialDistributedActors
from impala_rl.config import ConfigError, LogConfig, load_config
from impala_rl.envs import make_env_factory
from impala_rl.events import (
    REDUCERS,
    ActorEvents,
    ImpalaEvents,
    RunEvents,
    epoch_stats,
    event_specs,
)
from impala_rl.learner import Learner, scheduled_entropy_coef, scheduled_lr
from impala_rl.nn.factory import build_model
from impala_rl.stats import EpochStatsAggregator, EventRecorder, stat_name
from impala_rl.trainer import Trainer

N_EPOCHS, EPOCH_LENGTH = 2, 3
# Batches of 2 actors x 8 envs x 32 steps: large enough that episodes end in every epoch.
LAYOUT = [
    "algorithm.num_actors=2",
    "algorithm.actors_batch_size=2",
    "algorithm.envs_per_actor=8",
    "algorithm.n_rollout_steps=32",
]
STEPS_PER_UPDATE = 2 * 8 * 32
SHORT = [
    *LAYOUT,
    f"algorithm.n_epochs={N_EPOCHS}",
    f"algorithm.epoch_length={EPOCH_LENGTH}",
    "algorithm.rollout_evaluator.n_episodes=3",
    "log.console=false",
    "runner.backend=sequential",
]
# A decaying learning rate, so "the schedule's value" is not a constant.
LINEAR_LR = [
    "algorithm.lr_schedule=linear",
    "algorithm.lr_decay_env_steps=4000",
    "algorithm.lr_final=1e-4",
]
# A decaying entropy weight, for the same reason.
LINEAR_ENTROPY = [
    "algorithm.entropy_schedule=linear",
    "algorithm.entropy_decay_env_steps=8000",
    "algorithm.entropy_coef_final=0.001",
]
ROW_EXTRAS = {"epoch", "env_steps", "wall_time_s"}  # written by the trainer, not events
TIME_EVENTS = (
    "time_collecting_actors",
    "time_dequeuing_actors",
    "time_learner_rollout",
    "time_loss_computation",
    "time_backprob",
)
# Events a short sequential run cannot produce, and why.
CANNOT_OCCUR = {
    "actor_restarts": "only the subprocess and ray backends restart dead actors",
    "lost_rollouts": "only the ray backend loses rollouts with dead actors",
    "eval_win_rate": "only games that report info['win'] (structured envs) have a win rate",
}


def _read_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _expected_names(group: object = 0) -> dict[str, set[str]]:
    """Per event, the statistic names its declaration promises (groups keyed ``group``)."""
    names: dict[str, set[str]] = {}
    for interface in (ImpalaEvents, ActorEvents, RunEvents):
        for name, spec in event_specs(interface).items():
            g = group if spec.group_by else None
            names[name] = {stat_name(name, out.name, g) for out in spec.outputs}
    return names


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short real run with TensorBoard, linear learning-rate and entropy schedules, an
    entropy floor and a PopArt critic."""
    run_dir = tmp_path_factory.mktemp("events") / "run"
    # a floor no decision is under: its event is written, the run's losses unchanged
    floor = ["algorithm.entropy_floor=0.0"]
    popart = ["model.popart=true"]  # its statistics' events are written
    cfg = load_config("cartpole", [*SHORT, *LINEAR_LR, *LINEAR_ENTROPY, *floor, *popart])
    trainer = Trainer(cfg, run_dir=run_dir)
    summary = trainer.train()
    return types.SimpleNamespace(
        cfg=cfg, dir=run_dir, summary=summary, rows=_read_rows(run_dir), trainer=trainer
    )


# -- what a run writes ----------------------------------------------------------------------------


def test_metrics_jsonl_has_one_json_line_per_epoch(run):
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == N_EPOCHS == run.summary["epochs"]
    assert [json.loads(line)["epoch"] for line in lines] == list(range(1, N_EPOCHS + 1))


def test_every_declared_event_is_written_with_its_names(run):
    expected = _expected_names()
    assert set(CANNOT_OCCUR) <= set(expected)
    for row in run.rows:
        missing = {
            event: sorted(names - row.keys())
            for event, names in expected.items()
            if event not in CANNOT_OCCUR and not names <= row.keys()
        }
        assert missing == {}, f"epoch {row['epoch']}"
        allowed = set().union(*expected.values()) | ROW_EXTRAS
        assert sorted(row.keys() - allowed) == []
        for event in CANNOT_OCCUR:
            assert not expected[event] & row.keys()


def test_time_breakdown_is_a_share_of_the_update(run):
    for row in run.rows:
        percents = [row[f"{event}/percent"] for event in TIME_EVENTS]
        assert all(0.0 <= p <= 100.0 for p in percents), percents
        assert sum(percents) <= 100.0 + 1e-6, percents
        seconds = {event: row[f"{event}/time"] for event in TIME_EVENTS}
        assert all(s >= 0.0 for s in seconds.values())
        # dequeuing happens inside collecting; the other phases are disjoint parts of an update
        assert seconds["time_dequeuing_actors"] <= seconds["time_collecting_actors"]
        disjoint = sum(v for k, v in seconds.items() if k != "time_dequeuing_actors")
        assert disjoint <= row["time_update"] * (1 + 1e-9)
        assert 0.0 < row["time_update"] * EPOCH_LENGTH <= row["time_epoch"]


def test_counters_match_the_summary(run):
    rows, summary = run.rows, run.summary
    for row in rows:
        assert (
            row["env_steps"]
            == row["total_env_steps"]
            == row["epoch"] * (EPOCH_LENGTH * STEPS_PER_UPDATE)
        )
        assert row["total_updates"] == row["epoch"] * EPOCH_LENGTH
        assert row["actor_env_steps"] == EPOCH_LENGTH * STEPS_PER_UPDATE
    assert rows[-1]["total_env_steps"] == summary["env_steps"]
    assert rows[-1]["total_updates"] == summary["updates"]
    assert sum(row["episode_return/count"] for row in rows) == summary["episodes"]
    assert rows[-1]["total_episodes"] == summary["episodes"]
    assert summary["episodes"] > 0


@pytest.mark.parametrize(
    "stat, schedule, initial, final",
    [
        ("learning_rate", scheduled_lr, "lr", "lr_final"),
        ("entropy_coef", scheduled_entropy_coef, "entropy_coef", "entropy_coef_final"),
    ],
)
def test_scheduled_values_are_the_schedules_for_the_last_update(
    run, stat, schedule, initial, final
):
    alg = run.cfg.algorithm
    for row in run.rows:
        steps_before_last_update = row["total_env_steps"] - STEPS_PER_UPDATE
        expected = schedule(alg, steps_before_last_update, run.cfg.max_env_steps)
        assert row[stat] == pytest.approx(expected, rel=1e-12)
        assert getattr(alg, final) < row[stat] < getattr(alg, initial)
    assert getattr(run.trainer.learner, stat) == pytest.approx(
        schedule(alg, run.summary["env_steps"], run.cfg.max_env_steps)
    )


def test_entropy_schedule_by_hand(run):
    """Linear from 0.01 to 0.001 over 8000 env steps (the run ends before the horizon)."""
    steps = run.summary["env_steps"]
    assert steps < 8000
    assert run.trainer.learner.entropy_coef == pytest.approx(0.01 + (0.001 - 0.01) * steps / 8000)


def test_episode_and_learner_values_are_consistent(run):
    for row in run.rows:
        # CartPole pays 1 per step: returns are lengths
        for reducer in ("mean", "std", "min", "max"):
            assert row[f"episode_return/{reducer}"] == pytest.approx(
                row[f"episode_length/{reducer}"]
            )
        assert row["eval_return/mean"] == pytest.approx(row["eval_length"])
        for event in ("episode_return", "eval_return"):
            assert row[f"{event}/min"] <= row[f"{event}/mean"] <= row[f"{event}/max"]
            assert row[f"{event}/std"] >= 0
        # the sequential backend acts with the learner's weights: no lag, rho = 1
        assert row["policy_lag/min"] == row["policy_lag/mean"] == row["policy_lag/max"] == 0
        assert row["vtrace_mean_rho/0"] == pytest.approx(1.0, abs=1e-4)
        assert 0.0 <= row["vtrace_clipped_fraction/0"] <= 1.0
        assert row["dropped_stale_rollouts"] == 0
        assert row["estimated_queue_sizes/before"] == row["estimated_queue_sizes/after"] == 0
        assert row["grad_norm"] > 0 and row["policy_grad_norm/0"] > 0
        assert row["critic_grad_norm/0"] > 0
        assert 0.0 < row["policy_entropy/0"] <= math.log(2) + 1e-6
        assert row["steps_per_second"] > 0


def test_aggregator_lookups_answer_the_last_epoch(run):
    last = run.rows[-1]
    agg = run.trainer.aggregator
    assert agg.get_stats_value(ImpalaEvents.policy_loss, "epoch", group=0) == pytest.approx(
        last["policy_loss/0"]
    )
    assert agg.get_stats_value(ImpalaEvents.critic_value_loss, group=0) == pytest.approx(
        last["critic_value_loss/0"]
    )
    assert agg.get_stats_value(ImpalaEvents.policy_lag, "epoch", "max") == last["policy_lag/max"]
    assert agg.get_stats_value(ImpalaEvents.time_backprob, "epoch", "percent") == pytest.approx(
        last["time_backprob/percent"]
    )
    assert agg.get_stats_value("grad_norm") == pytest.approx(last["grad_norm"])
    assert agg.get_stats_value(ImpalaEvents.policy_loss, group=7) is None
    with pytest.raises(ValueError, match="stats level"):
        agg.get_stats_value(ImpalaEvents.policy_loss, "update", group=0)


def test_tensorboard_reader_loads_one_value_per_epoch(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tb"))
    tags = acc.Reload().Tags()["scalars"]
    steps = [row["env_steps"] for row in run.rows]
    for tag, key in (
        ("train/policy_loss/0", "policy_loss/0"),
        ("train/episode_return/mean", "episode_return/mean"),
        ("eval/return/mean", "eval_return/mean"),
        ("train/time_backprob/percent", "time_backprob/percent"),
    ):
        assert tag in tags
        events = acc.Scalars(tag)
        assert [e.step for e in events] == steps, tag
        assert [e.value for e in events] == pytest.approx([row[key] for row in run.rows], rel=1e-5)


# -- a scripted backend ---------------------------------------------------------------------------

# (queue_size_before, queue_size_after, dropped_stale) per collect_outputs call
SCRIPT = [(5, 3, 0), (7, 1, 1), (2, 0, 0), (9, 6, 0), (1, 1, 2), (4, 2, 0)]


class ScriptedActors(SequentialDistributedActors):
    """The sequential backend, reporting scripted queue sizes, drops and policy versions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lags: list[list[int]] = []
        self.calls = 0

    def collect_outputs(self, learner_device):
        out = super().collect_outputs(learner_device)
        before, after, dropped = SCRIPT[self.calls % len(SCRIPT)]
        self.calls += 1
        n = out.batch["policy_version"].shape[0]
        lags = [min(self.policy_version, column % 3) for column in range(n)]
        self.lags.append(lags)
        versions = self.policy_version - torch.tensor(lags, dtype=torch.int64)
        return dataclasses.replace(
            out,
            batch={**out.batch, "policy_version": versions},
            queue_size_before=before,
            queue_size_after=after,
            dropped_stale=dropped,
        )


def test_scripted_queue_sizes_lag_and_drops_are_reduced_per_epoch(tmp_path, monkeypatch):
    made: list[ScriptedActors] = []

    def make_scripted(cfg, env_factory, model, seed=None, device="cpu"):
        made.append(ScriptedActors(env_factory, model, cfg.algorithm, cfg.seed))
        return made[-1]

    monkeypatch.setattr(trainer_mod, "make_actors", make_scripted)
    cfg = load_config("cartpole", [*SHORT, "log.tensorboard=false"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.train()
    rows = _read_rows(tmp_path / "run")
    (actors,) = made
    assert actors.calls == N_EPOCHS * EPOCH_LENGTH
    for i, row in enumerate(rows):
        script = SCRIPT[i * EPOCH_LENGTH : (i + 1) * EPOCH_LENGTH]
        assert row["estimated_queue_sizes/before"] == pytest.approx(
            sum(s[0] for s in script) / EPOCH_LENGTH
        )
        assert row["estimated_queue_sizes/after"] == pytest.approx(
            sum(s[1] for s in script) / EPOCH_LENGTH
        )
        assert row["dropped_stale_rollouts"] == sum(s[2] for s in script)
        epoch_updates = actors.lags[i * EPOCH_LENGTH : (i + 1) * EPOCH_LENGTH]
        lags = [lag for update in epoch_updates for lag in update]
        assert row["policy_lag/min"] == min(lags)
        assert row["policy_lag/max"] == max(lags)
        assert row["policy_lag/mean"] == pytest.approx(sum(lags) / len(lags))
    assert rows[-1]["policy_lag/max"] == 2 and rows[0]["policy_lag/min"] == 0
    # the lookups on the last epoch
    last = rows[-1]
    assert trainer.aggregator.get_stats_value(
        ImpalaEvents.estimated_queue_sizes, "epoch", "before"
    ) == pytest.approx(last["estimated_queue_sizes/before"])
    assert trainer.aggregator.get_stats_value(
        ImpalaEvents.policy_lag, "epoch", "mean"
    ) == pytest.approx(last["policy_lag/mean"])
    assert actors.get_stats_value(ActorEvents.episode_return, "epoch", "mean") == pytest.approx(
        last["episode_return/mean"]
    )
    assert (
        actors.get_stats_value(ActorEvents.episode_return, "epoch", "count")
        == last["episode_return/count"]
    )
    assert actors.get_stats_value(ActorEvents.actor_env_steps) == last["actor_env_steps"]


# -- gradient norms at the learner ----------------------------------------------------------------


@pytest.mark.parametrize("shared_torso", [False, True])
def test_grad_norms_are_the_pre_clip_norms(monkeypatch, shared_torso):
    max_norm = 0.05  # small: clipping changes the gradients
    cfg = load_config(
        "cartpole",
        [f"algorithm.max_grad_norm={max_norm}", f"model.shared_torso={str(shared_torso).lower()}"],
    )
    env_factory = make_env_factory(cfg.env)
    probe = env_factory()
    model = build_model(cfg.model, probe.observation_space, probe.action_space)
    probe.close()
    learner = Learner(model, cfg.algorithm)
    actors = SequentialDistributedActors(env_factory, model, cfg.algorithm, cfg.seed)
    with actors:
        batch = actors.collect_outputs("cpu").batch

    def norm(params) -> float:
        grads = [p.grad for p in params if p.grad is not None]
        return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))

    seen: dict[str, float] = {}
    original = learner_module.clip_gradients

    def recording_clip(params, max_norm_arg, total_norm):
        seen["policy"] = norm(model.policy_parameters())
        seen["critic"] = norm(model.critic_parameters())
        seen["all"] = norm(model.parameters())
        seen["max_norm"] = max_norm_arg
        original(params, max_norm_arg, total_norm)
        seen["after"] = norm(model.parameters())

    monkeypatch.setattr(learner_module, "clip_gradients", recording_clip)
    stats = learner.update(batch)
    assert seen["max_norm"] == max_norm
    assert stats.grad_norm == pytest.approx(seen["all"], rel=1e-5)
    assert stats.grad_norm > max_norm  # the pre-clip norm is reported...
    assert seen["after"] == pytest.approx(max_norm, rel=1e-3)  # ...grads were clipped
    assert stats.policy_grad_norm[0] == pytest.approx(seen["policy"], rel=1e-5)
    assert stats.critic_grad_norm[0] == pytest.approx(seen["critic"], rel=1e-5)
    if not shared_torso:  # disjoint groups: their squares add up to the total
        assert math.hypot(stats.policy_grad_norm[0], stats.critic_grad_norm[0]) == pytest.approx(
            stats.grad_norm, rel=1e-5
        )


def test_gradient_norms_and_clipping_equal_torchs_bit_for_bit():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 70, 5, 64)]
    for p in params[:3]:  # the last has no gradient
        p.grad = torch.randn_like(p) * 10
    grads = [p.grad.clone() for p in params[:3]]
    total, groups = learner_module.gradient_norms(params, {"g": {0: [0, 2], 1: [3]}})
    assert torch.equal(total, torch.nn.utils.get_total_norm(grads))
    assert torch.equal(groups["g"][0], torch.nn.utils.get_total_norm([grads[0], grads[2]]))
    assert float(groups["g"][1]) == 0.0  # a group with no gradient
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params[:3]]
    for p, g in zip(theirs, grads, strict=True):
        p.grad = g.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    learner_module.clip_gradients(params, 1.0, total)
    assert torch.equal(total, torch_total)
    for ours, reference in zip(params[:3], theirs, strict=True):
        assert torch.equal(ours.grad, reference.grad)
    assert float(torch.nn.utils.get_total_norm([p.grad for p in params[:3]])) < 1.0 + 1e-5


# -- reducers and grouping ------------------------------------------------------------------------


class _Probe:
    @epoch_stats(*REDUCERS)
    def every(self, value):
        """All reducers on one field."""

    @epoch_stats("mean", "max", group_by="critic_key")
    def per_critic(self, critic_key, value):
        """Two reducers, grouped."""


def test_every_reducer():
    recorder = EventRecorder()
    probe = recorder.interface(_Probe)
    for v in (1.0, 2.0, 3.0, 4.0):
        probe.every(v)
    stats = EpochStatsAggregator(recorder).reduce()
    assert stats == pytest.approx(
        {
            "every/mean": 2.5,
            "every/sum": 10.0,
            "every/min": 1.0,
            "every/max": 4.0,
            "every/std": math.sqrt(1.25),  # population std
            "every/count": 4.0,
            "every/last": 4.0,
        }
    )


def test_values_recorded_at_once_reduce_as_the_same_values_one_by_one():
    """``record_each`` (a minibatch's policy lag, one value per decision) is the same epoch
    figures as recording each value; a grouped or many-field event is refused."""
    lags = [3, 0, 7, 7, 1]
    one_by_one, at_once = EventRecorder(), EventRecorder()
    ev = one_by_one.interface(ImpalaEvents)
    for lag in lags:
        ev.policy_lag(lag)
    at_once.interface(ImpalaEvents).policy_lag(2)
    at_once.record_each(ImpalaEvents.policy_lag, lags[:2])
    at_once.record_each(ImpalaEvents.policy_lag, iter(lags[2:]))
    ev.policy_lag(2)
    assert EpochStatsAggregator(at_once).reduce() == EpochStatsAggregator(one_by_one).reduce()
    with pytest.raises(ValueError, match="policy_loss: record_each takes"):
        EventRecorder().record_each(ImpalaEvents.policy_loss, [1.0])
    with pytest.raises(ValueError, match="estimated_queue_sizes: record_each takes"):
        EventRecorder().record_each(ImpalaEvents.estimated_queue_sizes, [1.0])


def test_grouping_by_step_key_and_critic_key_with_two_keys():
    learner_rec, actor_rec = EventRecorder(), EventRecorder()
    ev = learner_rec.interface(ImpalaEvents)
    probe = learner_rec.interface(_Probe)
    actor_ev = actor_rec.interface(ActorEvents)
    for step_key, values in ((0, (1.0, 3.0)), ("arm", (10.0, 20.0, 30.0))):
        for v in values:
            ev.policy_loss(step_key=step_key, value=v)
            ev.policy_entropy(step_key, v / 10)  # positional: group, then value
    for critic_key, values in (("a", (2.0, 4.0)), ("b", (-1.0,))):
        for v in values:
            ev.critic_value_loss(critic_key, v)
            probe.per_critic(critic_key=critic_key, value=v)
    ev.estimated_queue_sizes(4, 2)
    ev.estimated_queue_sizes(before=6, after=0)
    actor_ev.episode_return(5.0)
    actor_ev.episode_return(7.0)
    agg = EpochStatsAggregator(learner_rec, actor_rec)
    stats = agg.reduce()
    assert stats["policy_loss/0"] == 2.0 and stats["policy_loss/arm"] == 20.0
    assert stats["policy_entropy/0"] == pytest.approx(0.2)
    assert stats["policy_entropy/arm"] == pytest.approx(2.0)
    assert stats["critic_value_loss/a"] == 3.0 and stats["critic_value_loss/b"] == -1.0
    assert stats["per_critic/mean/a"] == 3.0 and stats["per_critic/max/a"] == 4.0
    assert stats["per_critic/mean/b"] == stats["per_critic/max/b"] == -1.0
    assert stats["estimated_queue_sizes/before"] == 5.0
    assert stats["estimated_queue_sizes/after"] == 1.0
    assert stats["episode_return/count"] == 2.0 and stats["episode_return/mean"] == 6.0
    assert agg.get_stats_value(ImpalaEvents.policy_loss, "epoch", group="arm") == 20.0
    assert agg.get_stats_value(ImpalaEvents.critic_value_loss, "epoch", group="b") == -1.0
    assert agg.get_stats_value(_Probe.per_critic, "epoch", "max", group="a") == 4.0
    assert agg.get_stats_value(ActorEvents.episode_return, "epoch", "std") == 1.0
    # a reduce drains: the next epoch starts empty
    assert agg.reduce() == {}
    assert agg.get_stats_value(ImpalaEvents.policy_loss, group=0) is None


def test_declarations_refuse_unknown_reducers_and_events():
    with pytest.raises(ValueError, match="unknown reducer 'median'"):
        epoch_stats("median")
    with pytest.raises(AttributeError, match="no event named"):
        EventRecorder().interface(ImpalaEvents).no_such_event(1.0)


# -- console --------------------------------------------------------------------------------------


def test_console_prints_an_epoch_table(tmp_path, monkeypatch):
    from rich.console import Console

    buffer = io.StringIO()
    monkeypatch.setattr(
        writers_mod, "Console", lambda **_: Console(file=buffer, width=200, force_terminal=True)
    )
    cfg = load_config(
        "cartpole",
        [
            *LAYOUT,
            "algorithm.n_epochs=1",
            "algorithm.epoch_length=1",
            "algorithm.rollout_evaluator.n_episodes=2",
            "log.console=true",
            "log.tensorboard=false",
        ],
    )
    Trainer(cfg, run_dir=tmp_path / "run").train()
    text = buffer.getvalue()
    assert "epoch 1" in text
    header = next(line for line in text.splitlines() if "pg loss" in line)
    for label in ("return", "eval", "length", "steps/s", "pg loss", "|grad|", "lag", "lr"):
        assert label in header, label


def test_console_without_a_terminal_prints_one_untruncated_line_per_epoch(tmp_path, monkeypatch):
    from rich.console import Console

    buffer = io.StringIO()  # a file, as with nohup or `> train.log`: not a terminal
    monkeypatch.setattr(writers_mod, "Console", lambda **_: Console(file=buffer, width=80))
    cfg = load_config(
        "cartpole",
        [
            *LAYOUT,
            "algorithm.n_epochs=2",
            "algorithm.epoch_length=1",
            "algorithm.rollout_evaluator.n_episodes=2",
            "runner.backend=sequential",
            "log.console=true",
            "log.tensorboard=false",
        ],
    )
    run_dir = tmp_path / "run"
    Trainer(cfg, run_dir=run_dir).train()
    lines = buffer.getvalue().splitlines()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(len(line) > 80 for line in lines)  # not cut to the width
    assert "━" not in buffer.getvalue() and "…" not in buffer.getvalue()
    for line, row in zip(lines, rows, strict=True):
        pairs = dict(part.split("=", 1) for part in line.split(" "))
        assert int(pairs["epoch"]) == row["epoch"] and int(pairs["env_steps"]) == row["env_steps"]
        for name in ("episode_return/mean", "eval_return/mean", "policy_loss/0", "grad_norm"):
            assert float(pairs[name]) == pytest.approx(row[name], rel=1e-5), name


@pytest.mark.parametrize("terminal", [False, True])
def test_console_stats_patterns_choose_what_the_console_prints(tmp_path, monkeypatch, terminal):
    from rich.console import Console

    buffer = io.StringIO()
    monkeypatch.setattr(
        writers_mod, "Console", lambda **_: Console(file=buffer, width=300, force_terminal=terminal)
    )
    patterns = "[episode_return/mean,policy_entropy/*]"
    cfg = load_config(
        "cartpole",
        [
            *LAYOUT,
            "algorithm.n_epochs=1",
            "algorithm.epoch_length=1",
            "algorithm.rollout_evaluator.n_episodes=2",
            "runner.backend=sequential",
            "log.console=true",
            "log.tensorboard=false",
            f"log.console_stats={patterns}",
        ],
    )
    run_dir = tmp_path / "run"
    Trainer(cfg, run_dir=run_dir).train()
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert "grad_norm" in row and "eval_return/mean" in row  # the files keep every statistic
    text = re.sub(r"\x1b\[[0-9;]*m", "", buffer.getvalue())  # no colour codes
    if terminal:
        header = next(line for line in text.splitlines() if "policy_entropy/0" in line)
        assert header.replace("┃", " ").split() == ["episode_return/mean", "policy_entropy/0"]
    else:
        pairs = dict(part.split("=", 1) for part in text.strip().split(" "))
        assert set(pairs) == {"epoch", "env_steps", "episode_return/mean", "policy_entropy/0"}
        assert float(pairs["policy_entropy/0"]) == pytest.approx(row["policy_entropy/0"])


@pytest.mark.parametrize("terminal", [False, True])
def test_console_prints_a_late_evaluation_as_one_short_line(terminal):
    """The trainer writes an epoch again when its evaluation finishes after the row (a
    background evaluation at the end of a run): the console adds one line, not the row again."""
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=300, force_terminal=terminal)
    writer = writers_mod.ConsoleWriter(console=console)
    row = {"episode_return/mean": 21.5, "policy_loss/0": 0.25, "grad_norm": 3.0}
    writer.on_epoch(3, 1920, row)
    writer.on_epoch(3, 1920, {**row, "eval_return/mean": 182.6, "eval_return/std": 34.25})
    writer.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines()]
    if terminal:
        assert text.count("epoch 3 ·") == 1  # one table
        assert "epoch=3 eval_return/mean=182.6" in lines  # the table's eval column
    else:
        assert lines == [
            "epoch=3 env_steps=1920 episode_return/mean=21.5 policy_loss/0=0.25 grad_norm=3.0",
            "epoch=3 eval_return/mean=182.6 eval_return/std=34.25",
        ]


def test_console_stats_refuses_an_empty_pattern():
    with pytest.raises(ConfigError, match="log.console_stats"):
        load_config("cartpole", ['log.console_stats=[episode_return/mean,""]'])


# -- Weights & Biases -----------------------------------------------------------------------------


def test_log_config_wandb_defaults():
    log = LogConfig()
    assert log.wandb is False and log.wandb_project == "impala-rl"


def test_wandb_without_the_package_is_a_clear_error_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config("cartpole", [*SHORT, "log.wandb=true"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        Trainer(cfg, run_dir=tmp_path / "run").train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()
    code = cli.main(["train", "cartpole", *SHORT, "log.wandb=true", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("impala: error:") and "pip install wandb" in err
    assert len(err.splitlines()) == 1


def test_wandb_writer_logs_tagged_stats_against_env_steps(tmp_path, monkeypatch):
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class FakeRun:
        def log(self, row, step=None):
            calls["log"].append((row, step))

        def finish(self):
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    writer = writers_mod.WandbWriter("proj", tmp_path / "run1", {"seed": 3})
    writer.on_epoch(2, 1024, {"policy_loss/0": 0.5, "eval_return/mean": 9.0})
    writer.close()
    (init_kwargs,) = calls["init"]
    assert init_kwargs["project"] == "proj" and init_kwargs["config"] == {"seed": 3}
    assert init_kwargs["name"] == "run1"
    ((row, step),) = calls["log"]
    assert step == 1024
    assert row == {"train/policy_loss/0": 0.5, "eval/return/mean": 9.0, "train/epoch": 2}
    assert calls["finish"] == [True]
