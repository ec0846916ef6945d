"""An env (and a torso) defined in an interactive session: a notebook's cells, ``python -c``.

Such a main module has no file, so a process the run starts (spawn/forkserver: the evaluation,
subprocess actors, further learners) cannot import what it defines; the env factory and the
model travel with it by value, and a further learner gets the session's callables the config
names. A finished run's config still names ``__main__:Corridor``: another process says
where it lives.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import impala_rl
from impala_rl.envs import factory as factory_module
from impala_rl.envs.factory import (
    EnvFactory,
    carry_session_callables,
    session_callable,
    session_callables,
)
from impala_rl.envs.spaces import EnvError

DEADLINE_S = 600  # a busy 2-core machine; each run takes seconds when quiet

SESSION = """
import gymnasium as gym, numpy as np, torch, impala_rl
from torch import nn

class Corridor(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.x = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.x += 1 if action == 1 else -1
        obs = np.array([self.x / 5, 0], np.float32)
        return obs, float(self.x >= 5), abs(self.x) >= 5, False, {}

class Torso(nn.Module):
    def __init__(self, observation_space, width=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh())
        self.out_features = width

    def forward(self, obs):
        return self.net(obs.float())

summary = impala_rl.train(env=Corridor, overrides=OVERRIDES, run_dir=RUN_DIR)
policy = impala_rl.load_policy(RUN_DIR)
obs, _ = Corridor().reset(seed=0)
print("RESULT", summary["stopped_because"], summary["best_eval_return"], policy.act(obs))
"""


def _session(run_dir: str, overrides: list[str]) -> subprocess.CompletedProcess:
    code = f"OVERRIDES = {overrides!r}\nRUN_DIR = {run_dir!r}\n{SESSION}"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S
    )


@pytest.mark.parametrize(
    "overrides",
    [
        # the env's own defaults: sequential actors, the evaluation in a process of its own
        ["max_env_steps=2048", "log.console=false"],
        # actors in processes, a torso of the session too
        [
            "max_env_steps=2048",
            "log.console=false",
            "runner.backend=subprocess",
            "model.encoder=__main__:Torso",
            "model.normalize_obs=false",
        ],
        # a second learner builds the run again from the config: it gets the session's
        # env and torso from the leader
        [
            "max_env_steps=4096",
            "log.console=false",
            "algorithm.num_learners=2",
            "runner.backend=subprocess",
            "model.encoder=__main__:Torso",
            "model.normalize_obs=false",
        ],
    ],
    ids=["defaults", "subprocess-actors-and-torso", "two-learners"],
)
def test_a_session_env_trains_in_the_runs_processes(tmp_path, overrides):
    done = _session(str(tmp_path / "run"), overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    result = done.stdout.split("RESULT", 1)[1].split()
    assert result[0] == "max_env_steps"
    assert float(result[1]) >= 0.0  # evaluated in the evaluation process: a return exists


def test_another_process_says_where_a_session_env_lives(tmp_path):
    run_dir = str(tmp_path / "run")
    assert _session(run_dir, ["max_env_steps=512", "log.console=false"]).returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "impala_rl.cli", "eval", run_dir, "--episodes", "1"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode != 0
    assert "env.id '__main__:Corridor'" in done.stderr
    assert "interactive session" in done.stderr
    assert "'package.module:Corridor'" in done.stderr


class _Line(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, True, False, {}


@pytest.fixture
def session_main(monkeypatch):
    """A main module with no file (a notebook's), holding ``Line``."""
    main = types.ModuleType("__main__")
    main.Line = _Line
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def test_session_callables_travel_to_a_process_that_reads_the_config(session_main):
    config = {"env": {"id": "__main__:Line"}, "model": {"encoder": "mlp"}, "tags": ["x"]}
    pickled = session_callables(config)
    assert pickled is not None
    assert session_callables({"env": {"id": "CartPole-v1"}}) is None
    with pytest.MonkeyPatch.context() as mp:  # a further learner's main: no Line
        mp.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
        mp.setattr(factory_module, "_CARRIED_SESSION", {})
        with pytest.raises(EnvError, match="main module has no 'Line'"):
            EnvFactory("__main__:Line")()
        carry_session_callables(pickled)
        env = EnvFactory("__main__:Line")()
        assert env.observation_space.shape == (1,)
        env.close()


def test_the_factory_carries_a_session_env_by_value(session_main):
    factory = EnvFactory("__main__:Line")
    assert session_callable("__main__:Line") is _Line
    data = pickle.dumps(factory)
    del session_main.Line  # the other process: its main module has no Line
    copy = pickle.loads(data)
    assert copy().observation_space.shape == (1,)
    with pytest.raises(EnvError, match="interactive session"):
        EnvFactory("__main__:Line")()


def test_a_scripts_env_is_pickled_by_name(monkeypatch):
    script = types.ModuleType("__main__")
    script.__file__ = __file__  # run from a file: spawned processes import it
    script.Line = _Line
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert session_callable("__main__:Line") is None
    assert pickle.loads(pickle.dumps(EnvFactory("__main__:Line")))._carried is None


def test_train_names_what_env_cannot_be():
    with pytest.raises(ValueError, match="is an env, not what builds one.*env='CartPole-v1'"):
        impala_rl.train(env=gym.make("CartPole-v1"))
    with pytest.raises(ValueError, match="a lambda or a function defined inside another"):
        impala_rl.train(env=lambda: _Line())
    assert impala_rl._env_id(_Line) == f"{__name__}:_Line"
    assert impala_rl._env_id("CartPole-v1") == "CartPole-v1"


def test_the_docs_notebook_cells_run_as_a_session(tmp_path):
    """docs/environments.md's notebook block, as cells (``python -c``), on a small budget."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "environments.md").read_text()
    block = page.split("<!-- docs: not run: a notebook's cells -->", 1)[1]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    assert "max_env_steps=20000" in code and '"runs/corridor"' in code
    code = code.replace("max_env_steps=20000", "max_env_steps=1024")
    code = code.replace('"runs/corridor"', repr(str(tmp_path / "corridor")))
    code += "\nprint('ACTS', policy.act(Corridor().reset(seed=0)[0]))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ACTS" in done.stdout
