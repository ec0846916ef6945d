"""benchmarks/actor_shares.py counts every column the learner trains on under its actor."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from actor_shares import run  # noqa: E402

from impala_rl.learner import Learner  # noqa: E402


def test_each_actors_columns_add_up_to_what_the_learner_trained_on(tmp_path):
    update = Learner.update
    # sequential: 2 actors x 2 envs, a batch of both actors' rollouts, 4 batches
    overrides = ["runner.backend=sequential", "algorithm.num_actors=2",
                 "algorithm.envs_per_actor=2", "algorithm.actors_batch_size=2",
                 "algorithm.n_rollout_steps=8", "algorithm.epoch_length=2",
                 "max_env_steps=128"]  # fmt: skip
    r = run("cartpole", 0, overrides, tmp_path / "run")
    assert r["columns"] == [8, 8]  # 4 batches x 2 columns of each actor
    assert r["lag_max"] == 0 and r["best_return"] > 0
    assert Learner.update is update  # the count is taken off again
