"""A check shared by the backends' tests: rollouts dropped as stale count as collected."""

from __future__ import annotations

import time

EPISODE_LENGTH = 3  # the scripted env's episodes, for ``env_kwargs={"episode_lengths": [3]}``


def check_dropped_rollouts_count_alike(actors, pause_s: float) -> int:
    """Collect 6 batches, each followed by a pause (actors fill the queue with rollouts that
    will be stale) and two broadcasts; whatever is recorded, taken or dropped, the finished
    episodes fit the env steps counted and the actors' and the batches' env steps agree.
    Returns the number of dropped rollouts."""
    state = actors._template.state_dict()
    env_steps = dropped = 0
    with actors:
        for _ in range(6):
            out = actors.collect_outputs("cpu")
            env_steps += out.env_steps
            dropped += out.dropped_stale
            time.sleep(pause_s)
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
    return dropped
