"""Run directories saved by an earlier version, and what their policies did then.

``tests/fixtures/earlier_runs/<name>/`` holds small runs trained and saved at commit
``bb72fd4``, the last one with two actor-critic classes (a plain env's parameters were named
``policy_torso.*``, ``value_torso.*``, ``policy_head.*``, ``value_head.*``, ``obs_norm.*``; a Dict
entry's encoder ``entries.<entry>.*``). Beside each run, ``acted.pt`` records what its best
policy did on seeded episodes: every decision's step key, action, log-probability of the mode,
entropy and value. ``tests/test_old_checkpoints.py`` loads each run with today's code and checks
that it acts identically, that ``impala eval`` runs it and that ``--resume`` carries on with
its optimizer state.

To write the fixtures again (only when the checkpoint format changes on purpose), from the
repository root, with ``tests/`` on the path for the Dict env::

    PYTHONPATH=src:tests python tests/checkpoint_fixtures.py tests/fixtures/earlier_runs
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "earlier_runs"
SEQUENTIAL = [
    "seed=1",
    "target_return=null",
    "runner.backend=sequential",
    "log.console=false",
    "log.tensorboard=false",
    "algorithm.rollout_evaluator.background=false",
]
RUNS: dict[str, tuple[str, list[str]]] = {
    # the cartpole preset: an MLP policy and an MLP critic, separate torsos
    "cartpole": ("cartpole", ["max_env_steps=2048"]),
    # the classic-control family: observation normalization, a PopArt critic, a Box action
    "pendulum": ("classic_control", ["env.id=Pendulum-v1", "max_env_steps=2048"]),
    # a Dict observation: an image (channels last), a Discrete entry, a vector, a Text entry
    "dict": (
        "cartpole",
        ["env.id=dict_envs:make_env", "model.hidden_sizes=[16]", "max_env_steps=1024"],
    ),
    # a shared torso, an LSTM core and the last action and reward
    "cartpole-lstm": (
        "cartpole",
        [
            "model.core=lstm",
            "model.shared_torso=true",
            "model.lstm_hidden_size=32",
            "model.use_last_action_reward=true",
            "max_env_steps=1024",
        ],
    ),
    # a structured env (two step keys), each key's critic on its policy's torso, a core
    "multistep": (
        "multistep_example",
        [
            "model.core=lstm",
            "model.shared_torso=true",
            "model.lstm_hidden_size=32",
            "model.use_last_action_reward=true",
            "max_env_steps=1024",
        ],
    ),
}
EPISODES = 2
MAX_DECISIONS = 60


def play(run_dir: Path) -> dict[str, torch.Tensor]:
    """Seeded episodes of ``run_dir``'s best policy through ``Policy.act``, as ``{field: [n]}``
    over its decisions: step key, action (flattened), log pi(mode), entropy and value."""
    from impala_rl import load_policy

    policy = load_policy(run_dir)
    model = policy.model
    rows: list[dict[str, torch.Tensor]] = []
    model_act = model.act

    def spy(step_key, obs, mask, first, core_state, extra):
        dist, state = model_act(step_key, obs, mask, first, core_state, extra)
        if state is None:
            value = model.value(step_key, obs, extra)
        else:  # one LSTM layer: its output for this step is h
            value = model.heads(step_key, state[0][0])[1]
        mode = dist.mode()
        rows.append(
            {
                "step_key": torch.tensor([step_key]),
                "action": mode.reshape(-1).double(),
                "log_prob": dist.log_prob(mode).double(),
                "entropy": dist.entropy().double(),
                "value": value.reshape(-1).double(),
            }
        )
        return dist, state

    model.act = spy
    structured = hasattr(policy.env_factory(), "actor_id")
    for seed in range(EPISODES):
        env = policy.env_factory()
        obs, _ = env.reset(seed=100 + seed)
        policy.reset()
        reward = 0.0
        for _ in range(MAX_DECISIONS):
            if structured:
                key, agent = env.actor_id()
                action = policy.act(obs, step_key=key, agent_id=agent, last_reward=reward)
            else:
                action = policy.act(obs, last_reward=reward)
            obs, reward, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
        env.close()
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def write(root: Path) -> None:
    """Train every run of :data:`RUNS` into ``root`` and record what its policy does."""
    import impala_rl

    for name, (preset, overrides) in RUNS.items():
        run_dir = root / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        impala_rl.train(preset, [*SEQUENTIAL, *overrides], run_dir=run_dir)
        torch.save(play(run_dir), run_dir / "acted.pt")
        print(name, "written", flush=True)


def copy_run(name: str, into: Path) -> Path:
    """A writable copy of fixture run ``name`` under ``into``."""
    target = into / name
    shutil.copytree(FIXTURES / name, target)
    return target


def expected(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / name / "acted.pt", weights_only=True)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
