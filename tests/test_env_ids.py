"""``env.id`` as users type it: third-party Gymnasium ids registered on demand, Gymnasium's
``module:EnvId`` form next to ``module:callable``, and unknown ids that name what to install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from impala_rl.envs import factory as env_factory
from impala_rl.envs.factory import EnvError, EnvFactory

FAKE_ID = "ImpalaTestIds-v0"


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package ``impala_fake_envs`` that registers ``FAKE_ID`` when imported (as minigrid
    registers its ids), on ``sys.path`` for this test; the id and module are removed after."""
    package = tmp_path / "impala_fake_envs"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import gymnasium as gym

            NOT_CALLABLE = 3
            gym.register(id={FAKE_ID!r}, entry_point="gymnasium.envs.classic_control:CartPoleEnv")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "impala_fake_envs"
    sys.modules.pop("impala_fake_envs", None)
    gym.registry.pop(FAKE_ID, None)


def test_module_env_id_form_imports_the_module_and_makes_the_id(fake_package):
    env = EnvFactory(f"{fake_package}:{FAKE_ID}", max_episode_steps=7)()
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4,)
    assert env.spec is not None and env.spec.id == FAKE_ID
    env.close()


def test_bare_id_of_a_known_family_is_registered_on_demand(fake_package, monkeypatch):
    monkeypatch.setitem(env_factory.ID_FAMILIES, "ImpalaTestIds-", (fake_package, "fake-pkg"))
    assert FAKE_ID not in gym.registry
    env = EnvFactory(FAKE_ID)()
    assert env.observation_space.shape == (4,)
    env.close()


def test_unknown_id_of_a_known_family_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(
        env_factory.ID_FAMILIES, "ImpalaNoPkg-", ("impala_no_such_pkg", "impala-no-such-pkg")
    )
    with pytest.raises(EnvError, match=r"pip install impala-no-such-pkg"):
        EnvFactory("ImpalaNoPkg-Maze-v0")()


def test_unknown_id_says_how_to_name_a_package():
    with pytest.raises(EnvError, match=r"doesn't exist.*package:ImpalaNothing-v0"):
        EnvFactory("ImpalaNothing-v0")()


def test_module_colon_attribute_that_is_neither_callable_nor_id_is_refused(fake_package):
    with pytest.raises(EnvError, match=r"NOT_CALLABLE.*neither a callable nor a Gymnasium id"):
        EnvFactory(f"{fake_package}:NOT_CALLABLE")()
    with pytest.raises(EnvError, match=r"cannot import module 'impala_no_such_module'"):
        EnvFactory("impala_no_such_module:Thing-v0")()


class _SizedEnv(gym.Env):
    def __init__(self, size: int):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (size,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, np.float32), {}


def _raising_env(size: int) -> gym.Env:
    raise TypeError("the env's own TypeError")


def test_a_factory_whose_arguments_do_not_fit_env_kwargs_says_where_they_come_from():
    """A required argument left out or a misspelt one: the factory's TypeError, and that its
    arguments are given as env.kwargs; a TypeError of the factory's own work keeps its text."""
    module = f"{__name__}:_SizedEnv"
    hint = r"; its arguments are given as env.kwargs.NAME=VALUE \(given: {}\)$"
    with pytest.raises(EnvError, match=r"missing 1 required .* 'size'" + hint.format("none")):
        EnvFactory(module)()
    with pytest.raises(EnvError, match=r"'sise'" + hint.format("env.kwargs.sise")):
        EnvFactory(module, {"sise": 3})()
    assert EnvFactory(module, {"size": 3})().observation_space.shape == (3,)
    with pytest.raises(EnvError, match=r"raised TypeError: the env's own TypeError$"):
        EnvFactory(f"{__name__}:_raising_env", {"size": 3})()


def test_minigrid_ids_build_as_typed():
    """In a fresh interpreter (nothing imported minigrid yet) both forms a user types build
    the env, whose Dict observation reaches the model with its mission as words."""
    pytest.importorskip("minigrid")
    code = textwrap.dedent(
        """
        from impala_rl.envs.factory import EnvFactory
        for env_id in ("MiniGrid-DoorKey-5x5-v0", "minigrid:MiniGrid-DoorKey-5x5-v0"):
            print(sorted(EnvFactory(env_id)().observation_space.spaces))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(env_factory.__file__).parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['direction', 'image', 'mission']"] * 2, result.stdout


def test_an_id_whose_env_needs_a_missing_module_names_it_before_training(tmp_path):
    """A registered id whose entry point imports a module that is not installed (Gymnasium's
    phys2d ids without jax) is the CLI's one-line error naming the module, not a traceback."""
    missing_id = "ImpalaTestMissingModule-v0"
    gym.register(id=missing_id, entry_point="impala_no_such_module.envs:Env")
    try:
        with pytest.raises(EnvError, match=r"impala_no_such_module.*pip install impala_no_such"):
            EnvFactory(missing_id)()
    finally:
        gym.registry.pop(missing_id, None)
    if _importable("jax"):
        return  # phys2d's ids make with jax installed: the CLI half has nothing to show
    result = subprocess.run(
        [sys.executable, "-m", "impala_rl.cli", "train", "env.id=phys2d/CartPole-v1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "env.id 'phys2d/CartPole-v1'" in result.stderr and "jax" in result.stderr


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_an_id_without_a_family_is_found_in_the_installed_providers(
    fake_package, tmp_path, monkeypatch, caplog
):
    """``env.id=highway-fast-v0`` as highway-env's docs type it (after ``import highway_env``):
    the installed packages of :data:`ID_PROVIDERS` are imported in turn until one registers
    the id; one that fails to import is passed over."""
    broken = tmp_path / "impala_broken_provider.py"
    broken.write_text("raise RuntimeError('cannot import here')\n")
    monkeypatch.setattr(
        env_factory,
        "ID_PROVIDERS",
        ("impala_no_such_provider", "impala_broken_provider", fake_package),
    )
    assert FAKE_ID not in gym.registry
    with caplog.at_level("INFO", logger="impala_rl.envs.factory"):
        env = EnvFactory(FAKE_ID)()
    assert env.observation_space.shape == (4,)
    env.close()
    assert f"env.id={FAKE_ID}: registered by importing {fake_package}" in caplog.text
    sys.modules.pop("impala_broken_provider", None)


@pytest.mark.parametrize("env_id", ["highway-fast-v0", "FlappyBird-v0"])
def test_ids_of_installed_packages_run_as_their_docs_type_them(env_id):
    module = {"highway-fast-v0": "highway_env", "FlappyBird-v0": "flappy_bird_gymnasium"}[env_id]
    pytest.importorskip(module)
    code = f"from impala_rl.envs import EnvFactory; print(EnvFactory({env_id!r})().spec.id)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split()[-1] == env_id


class _StepOf(gym.Env):
    """A one-observation env whose reset and step return what ``result`` says (the old Gym
    API's observation alone and four values, a reward in an array, an observation of another
    shape) to see what the factory's probe says."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, result: str = "ok"):
        self.result = result

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.result == "old_reset":
            return np.zeros(2, np.float32)
        info = None if self.result == "reset_info" else {}
        return np.zeros(3 if self.result == "shape" else 2, np.float32), info

    def step(self, action):
        obs = np.zeros(2, np.float32)
        if self.result == "old_api":
            return obs, 1.0, False, {}
        reward = {"array": np.array([1.0]), "int": 1, "float32": np.float32(1.0)}.get(
            self.result, 1.0
        )
        return obs, reward, False, False, None if self.result == "step_info" else {}


class _NoSpaces(gym.Env):
    """Forgot its observation space; its action space is not a Gymnasium one."""

    action_space = (0, 1)

    def reset(self, *, seed=None, options=None):
        return np.zeros(2, np.float32), {}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, r"_NoSpaces.observation_space is none; valid: a gymnasium.spaces.Space"),
        (
            {"observation_space": gym.spaces.Box(-1, 1, (2,))},
            r"_NoSpaces.action_space is builtins.tuple; valid: a gymnasium.spaces.Space",
        ),
    ],
)
def test_an_env_without_its_spaces_is_named(kwargs, error):
    env = _NoSpaces()
    for name, value in kwargs.items():
        setattr(env, name, value)
    with pytest.raises(EnvError, match=error):
        EnvFactory("test_env_ids:_make_no_spaces", {"env": env})()


def _make_no_spaces(env: gym.Env) -> gym.Env:
    return env


class _ResetOfOldGym(_StepOf):
    """``def reset(self)``: no seed, no options."""

    def reset(self):
        return np.zeros(2, np.float32), {}


@pytest.mark.parametrize(
    ("result", "error"),
    [
        ("old_api", r"step returned 4 values; valid: Gymnasium's \(obs, reward, terminated"),
        ("array", r"step's reward is ndarray of shape \(1,\).*valid: a number"),
        ("old_reset", r"reset returned ndarray; valid: Gymnasium's \(obs, info\)"),
        ("shape", r"reset returned an observation of shape \(3,\); its observation_space is"),
        ("reset_info", r"reset's info is NoneType; valid: a dict.*return \(obs, \{\}\)"),
        ("step_info", r"step's info is NoneType; valid: a dict.*truncated, \{\}\)"),
        ("int", None),
        ("float32", None),
    ],
)
def test_a_step_off_gymnasiums_api_is_named_before_training(result, error):
    from impala_rl.config import EnvConfig
    from impala_rl.envs import make_env_factory

    cfg = EnvConfig(id="test_env_ids:_StepOf", kwargs={"result": result})
    if error is None:
        make_env_factory(cfg)
    else:
        with pytest.raises(EnvError, match=error):
            make_env_factory(cfg)


def test_a_reset_without_seed_is_named_before_the_first_reset():
    """The defaults' step timing resets with a seed first: the factory says it, not a
    TypeError from there."""
    from impala_rl.env_defaults import resolve_config

    with pytest.raises(EnvError, match=r"_ResetOfOldGym.reset takes no seed or options; valid"):
        resolve_config(None, ["env.id=test_env_ids:_ResetOfOldGym"])


@pytest.fixture
def package_missing_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An installed package (under a ``site-packages`` folder) whose env reads a pattern file
    of its own on reset that the release lacks, as minigrid 3.2.0's WFC ids do."""
    site = tmp_path / "site-packages"
    package = site / "impala_fake_files"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path

            import gymnasium as gym
            import numpy as np


            class PatternEnv(gym.Env):
                observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
                action_space = gym.spaces.Discrete(2)

                def __init__(self, pattern=None):
                    self.pattern = pattern
                    if pattern is not None:  # a file the user names
                        Path(pattern).read_bytes()

                def reset(self, *, seed=None, options=None):
                    super().reset(seed=seed)
                    (Path(__file__).parent / "patterns" / "maze.png").read_bytes()
                    return np.zeros(2, np.float32), {}


            gym.register(id="ImpalaFakeFiles-v0", entry_point=PatternEnv)
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    yield "impala_fake_files"
    sys.modules.pop("impala_fake_files", None)
    gym.registry.pop("ImpalaFakeFiles-v0", None)


def test_an_env_whose_package_lacks_its_own_file_is_named_before_training(package_missing_a_file):
    """The first reset (the defaults' probe, or the factory's own) reads the missing file: a
    one-line error naming the id, the package and the file, not the env's traceback."""
    from impala_rl.env_defaults import resolve_config

    id_ = f"env.id={package_missing_a_file}:PatternEnv"
    missing = r"the installed package impala_fake_files lacks its own file .*patterns.maze\.png"
    with pytest.raises(EnvError, match=rf"could not reset: {missing}.*reinstall impala_fake"):
        resolve_config(None, [id_])  # the factory's reset, looking for an action mask
    with pytest.raises(EnvError, match=rf"could not be probed: {missing}"):
        resolve_config(None, [id_, "env.info_action_mask=false"])  # the step timing's reset


def test_a_file_named_in_env_kwargs_that_is_missing_is_named(package_missing_a_file, tmp_path):
    absent = tmp_path / "absent.png"
    with pytest.raises(EnvError, match=r"FileNotFoundError: .*absent\.png \(a path in env.kwargs"):
        EnvFactory(
            f"{package_missing_a_file}:ImpalaFakeFiles-v0", kwargs={"pattern": str(absent)}
        )()


@pytest.mark.parametrize(
    ("env_id", "module"),
    [("tictactoe_v3", "pettingzoo.classic.tictactoe_v3"), ("foo_v1", None)],
)
def test_a_pettingzoo_game_typed_by_its_name_alone_names_the_module(env_id, module):
    """PettingZoo's games are modules; ``tictactoe_v3`` alone is answered with the module to
    type, a name PettingZoo lacks with how to name a package."""
    pytest.importorskip("pettingzoo")
    expected = f"Did you mean {module}?" if module else "write env.id=package:foo_v1"
    with pytest.raises(EnvError, match=re.escape(expected)):
        EnvFactory(env_id)()
