"""Presets sized to the machine (``runner.size_to_machine``): what each machine gets, that an
override wins, that 2 cores keep the preset, and that a resume keeps the sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import impala_rl
from impala_rl import sizing
from impala_rl.config import ConfigError, load_config, planned_optimizer_steps, steps_per_batch
from impala_rl.env_defaults import resolve_config
from impala_rl.policy import load_run_config
from impala_rl.sizing import Machine, size_to_machine

GPU_BOX = Machine(16, "NVIDIA H100 80GB HBM3")


def test_two_cores_keep_the_preset_as_written():
    preset = load_config("pong_appo")
    sized = size_to_machine(preset, [], Machine(2))
    assert sized.runner.sized_for == "2 cores, no GPU"
    sized.runner.sized_for = None
    assert sized == preset


def test_a_gpu_box_gets_the_measured_settings_with_no_override():
    cfg = size_to_machine(load_config("pong_appo"), [], GPU_BOX)
    a, r = cfg.algorithm, cfg.runner
    assert (a.device, a.num_actors, a.actors_batch_size, a.envs_per_actor) == ("cuda", 16, 4, 8)
    assert (r.inference, r.inference_servers, cfg.env.kwargs["vector_threads"]) == ("central", 2, 1)
    assert r.env_splits == 2  # each actor's 8 envs in two groups of 4 taking turns
    assert a.epoch_length == 25  # 100 batches of 1 unroll's columns: the same env steps
    assert a.num_minibatches == 16  # 4 times the preset's 4: its minibatch of 2 columns
    assert r.sized_for == "16 cores, NVIDIA H100 80GB HBM3"


def test_env_groups_are_sized_only_where_they_can_split_and_a_users_count_wins():
    """Two groups where the envs split evenly under central inference; an odd count, the
    user's own splits, or actor-side inference keep one group, and each sizing is valid."""
    odd = ["algorithm.envs_per_actor=5"]
    assert size_to_machine(load_config("pong_appo", odd), odd, GPU_BOX).runner.env_splits == 1
    four = ["runner.inference=central", "runner.env_splits=4"]
    assert size_to_machine(load_config("pong_appo", four), four, GPU_BOX).runner.env_splits == 4
    actor = ["runner.inference=actor"]
    sized = size_to_machine(load_config("pong_appo", actor), actor, GPU_BOX)
    assert (sized.runner.inference, sized.runner.env_splits) == ("actor", 1)
    learner = ["runner.backend=subprocess", "runner.inference=learner"]
    sized = size_to_machine(load_config("pong_appo", learner), learner, GPU_BOX).runner
    # the server in the learner's process: kept, its actors' envs in two groups, one server
    assert (sized.inference, sized.env_splits, sized.inference_servers) == ("learner", 2, 1)
    assert size_to_machine(load_config("pong_appo"), [], Machine(16)).runner.env_splits == 1


def test_the_atari_preset_is_sized_as_pong_is():
    """`impala train atari` on a GPU box puts its learner on the GPU with an actor per core,
    and an epoch stays the preset's env steps; on 2 cores it runs as written."""
    cfg = size_to_machine(load_config("atari"), [], GPU_BOX)
    a = cfg.algorithm
    assert (a.device, a.num_actors, a.actors_batch_size) == ("cuda", 16, 4)
    assert cfg.runner.inference == "central"
    written = load_config("atari").algorithm
    assert a.epoch_length * a.actors_batch_size == written.epoch_length * written.actors_batch_size
    assert size_to_machine(load_config("atari"), [], Machine(2)).algorithm == written


def test_a_many_core_machine_without_a_gpu_splits_the_cores():
    cfg = size_to_machine(load_config("pong"), [], Machine(16))
    a = cfg.algorithm
    assert (a.device, a.num_actors, a.actors_batch_size) == ("cpu", 8, 8)
    assert cfg.runner.learner_threads == 8 and cfg.runner.inference == "actor"
    assert cfg.env.kwargs["vector_threads"] == 1


def test_a_larger_batch_keeps_the_presets_minibatch_and_optimizer_steps_per_env_step():
    """A batch of k times the preset's unrolls takes k times its minibatches, so each step
    sees the preset's columns and a run takes as many steps per env step (Pong's plateau lasts
    until enough are taken); a batch that is no multiple, or the user's count, is left alone."""

    def columns_per_step(a):
        return a.actors_batch_size * a.envs_per_actor / a.num_minibatches

    sized = (("pong_appo", GPU_BOX), ("pong", Machine(16)), ("pong_appo", Machine(8)))
    for preset, machine in sized:
        written = load_config(preset)
        cfg = size_to_machine(load_config(preset), [], machine)
        a = cfg.algorithm
        assert a.actors_batch_size > written.algorithm.actors_batch_size
        assert columns_per_step(a) == columns_per_step(written.algorithm)
        assert planned_optimizer_steps(cfg) == planned_optimizer_steps(written)
    atari = size_to_machine(load_config("atari"), [], GPU_BOX).algorithm
    assert (atari.actors_batch_size, atari.num_minibatches) == (4, 1)  # half the preset's 8
    chosen = ["algorithm.num_minibatches=8"]
    mine = size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm
    assert (mine.actors_batch_size, mine.num_minibatches) == (4, 8)
    chosen = ["algorithm.actors_batch_size=2"]
    mine = size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm
    assert (mine.actors_batch_size, mine.num_minibatches) == (2, 4)  # a batch given: as written


def test_a_larger_batch_keeps_the_presets_weight_publishes_per_batch():
    """k times the preset's minibatches publish every k-th step: as many copies of the weights
    a batch as the preset's; the user's setting, or null (once a batch), stays."""
    a = size_to_machine(load_config("pong_appo"), [], GPU_BOX).algorithm
    assert (a.num_minibatches, a.broadcast_every) == (16, 4)
    assert steps_per_batch(a) // a.broadcast_every == steps_per_batch(
        load_config("pong_appo").algorithm
    )
    assert size_to_machine(load_config("pong_appo"), [], Machine(2)).algorithm.broadcast_every == 1
    for mine in ("1", "null"):
        chosen = [f"algorithm.broadcast_every={mine}"]
        a = size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm
        assert a.broadcast_every == (None if mine == "null" else 1)
    chosen = ["algorithm.max_policy_lag=30"]  # 8 minibatches: every other step
    a = size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm
    assert (a.num_minibatches, a.broadcast_every) == (8, 2)
    chosen = ["algorithm.num_minibatches=8"]  # the user's minibatches: publishes as set
    assert (
        size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm.broadcast_every
        == 1
    )


def test_a_users_policy_lag_bound_caps_the_sized_minibatches():
    """The sized minibatches keep within a user's ``max_policy_lag`` (a step n on a batch sees
    n more updates than its first) instead of refusing the bound; a bound that the preset's
    own minibatches break is still refused, naming the field."""
    for lag, minibatches in ((47, 16), (30, 8), (12, 4)):
        chosen = [f"algorithm.max_policy_lag={lag}"]
        a = size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX).algorithm
        assert a.num_minibatches == minibatches
        assert a.num_passes * a.num_minibatches - 1 <= lag
        assert a.actors_batch_size * a.envs_per_actor % a.num_minibatches == 0
    chosen = ["algorithm.max_policy_lag=5"]  # the preset's 3 x 4 steps already see 11
    with pytest.raises(ValueError, match="algorithm.max_policy_lag"):
        size_to_machine(load_config("pong_appo", chosen), chosen, GPU_BOX)


def test_the_sizing_leaves_precision_as_the_preset_or_the_user_sets_it():
    """No machine gets bf16 from the sizing (no bf16 seed reached Pong's +18 where fp32 did:
    experiments/pong.md, "bf16 and the last points"); a user's bf16 stays, CPU or GPU."""
    for machine in (Machine(2), Machine(16), GPU_BOX):
        assert size_to_machine(load_config("pong_appo"), [], machine).model.precision == "fp32"
        chosen = ["model.precision=bf16"]
        sized = size_to_machine(load_config("pong_appo", chosen), chosen, machine)
        assert sized.model.precision == "bf16"


def test_an_override_always_wins(monkeypatch):
    monkeypatch.setattr(sizing, "detect_machine", lambda: GPU_BOX)
    overrides = ["algorithm.num_actors=12", "algorithm.device=cpu", "runner.inference_servers=1"]
    cfg = resolve_config("pong_appo", overrides)
    a = cfg.algorithm
    assert (a.num_actors, a.device, a.actors_batch_size) == (12, "cpu", 12)
    assert cfg.runner.inference == "actor"  # the CPU rule: the GPU was declined
    assert cfg.runner.learner_threads == 4  # the cores the 12 actors leave
    off = resolve_config("pong_appo", ["runner.size_to_machine=false"])
    assert off.runner.sized_for is None and off.algorithm.num_actors == 1


@pytest.mark.parametrize(
    "override", ["runner.env_splits=4", "runner.inference_servers=3", "env.id=ALE/Pong-v5"]
)
def test_settings_that_need_central_inference_wait_for_the_sizing_that_makes_it(
    monkeypatch, override
):
    """On a GPU box the sizing makes inference central, so env groups or servers given alone
    are valid there (checked on the sized config); on 2 cores, which keep actor-side
    inference, the same override is refused, naming its field."""
    given = [override] if override.startswith("runner") else [override, "runner.env_splits=4"]
    field = given[-1].split("=")[0]
    monkeypatch.setattr(sizing, "detect_machine", lambda: GPU_BOX)
    cfg = resolve_config(None if override.startswith("env") else "pong_appo", given)
    assert cfg.runner.inference == "central"
    assert f"{field}={getattr(cfg.runner, field.split('.')[1])}" == given[-1]
    monkeypatch.setattr(sizing, "detect_machine", lambda: Machine(2))
    with pytest.raises(ConfigError, match=rf"{field}.*runner\.inference=actor"):
        resolve_config(None if override.startswith("env") else "pong_appo", given)
    with pytest.raises(ConfigError, match=rf"{field}.*runner\.inference=actor"):
        resolve_config("pong_appo", [*given[-1:], "runner.size_to_machine=false"])


def test_a_preset_that_does_not_ask_is_not_sized(monkeypatch):
    monkeypatch.setattr(sizing, "detect_machine", lambda: GPU_BOX)
    cfg = resolve_config("cartpole", [])
    assert cfg.runner.sized_for is None and cfg.algorithm.device == "cpu"


def test_the_sizing_is_recorded_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """Sized for 6 cores, trained an epoch, resumed on this (2-core) machine: the run keeps
    the 6-core sizes and is not sized again."""
    monkeypatch.setattr(sizing, "detect_machine", lambda: Machine(6))
    overrides = [
        "runner.size_to_machine=true",
        "runner.backend=sequential",
        "log.console=false",
        "log.tensorboard=false",
        "algorithm.n_epochs=1",
        "target_return=null",
    ]
    impala_rl.train(None, overrides, run_dir=tmp_path)
    saved = load_run_config(tmp_path)
    assert saved.runner.sized_for == "6 cores, no GPU"
    assert (saved.algorithm.num_actors, saved.algorithm.actors_batch_size) == (3, 3)
    monkeypatch.setattr(sizing, "detect_machine", lambda: pytest.fail("sized again on resume"))
    summary = impala_rl.train(overrides=["algorithm.n_epochs=2"], run_dir=tmp_path, resume=True)
    resumed = load_run_config(tmp_path)
    assert summary["epochs"] == 2 and summary["stopped_because"] == "n_epochs"
    assert (resumed.algorithm.num_actors, resumed.algorithm.actors_batch_size) == (3, 3)
    assert resumed.runner.sized_for == "6 cores, no GPU"


def test_the_cores_a_run_counts_are_those_its_affinity_allows():
    """Under ``taskset`` (or a test worker's share) a run sizes and threads itself for the
    cores it may use, not for every core of the machine."""
    code = (
        "import os; from impala_rl import sizing, startup; from impala_rl.config import "
        "load_config; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "cfg = load_config('cartpole', ['runner.backend=sequential', "
        "'runner.learner_threads=null']); "
        "print(sizing.detect_machine().cores, startup.learner_threads(cfg))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["1", "1"]
