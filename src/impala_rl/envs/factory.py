"""Build environments from an ``env`` config section.

``env.id`` is one of:

- a Gymnasium id. Ids of the families in :data:`ID_FAMILIES` (``MiniGrid-...``) are
  registered on demand by importing their package; ``MinAtar/...`` ids are registered on
  demand, with channels-first ``uint8`` frames, see :mod:`impala_rl.envs.minatar`; ``ALE/...``
  ids and the legacy ones ale-py registers (``PongNoFrameskip-v4``) are registered on demand
  and get the ``atari`` preset's preprocessing, see
  :func:`impala_rl.envs.atari.make_ale_id_env`. An id nobody registers names the package to
  install where its family is known.
- ``package.module:callable``: a callable that returns a ``gymnasium.Env``;
- ``package:EnvId``, Gymnasium's own form: when the attribute is not a callable, the module
  is imported (which registers its ids) and the id is made.

Every env is
wrapped so the model sees one ``Box`` observation: image-like ``uint8`` boxes pass through
unchanged (they stay ``uint8`` up to the network), everything else (Tuple, Discrete,
MultiDiscrete, MultiBinary, multi-dimensional Box) is flattened to a float32 vector. A Dict
observation keeps its structure, an entry each (:func:`~impala_rl.envs.spaces.dict_model_space`;
a ``Text`` entry becomes its words; an entry that is neither numbers nor text is left out, with
one line that says so).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from impala_rl.child_processes import (
    leave_stopping_to_parent,
    preload_forkserver,
    stopped_by_parent,
)
from impala_rl.envs.atari import is_ale_id, is_registered_game
from impala_rl.envs.images import (
    ConvertedImages,
    ConvertedKeyImages,
    ImageReading,
    converted_images,
)
from impala_rl.envs.spaces import (
    EnvError,
    ModelObservation,
    check_action_space,
    is_composite,
    keeps_structure,
    log_dropped_entries,
    mask_width,
    model_observation_space,
)
from impala_rl.envs.structured import (
    KeyObservation,
    MaskedActionsEnv,
    OutsideActionMask,
    SingleKeyVectorEnv,
    StructuredVectorEnv,
    has_action_mask,
    is_structured,
    outside_mask_source,
)
from impala_rl.envs.vector import NativeVectorEnv, SameStepVectorEnv
from impala_rl.group_signals import hangup_blocked

__all__ = [
    "EnvError",
    "EnvFactory",
    "ModelObservation",
    "make_env_factory",
    "make_vector_env",
    "model_observation_space",
]


ID_FAMILIES: dict[str, tuple[str, str]] = {
    "MiniGrid-": ("minigrid", "'impala-rl[minigrid]'"),
    "BabyAI-": ("minigrid", "'impala-rl[minigrid]'"),
    "MiniWorld-": ("miniworld", "miniworld"),
}
"""Gymnasium id prefixes of packages that register their ids when imported: prefix ->
(module to import, what to ``pip install``)."""
PETTINGZOO_PREFIX = "pettingzoo."
"""``env.id=pettingzoo.classic.connect_four_v3``: a PettingZoo env module, played through
:func:`impala_rl.envs.pettingzoo.make_aec_env` (``env.kwargs`` are its other arguments)."""
ID_PROVIDERS = (
    "highway_env",
    "flappy_bird_gymnasium",
    "gymnasium_robotics",
    "panda_gym",
    "miniworld",
)
"""Packages whose ids (``highway-fast-v0``, ``FlappyBird-v0``, ``FetchReach-v4``...) have no
common prefix: an id that nothing has registered is looked for in those of them that are
installed, each imported in turn, as the user would ``import highway_env`` before
``gymnasium.make``."""


def _import_target(spec: str) -> Callable[..., gym.Env] | str:
    """The callable ``module:callable`` names, or the Gymnasium id of ``module:EnvId`` (the
    attribute is not a callable and importing the module registered the id)."""
    carried = carried_callable(spec)
    if carried is not None:
        return carried
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvError(f"env.id {spec!r}: expected 'package.module:callable' or 'package:EnvId'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(
            f"env.id {spec!r}: cannot import module {module_name!r} ({exc})"
            f"{where_a_module_lies(exc, module_name)}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            break
    if callable(target):
        return target
    if attr in gym.registry:
        return attr
    if module_name == "__main__":
        raise EnvError(
            f"env.id {spec!r}: this process's main module has no {attr!r}; a callable of an "
            "interactive session's main module (a notebook, python -c) exists in that session "
            "alone: evaluate or resume the run there, or define it in a module and name it "
            f"'package.module:{attr}'"
        )
    raise EnvError(
        f"env.id {spec!r}: {attr!r} is neither a callable nor a Gymnasium id of module "
        f"{module_name!r}; valid: 'package.module:callable' (returning a gymnasium.Env) or "
        "'package:EnvId' (an id the package registers when imported)"
    )


_CARRIED_SESSION: dict[str, Any] = {}
"""A further learner's process: the leader's session callables, by the spec that names them
(:func:`carry_session_callables`)."""


def session_callable(spec: str) -> Callable[..., gym.Env] | None:
    """The callable ``spec`` names when it belongs to an interactive session's main module
    (a notebook, ``python -c``: a ``__main__`` with no file), or was carried from one
    (:func:`carry_session_callables`), else ``None``. A process started with ``spawn`` or
    ``forkserver`` (actors, the evaluation) has no such module to import it from, so
    :class:`EnvFactory` carries it by value (cloudpickle), as SB3's subprocess envs carry
    theirs."""
    carried = carried_callable(spec)
    if carried is not None:
        return carried
    module_name, sep, _ = spec.partition(":")
    main = sys.modules.get("__main__")
    if not sep or module_name != "__main__" or main is None or getattr(main, "__file__", None):
        return None
    target = _import_target(spec)
    return None if isinstance(target, str) else target


def session_callables(tree: Any) -> bytes | None:
    """The interactive session's callables that the strings ``__main__:X`` anywhere in
    ``tree`` (a run's config as a dict: the env, an encoder) name, pickled by value for a
    process that builds the run again from its config (a further learner); ``None`` when
    there are none."""
    found = {}
    for text in config_strings(tree):
        if text.startswith("__main__:"):
            target = session_callable(text)
            if target is not None:
                found[text] = target
    return cloudpickle.dumps(found) if found else None


def config_strings(tree: Any) -> Iterator[str]:
    """Every string anywhere in ``tree`` (a run's config as a dict, lists and tuples)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, str):
            yield node


def where_a_module_lies(exc: ImportError, module_name: str) -> str:
    """Where a user's module must lie, when ``exc`` is its own top-level package missing (not
    an import inside it): ``impala`` looks in the working directory and ``PYTHONPATH``."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
        return "; its directory must be the working directory or on PYTHONPATH"
    return ""


def user_module_dirs(tree: Any) -> list[str]:
    """The directories of the user's own modules that the ``package.module:attr`` strings
    anywhere in ``tree`` (a run's config as a dict: the env, an encoder) were imported from,
    for a checkpoint to keep: ``impala eval`` or a resume started in another directory finds
    them there (:func:`make_importable`). An installed package's directory is not one."""
    installed = [Path(p).resolve() for p in _installed_dirs()]
    found: set[str] = set()
    for text in config_strings(tree):  # env.id's "package:EnvId-v0" is no import path
        module, colon, _ = text.partition(":")
        top = module.split(".")[0] if colon else ""
        file = getattr(sys.modules.get(top), "__file__", None)
        if top in ("", "__main__", "impala_rl") or not file:
            continue
        path = Path(file).resolve()
        directory = path.parent.parent if path.name == "__init__.py" else path.parent
        if not any(directory.is_relative_to(p) for p in installed):
            found.add(str(directory))
    return sorted(found)


def _installed_dirs() -> list[str]:
    """Where installed modules lie: the standard library and every site-packages directory
    (a user's project may lie under ``sys.prefix``, e.g. ``/usr/src/app`` under ``/usr``)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    return [*found, *site.getsitepackages(), site.getusersitepackages()]


def make_importable(directories: list[str]) -> None:
    """Put those of ``directories`` (:func:`user_module_dirs`) that still exist at the end of
    ``sys.path``: a module of the same name found earlier (the working directory, PYTHONPATH)
    still wins. Processes started later (actors, an evaluation) take this ``sys.path``."""
    for directory in directories:
        if os.path.isdir(directory) and directory not in sys.path:
            sys.path.append(directory)


def carried_callable(spec: str) -> Any | None:
    """What ``spec`` names among the callables carried into this process, else ``None``."""
    return _CARRIED_SESSION.get(spec)


def carry_session_callables(pickled: bytes | None) -> None:
    """Make :func:`session_callables`' callables what their specs name in this process."""
    if pickled is not None:
        _CARRIED_SESSION.update(cloudpickle.loads(pickled))


def register_on_demand(env_id: str) -> None:
    """Import the package of ``env_id``'s family (:data:`ID_FAMILIES`) if the id is not
    registered yet; a family whose package is missing is an :class:`EnvError` that names it.
    An id of no family: the installed :data:`ID_PROVIDERS`, until one registers it."""
    if env_id in gym.registry:
        return
    for prefix, (module_name, package) in ID_FAMILIES.items():
        if env_id.startswith(prefix):
            try:
                importlib.import_module(module_name)
            except ImportError as exc:
                raise EnvError(
                    f"env.id {env_id!r} needs the {module_name} package ({exc}): "
                    f"pip install {package}"
                ) from None
            return
    for module_name in ID_PROVIDERS:
        if module_name in sys.modules or importlib.util.find_spec(module_name) is None:
            continue
        try:
            importlib.import_module(module_name)
        except Exception:  # a provider that cannot import here registers nothing
            continue
        if env_id in gym.registry:
            logging.getLogger(__name__).info(
                "env.id=%s: registered by importing %s", env_id, module_name
            )
            return


def make_id_env(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """``gymnasium.make(env_id, **kwargs)`` after :func:`register_on_demand`; an id nobody
    registers says how to name the package that does."""
    register_on_demand(env_id)
    try:
        env = gym.make(env_id, **kwargs)
    except (gym.error.NameNotFound, gym.error.NamespaceNotFound) as exc:
        if hint := _ale_namespace_hint(env_id) or _pettingzoo_hint(env_id):  # Pong-ram-v5
            raise EnvError(f"env.id {env_id!r}: {exc}{hint}") from None
        raise EnvError(
            f"env.id {env_id!r}: {exc} If a package provides it, install the package and write "
            f"env.id=package:{env_id} (the package is imported, which registers its ids)"
        ) from None
    except (ImportError, gym.error.DependencyNotInstalled) as exc:
        # gymnasium's own message names its extra (gymnasium[box2d]); an import names a module
        missing = (getattr(exc, "name", None) or "").split(".")[0]
        hint = f"; its package is usually pip install {missing}" if missing else ""
        raise EnvError(
            f"env.id {env_id!r} needs a package that is not installed ({exc}){hint}"
        ) from None
    except gym.error.Error as exc:
        raise EnvError(f"env.id {env_id!r}: {exc}{_ale_namespace_hint(env_id)}") from None
    except TypeError as exc:
        raise EnvError(f"env.kwargs for {env_id!r}: {exc}") from None
    except OSError as exc:  # a file the env reads as it is made
        raise EnvError(f"env.id {env_id!r} could not be made: {unreadable_file(exc)}") from None
    _quiet_babyai_levels()
    return env


def _ale_namespace_hint(env_id: str) -> str:
    """`` Did you mean ALE/Pong-v5?`` for ``Pong-v5`` (ale-py registers v5 in the ALE namespace
    only; its RAM id, ``Pong-ram-v5``, too), else empty."""
    namespaced = f"ALE/{env_id}"
    return f" Did you mean {namespaced}?" if is_registered_game(namespaced) else ""


PETTINGZOO_FAMILIES = ("classic", "butterfly", "sisl", "mpe", "atari")
PETTINGZOO_NAME = re.compile(r"[a-z][a-z0-9_]*_v\d+")


def _pettingzoo_hint(env_id: str) -> str:
    """`` Did you mean pettingzoo.classic.tictactoe_v3?`` for ``tictactoe_v3`` (PettingZoo's
    games are modules, typed whole), where PettingZoo is installed and has that game."""
    if not PETTINGZOO_NAME.fullmatch(env_id):
        return ""
    for family in PETTINGZOO_FAMILIES:
        module = f"pettingzoo.{family}.{env_id}"
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # PettingZoo, or the family, not installed
            found = False
        if found:
            return f" Did you mean {module}?"
    return ""


def _kwargs_hint(fn: Callable[..., gym.Env], kwargs: dict[str, Any]) -> str:
    """Where a factory's arguments come from, when ``kwargs`` do not fit its signature (a
    required argument missing, one it does not take)."""
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError:
        given = ", ".join(f"env.kwargs.{k}" for k in kwargs) or "none"
        return f"; its arguments are given as env.kwargs.NAME=VALUE (given: {given})"
    except ValueError:  # no signature to read (a builtin)
        pass
    return ""


def unreadable_file(exc: OSError) -> str:
    """What an env's failed file read means: a file of an installed package (an incomplete
    release, e.g. minigrid 3.2.0's WFC patterns) or one the user's settings name."""
    name = f"{type(exc).__name__}: {exc.strerror or exc}"
    if not exc.filename:
        return name
    lacks = "lacks" if isinstance(exc, FileNotFoundError) else "cannot read"
    path = Path(str(exc.filename)).resolve()
    for root in map(Path, sys.path):
        try:
            package = path.relative_to(root.resolve()).parts[0]
        except (ValueError, IndexError, OSError):
            continue
        if "site-packages" in root.parts or "dist-packages" in root.parts:
            return (
                f"the installed package {package} {lacks} its own file {path} ({name}); its "
                f"install is incomplete: reinstall {package}, or install another version of it"
            )
    return f"{name}: {path} (a path in env.kwargs or in the env's own code)"


def _quiet_babyai_levels() -> None:
    """BabyAI's level generator prints every rejected sample to stdout ("Sampling rejected:
    unreachable object at (3, 5)", dozens a run, over the progress display): its module's
    ``print`` becomes this module's debug log. Nothing else of the package is touched."""
    module = sys.modules.get("minigrid.envs.babyai.core.roomgrid_level")
    if module is not None and "print" not in vars(module):
        log = logging.getLogger(__name__)
        module.print = lambda *args, **_: log.debug("%s", " ".join(map(str, args)))


AUTO_TIMING_S = 0.15  # seconds per vector env and round when env.vector=auto is settled


class EnvFactory:
    """A picklable callable that builds one wrapped env (sent to actor processes as is)."""

    def __init__(
        self,
        env_id: str,
        kwargs: dict | None = None,
        max_episode_steps: int | None = None,
        vector: str = "python",
        frame_stack: int = 1,
        action_mask: bool = True,
        entries: bool = True,
        max_image_side: int | None = None,
        float_images: bool = False,
        info_action_mask: bool = True,
        float_image_bounds: str = "finite",
    ):
        self.env_id = env_id
        self.kwargs = dict(kwargs or {})
        self.max_episode_steps = max_episode_steps
        self.vector = vector  # env.vector: auto | python | envpool
        self.frame_stack = int(frame_stack)
        self.action_mask = bool(action_mask)  # a plain env's action_mask entry masks
        self.entries = bool(entries)  # a Tuple with an image or text, a text: as entries
        self.max_image_side = max_image_side  # larger images downscaled (None: as they are)
        self.float_images = bool(float_images)  # a float image read as a uint8 one
        self.float_image_bounds = float_image_bounds  # which bounds such an image may have
        self.info_action_mask = bool(info_action_mask)  # a mask beside the observation
        # where that mask comes from ("info", "method", "" for nowhere): known once an env
        # was built (travels pickled)
        self.mask_source: str | None = None
        self.check_env = False  # Gymnasium's env checker: only on the probe, off the hot path
        self.structured: bool | None = None  # known once an env was built (travels pickled)
        self._carried: Callable[..., gym.Env] | None = None  # a session's callable, by value

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the callable itself where ``env_id`` names one of an interactive
        session (:func:`session_callable`), which other processes cannot import."""
        state = self.__dict__.copy()
        carried = self._carried
        if carried is None and ":" in self.env_id:
            carried = session_callable(self.env_id)
        state["_carried"] = None if carried is None else cloudpickle.dumps(carried)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        carried = state.pop("_carried", None)
        self.__dict__.update(state)
        self._carried = None if carried is None else cloudpickle.loads(carried)

    def _target(self) -> Callable[..., gym.Env] | str:
        """What ``env_id`` names: the carried callable, else as :func:`_import_target` finds
        it (a callable, or the Gymnasium id a module registers)."""
        return self._carried if self._carried is not None else _import_target(self.env_id)

    @classmethod
    def of(cls, env_cfg: Any, kwargs: dict | None = None, vector: str | None = None) -> EnvFactory:
        """The factory of an ``env`` config section (``kwargs`` in place of its own)."""
        return cls(
            env_cfg.id,
            env_cfg.kwargs if kwargs is None else kwargs,
            env_cfg.max_episode_steps,
            env_cfg.vector if vector is None else vector,
            env_cfg.frame_stack,
            env_cfg.action_mask,
            env_cfg.observation_entries,
            env_cfg.max_image_side,
            env_cfg.float_images,
            env_cfg.info_action_mask,
            env_cfg.float_image_bounds,
        )

    def stepping(self, vector: str) -> EnvFactory:
        """The same env and settings stepped by ``vector``, with what building one taught
        (its structure, its mask's source) and without the env checker (a probe's)."""
        other = copy.copy(self)
        other.kwargs = dict(self.kwargs)
        other.vector = vector
        other.check_env = False
        return other

    def __call__(self) -> gym.Env:
        fn = self._target() if ":" in self.env_id else self.env_id
        if not isinstance(fn, str):
            try:
                env = fn(**self.kwargs)
            except Exception as exc:
                raise EnvError(
                    f"env factory {self.env_id!r} raised {type(exc).__name__}: {exc}"
                    f"{_kwargs_hint(fn, self.kwargs)}"
                ) from exc
            if not isinstance(env, gym.Env):
                raise EnvError(
                    f"env factory {self.env_id!r} returned {type(env).__name__}, "
                    "not a gymnasium.Env"
                )
            _check_spaces_set(self.env_id, env)
            _check_reset_signature(self.env_id, env.unwrapped, options=not is_structured(env))
        elif self.env_id.startswith("MinAtar/"):
            from impala_rl.envs.minatar import make_minatar_env

            kwargs = {"disable_env_checker": not self.check_env, **self.kwargs}
            env = make_minatar_env(self.env_id, **kwargs)
        elif self.env_id.startswith(PETTINGZOO_PREFIX):
            from impala_rl.envs.pettingzoo import make_aec_env

            if "env" in self.kwargs:
                raise EnvError(
                    f"env.kwargs.env={self.kwargs['env']!r} with env.id={self.env_id!r}: give "
                    "the game once, as env.id"
                )
            taken = [
                name
                for name, p in inspect.signature(make_aec_env).parameters.items()
                if p.kind is p.POSITIONAL_OR_KEYWORD and name != "env"
            ]
            unknown = sorted(set(self.kwargs) - set(taken))
            if unknown:
                raise EnvError(
                    f"env.kwargs for {self.env_id!r}: {unknown} not taken; valid: "
                    + ", ".join(taken)
                )
            env = make_aec_env(self.env_id, **self.kwargs, game_field="env.id")
        elif is_ale_id(self.env_id):
            from impala_rl.envs.atari import make_ale_id_env

            env = make_ale_id_env(self.env_id, **self.kwargs)
        else:
            kwargs = {"disable_env_checker": not self.check_env, **self.kwargs}
            env = make_id_env(fn, kwargs)
        self.structured = is_structured(env)
        key_actions = getattr(env, "action_spaces", None) if self.structured else None
        if isinstance(key_actions, dict):
            for key, space in sorted(key_actions.items()):
                check_action_space(space, f"action_spaces[{key}]")
        else:
            check_action_space(env.action_space)
        if self.structured:  # spaces per step key: the structured vector env converts them
            if self.max_episode_steps is not None:
                raise EnvError(
                    f"env.max_episode_steps is not supported for the structured env "
                    f"{self.env_id!r}; valid: null (end episodes inside the env)"
                )
            return converted_images(env, self.images)
        if self.max_episode_steps is not None:
            env = gym.wrappers.TimeLimit(env, self.max_episode_steps)
        source = self._outside_mask_source(env)
        if source:
            env = OutsideActionMask(env, source)
        if (source or self.action_mask) and has_action_mask(env.observation_space):
            if self.frame_stack > 1:
                raise EnvError(
                    f"env.frame_stack={self.frame_stack} stacks {self.env_id!r}'s action_mask "
                    "with its observations; valid: 1, or env.action_mask=false"
                )
            self.structured = True  # one key: the structured vector env applies the mask
            return converted_images(MaskedActionsEnv(env), self.images)
        if self.frame_stack > 1:
            env = gym.wrappers.FrameStackObservation(env, self.frame_stack)
        env = converted_images(env, self.images)  # right under the model's form (Policy)
        space = env.observation_space
        if not keeps_structure(space, self.entries) and model_observation_space(space) is space:
            return env
        return ModelObservation(env, self.entries)

    def _outside_mask_source(self, env: gym.Env) -> str:
        """Where ``env`` gives its legal actions beside its observation (``env.info_action_mask``,
        :func:`~impala_rl.envs.structured.outside_mask_source`), ``""`` for nowhere. The first
        env built tells, with one reset where its action space takes a mask and it has no
        ``action_masks()`` method; the factory remembers it for the envs it builds after."""
        if not self.info_action_mask:
            return ""
        if self.mask_source is None:
            source = outside_mask_source(env, None)
            if source is None and mask_width(env.action_space) is not None:
                source = outside_mask_source(env, self._first_reset(env)[1])
            self.mask_source = source or ""
        return self.mask_source

    def _first_reset(self, env: gym.Env) -> tuple[Any, dict[str, Any]]:
        """``env.reset()``, where an env that reads its files on reset fails first."""
        try:
            return env.reset()
        except OSError as exc:
            raise EnvError(
                f"env.id {self.env_id!r} could not reset: {unreadable_file(exc)}"
            ) from None

    @property
    def images(self) -> ImageReading:
        """How the env's images reach the model (``env.max_image_side``, ``env.float_images``,
        ``env.float_image_bounds``)."""
        return ImageReading(self.max_image_side, self.float_images, self.float_image_bounds)

    def make_vector(self, num_envs: int) -> Any:
        """A native vector env of ``num_envs`` copies when the env's callable offers one (a
        ``make_vector`` attribute, e.g. Atari with ``env.kwargs.vector=ale``) or envpool steps
        the id (``vector``, see :mod:`impala_rl.envs.envpool`), else ``None``.

        The actor loop takes one that autoresets on the same step and puts final observations
        in ``info["final_obs"]``, as :class:`~impala_rl.envs.vector.SameStepVectorEnv` does; a
        Gymnasium vector env that resets on the next step (its default) or observes in
        another form than the model's is adapted (:class:`~impala_rl.envs.vector.NativeVectorEnv`).
        """
        if self.vector == "async":
            return self._async_vector(num_envs)
        if self.frame_stack > 1:  # stacked by Gymnasium's wrapper, env by env
            return None
        if is_ale_id(self.env_id):
            from impala_rl.envs.atari import make_atari_vector_env

            envs = make_atari_vector_env(num_envs, **{"game": self.env_id, **self.kwargs})
        elif ":" not in self.env_id:
            from impala_rl.envs import envpool

            if self.resolve_vector(num_envs) == "envpool":
                return envpool.EnvpoolVectorEnv(
                    self.env_id, num_envs, self.kwargs, self.max_episode_steps
                )
            return None
        else:  # module:callable (module:EnvId has no native vector env)
            make = getattr(self._target(), "make_vector", None)  # None for a module:EnvId
            if make is None:
                return None
            envs = make(num_envs, **self.kwargs)
            if envs is not None and NativeVectorEnv.needed(envs, self.images, self.entries):
                envs = NativeVectorEnv(envs, images=self.images, entries=self.entries)
        if envs is not None and self.max_episode_steps is not None:
            envs.close()
            raise EnvError(
                f"env.max_episode_steps cannot limit the native vector env of {self.env_id!r}; "
                "valid: null (use the factory's own limit, e.g. env.kwargs.max_episode_frames)"
            )
        return envs

    def _async_vector(self, num_envs: int) -> Any:
        """``env.vector=async``: Gymnasium's ``AsyncVectorEnv`` of ``num_envs`` envs, each in a
        process forked from the forkserver (which has torch and the actor loop imported),
        same-step autoreset, observations in shared memory (overwritten by the next step, as
        :class:`SameStepVectorEnv`'s). A structured env (known once one was built, which
        :func:`make_keyed_vector_env` checks first) steps in turn (its agents' turns)."""
        if self.structured:
            return None
        # A forkserver started here imports the env machinery (torch) once, not each env's
        # process (10 CarRacing envs: 0.3 s to start against 1.0 s); one already running stays.
        preload_forkserver("impala_rl.envs")
        with hangup_blocked():  # a forkserver it starts: see impala_rl.group_signals
            envs = gym.vector.AsyncVectorEnv(
                [_StopLeavingWorker(self.stepping("python"))] * num_envs,
                copy=False,
                context="forkserver",
                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            )
        for process in envs.processes:
            stopped_by_parent(process)
        if is_composite(envs.single_action_space):
            return NativeVectorEnv(envs, model_form=True)  # actions batched from the rows'
        return envs

    def resolve_vector(
        self, num_envs: int, rate: Callable[[EnvFactory, float], float] | None = None
    ) -> str:
        """Settle ``vector=auto`` once, on this machine: envpool where ``rate(factory,
        seconds)`` (env steps per second, timed for :data:`AUTO_TIMING_S`; the trainer times an
        actor's loop, by default raw stepping of ``num_envs`` copies) is higher for it than for
        :class:`SameStepVectorEnv`, each timed twice, interleaved; else ``python``. Which is
        faster depends on the CPU and on what runs between the steps, so no fixed list
        decides. The answer is kept, so the actors of a run (the factory is pickled after it
        is settled) and its evaluator step the same kind."""
        if self.vector != "auto":
            return self.vector
        from impala_rl.envs import envpool

        self.vector = "python"
        if (
            ":" in self.env_id
            or self.env_id not in envpool.SUPPORTED_IDS
            or self.kwargs
            or not envpool.envpool_installed()
        ):
            return self.vector
        if rate is None:
            rate = lambda factory, seconds: steps_per_second(factory, num_envs, seconds)  # noqa: E731
        rates: dict[str, float] = {"python": 0.0, "envpool": 0.0}
        for _ in range(2):
            for name in rates:
                candidate = self.stepping(name)
                rates[name] = max(rates[name], rate(candidate, AUTO_TIMING_S))
        self.vector = max(rates, key=rates.__getitem__)
        logging.getLogger(__name__).info(
            "env.vector=auto: %s x%d steps %.0f env steps/s in envpool, %.0f in python; using %s",
            self.env_id,
            num_envs,
            rates["envpool"],
            rates["python"],
            self.vector,
        )
        return self.vector

    def __repr__(self) -> str:
        return f"EnvFactory({self.env_id!r}, kwargs={self.kwargs!r})"


def steps_per_second(factory: Callable[[], gym.Env], num_envs: int, seconds: float) -> float:
    """Env steps per second of ``make_vector_env(factory, num_envs)`` under random actions."""
    envs = make_vector_env(factory, num_envs)
    try:
        envs.reset(seed=0)
        space = envs.single_action_space
        space.seed(0)
        rows = [[space.sample() for _ in range(num_envs)] for _ in range(64)]
        actions = rows if is_composite(space) else [np.stack(row) for row in rows]
        envs.step(actions[0])  # first-step costs out of the timing
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            envs.step(actions[steps % len(actions)])
            steps += 1
        return steps * num_envs / elapsed
    finally:
        envs.close()


def make_env_factory(env_cfg: Any) -> EnvFactory:
    """Factory for the ``env`` config section; builds one env once to fail early."""
    factory = EnvFactory.of(env_cfg)
    if env_cfg.vector == "envpool":
        factory.make_vector(1).close()  # refuses ids envpool lacks, and a missing envpool
    factory.check_env = True
    try:
        probe = factory()
        if is_structured(probe):
            for k, space in sorted(probe.observation_spaces.items()):
                dropped = KeyObservation(space, k, env_cfg.observation_entries).dropped
                log_dropped_entries(env_cfg.id, dropped, k)
        else:
            log_dropped_entries(env_cfg.id, getattr(probe, "dropped", []))
            check_step_api(env_cfg.id, probe)
        _log_image_conversions(env_cfg.id, probe)
        probe.close()
    finally:
        factory.check_env = False
    return factory


def check_step_api(env_id: str, env: gym.Env) -> None:
    """One reset and one random step of the env itself (under every wrapper), held against
    Gymnasium's API before training starts: ``step`` returns ``(obs, reward, terminated,
    truncated, info)`` and the reward is a number. An env written for the old Gym API, or one
    that returns its reward as an array, is an :class:`EnvError` that says what to change; any
    other error of the env is left to the run, where it happens with its traceback."""
    raw = env.unwrapped
    try:
        reset = raw.reset(seed=0)
    except Exception:
        return
    if not (isinstance(reset, tuple) and len(reset) == 2):
        raise EnvError(
            f"env.id {env_id!r}: reset returned {type(reset).__name__}; valid: Gymnasium's "
            "(obs, info). An env of the old Gym API returns the observation alone: return "
            "(obs, {})"
        )
    _check_info(env_id, reset[1], "reset", "(obs, {})")
    _check_observation_shape(env_id, raw.observation_space, reset[0], "reset")
    try:
        result = raw.step(raw.action_space.sample())
    except Exception:
        return
    if not isinstance(result, tuple) or len(result) != 5:
        count = len(result) if isinstance(result, tuple) else type(result).__name__
        raise EnvError(
            f"env.id {env_id!r}: step returned {count} values; valid: Gymnasium's (obs, reward, "
            "terminated, truncated, info). An env of the old Gym API returns (obs, reward, "
            "done, info): return terminated and truncated instead of done"
        )
    _check_observation_shape(env_id, raw.observation_space, result[0], "step")
    _check_info(env_id, result[4], "step", "(obs, reward, terminated, truncated, {})")
    reward = result[1]
    if np.ndim(reward) != 0 or not np.isrealobj(reward):
        shape = f" of shape {np.shape(reward)}" if np.ndim(reward) else ""
        raise EnvError(
            f"env.id {env_id!r}: step's reward is {type(reward).__name__}{shape} "
            f"({reward!r}); valid: a number (return float(reward))"
        )


def _check_spaces_set(env_id: str, env: gym.Env) -> None:
    """An env that never set its ``observation_space`` or ``action_space`` (a plain env; a
    structured one sets them per step key) is an :class:`EnvError` naming the attribute."""
    if is_structured(env):
        return
    for name in ("observation_space", "action_space"):
        space = getattr(env, name, None)
        if not isinstance(space, gym.spaces.Space):
            got = "none" if space is None else f"{type(space).__module__}.{type(space).__name__}"
            raise EnvError(
                f"env.id {env_id!r}: {type(env.unwrapped).__name__}.{name} is {got}; valid: a "
                f"gymnasium.spaces.Space, set in __init__ (self.{name} = ...) or on the class"
            )


def _check_reset_signature(env_id: str, env: gym.Env, options: bool = True) -> None:
    """A ``reset`` that takes no ``seed`` keyword, or no ``options`` where Gymnasium's
    wrappers pass them (a plain env; a structured env is reset with a seed alone), is an
    :class:`EnvError` before anything resets it."""
    try:
        parameters = inspect.signature(env.reset).parameters.values()
    except (TypeError, ValueError):  # a builtin or C method: nothing to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters}
    missing = [name for name in ("seed", "options")[: 1 + options] if name not in names]
    if missing:
        raise EnvError(
            f"env.id {env_id!r}: {type(env).__name__}.reset takes no {' or '.join(missing)}; "
            "valid: Gymnasium's reset(self, seed=None, options=None), calling "
            "super().reset(seed=seed) to seed self.np_random"
        )


def _check_info(env_id: str, info: Any, where: str, valid: str) -> None:
    """An info that is not a dict (``None``) is an :class:`EnvError` naming the fix."""
    if not isinstance(info, dict):
        raise EnvError(
            f"env.id {env_id!r}: {where}'s info is {type(info).__name__}; valid: a dict, "
            f"empty where there is nothing to say: return {valid}"
        )


def _check_observation_shape(env_id: str, space: gym.Space, obs: Any, where: str) -> None:
    """A ``Box`` observation that does not fit the space's shape (as the rollout slots store
    it) is an :class:`EnvError` naming both shapes."""
    if not isinstance(space, gym.spaces.Box):
        return
    try:
        np.empty(space.shape, space.dtype)[...] = obs
    except (ValueError, TypeError):
        raise EnvError(
            f"env.id {env_id!r}: {where} returned an observation of shape {np.shape(obs)}; "
            f"its observation_space is {space} (shape {space.shape})"
        ) from None


def _log_image_conversions(env_id: str, env: gym.Env) -> None:
    """One line saying which images the model reads downscaled or as ``uint8``, if any."""
    while env is not None and not isinstance(env, (ConvertedImages, ConvertedKeyImages)):
        env = getattr(env, "env", None)  # under the model's form (ModelObservation)
    if env is not None:
        logging.getLogger(__name__).info(
            "env.id=%s: the model reads %s (env.max_image_side, env.float_images)",
            env_id,
            "; ".join(env.conversions()),
        )


class _StopLeavingWorker:
    """An env factory for ``AsyncVectorEnv``'s worker processes, which leave their stop to the
    process that steps them (it closes them; see :mod:`impala_rl.child_processes`): one that
    took a Ctrl-C, a hangup or a SIGTERM sent to the whole group would die mid-step, and the
    learner's stop would fail on its pipe. Built in the process that made it (the vector env's
    first env, for the spaces), it leaves that process's signals be."""

    def __init__(self, factory: EnvFactory):
        self.factory, self.parent = factory, os.getpid()

    def __call__(self) -> gym.Env:
        if os.getpid() != self.parent:
            leave_stopping_to_parent()
        return self.factory()


def make_vector_env(factory: Callable[[], gym.Env], num_envs: int) -> Any:
    """A synchronous vector env with same-step autoreset (the factory's native one if it has
    one, see :meth:`EnvFactory.make_vector`).

    On the step that ends an episode the env returns the next episode's first observation and
    puts the final one in ``info["final_obs"]``, which truncation needs for its bootstrap.
    Errors raised by an env name its index.
    """
    make_vector = getattr(factory, "make_vector", None)
    envs = make_vector(num_envs) if make_vector is not None else None
    if envs is not None:
        return envs
    return SameStepVectorEnv([factory] * num_envs)


def make_keyed_vector_env(factory: Callable[[], gym.Env], num_envs: int) -> Any:
    """``num_envs`` copies under the structured vector env's contract (who acts, per-key
    observations): a :class:`~impala_rl.envs.structured.StructuredVectorEnv` for a structured
    env, a plain one (:func:`make_vector_env`) as its one-key case,
    :class:`~impala_rl.envs.structured.SingleKeyVectorEnv`. An :class:`EnvFactory` that has
    built an env knows which; else one env is built to tell."""
    structured = getattr(factory, "structured", None)
    if structured is None:
        probe = factory()
        structured = is_structured(probe)
        probe.close()
    if structured:
        return StructuredVectorEnv([factory] * num_envs, getattr(factory, "entries", True))
    return SingleKeyVectorEnv(make_vector_env(factory, num_envs))
