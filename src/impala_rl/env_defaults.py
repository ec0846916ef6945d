"""What ``impala train env.id=ID`` runs without a preset: defaults that fit the env.

An env of a Gymnasium family with a preset (``classic_control``, ``box2d``, ``mujoco``: the
family is the package of the env's entry point) runs that preset; any other env the config's
own defaults. On top, a few settings chosen for the env:

- ``target_return``: the env's Gymnasium ``spec.reward_threshold`` where it defines one, else
  ``null`` (no early stop), never another env's target;
- evaluation in the background, at most ~10% of the wall time
  (``rollout_evaluator.max_time_share``), the final weights evaluated at the end;
- ``patience: 0`` and a budget of 1M env steps (``max_env_steps`` overrides it);
- image observations (``uint8 [C, H, W]``): a CNN encoder with one shared torso (the Nature
  CNN, or the MinAtar CNN for frames under 36 pixels), as the ``atari`` and ``minatar``
  presets; vector observations keep the MLP.

The user's ``key=value`` overrides go on top, so an explicit ``target_return`` always wins.
With neither a preset nor ``env.id`` the ``cartpole`` preset runs (CartPole-v1, tuned).
"""

from __future__ import annotations

import logging
from typing import Any

import gymnasium as gym
import numpy as np

from impala_rl.config import RunConfig, check_rules, load_config, merge_config
from impala_rl.envs import EnvFactory
from impala_rl.envs.structured import is_structured
from impala_rl.sizing import size_to_machine

log = logging.getLogger(__name__)

DEFAULT_PRESET = "cartpole"
"""What runs with neither a preset nor ``env.id``."""
FAMILY_PRESETS = ("classic_control", "box2d", "mujoco")
"""Gymnasium's env families (``gymnasium.envs.<family>``) with a preset of the same name."""
MAX_ENV_STEPS = 1_000_000
EVAL_TIME_SHARE = 0.1
NATURE_CNN_MIN_SIDE = 36  # 8x8 stride 4, 4x4 stride 2, 3x3 stride 1 leave >= 1 pixel


def _spec(env_id: str) -> Any:
    """Gymnasium's spec of a registered id; None for a ``module:callable`` factory or an id
    Gymnasium does not know."""
    if ":" in env_id:
        return None
    try:
        return gym.spec(env_id)
    except Exception:  # unknown ids, namespaces not registered
        return None


def reward_threshold(env_id: str) -> float | None:
    """The env's Gymnasium ``spec.reward_threshold``; None for a ``module:callable`` factory,
    an id Gymnasium does not know, or a spec without one."""
    threshold = getattr(_spec(env_id), "reward_threshold", None)
    return None if threshold is None else float(threshold)


def env_family(env_id: str) -> str | None:
    """The Gymnasium family of a registered id (``classic_control`` for ``Pendulum-v1``:
    the package under ``gymnasium.envs`` of its entry point); None for anything else."""
    entry = getattr(_spec(env_id), "entry_point", None)
    if not isinstance(entry, str) or not entry.startswith("gymnasium.envs."):
        return None
    return entry.split(":", 1)[0].split(".")[2]


def _overridden(overrides: list[str], key: str) -> bool:
    return any(item.split("=", 1)[0].strip() == key for item in overrides)


def describe_spaces(env: Any) -> tuple[str, dict[str, Any]]:
    """``("discrete actions, vector observations", model settings)`` for one built env."""
    if is_structured(env):
        return "a structured env (spaces per step key)", {}
    action = env.action_space
    if isinstance(action, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        actions = "discrete actions"
    elif isinstance(action, gym.spaces.Box):
        actions = "continuous actions"
    else:
        actions = f"{type(action).__name__} actions"
    obs = env.observation_space
    if isinstance(obs, gym.spaces.Dict):
        return f"{actions}, Dict observations (an encoder per entry)", {}
    image = isinstance(obs, gym.spaces.Box) and obs.dtype == np.uint8 and len(obs.shape) == 3
    if not image:
        return f"{actions}, vector observations", {}
    c, h, w = obs.shape
    if c > min(h, w):  # channels last: the CNNs read [C, H, W]
        return (
            f"{actions}, channels-last image observations {tuple(obs.shape)} (mlp encoder; "
            "a channels-first env gets a CNN)",
            {},
        )
    encoder = "nature_cnn" if min(h, w) >= NATURE_CNN_MIN_SIDE else "minatar_cnn"
    return f"{actions}, image observations", {"encoder": encoder, "shared_torso": True}


def env_defaults(overrides: list[str]) -> tuple[RunConfig, str]:
    """The config for ``overrides`` (which set ``env.id``) on defaults that fit the env, and
    the console line saying what was chosen. Builds the env once to read its spaces.

    Only the ``env`` section is checked before the probe; the rest is validated once, on the
    config that runs (the preset chosen here may supply what an override needs, e.g. the
    ``max_env_steps`` a linear schedule decays over)."""
    probe_cfg = merge_config(overrides=overrides)
    check_rules(probe_cfg, "env")
    env_cfg = probe_cfg.env
    probe = EnvFactory(env_cfg.id, env_cfg.kwargs, env_cfg.max_episode_steps)()
    try:
        spaces, model = describe_spaces(probe)
    finally:
        probe.close()
    threshold = reward_threshold(env_cfg.id)
    family = env_family(env_cfg.id)
    preset = family if family in FAMILY_PRESETS else None
    derived = [f"target_return={'null' if threshold is None else threshold}"]
    derived += [f"model.{key}={value}" for key, value in model.items()]
    if preset is None:  # a family preset sets these itself
        derived += [
            f"max_env_steps={MAX_ENV_STEPS}",
            "algorithm.patience=0",
            "algorithm.rollout_evaluator.background=true",
            f"algorithm.rollout_evaluator.max_time_share={EVAL_TIME_SHARE}",
        ]
    cfg = load_config(preset, [*derived, *overrides])
    if _overridden(overrides, "target_return"):
        given = cfg.target_return
        target = "no target_return (given)" if given is None else f"target_return {given:g} (given)"
    elif threshold is not None:
        target = f"target_return {threshold:g} from the env spec"
    else:
        target = "no target_return (the env spec has no reward_threshold)"
    a, ev = cfg.algorithm, cfg.algorithm.rollout_evaluator
    if ev.max_time_share is None:
        evaluation = "evaluation every epoch"
    else:
        evaluation = f"evaluation at most {ev.max_time_share:.0%} of the time"
    evaluation += " in the background" if ev.background else " in the pause"
    chosen = f"the {preset} preset" if preset else "no preset: defaults"
    line = (
        f"{chosen} for {env_cfg.id} ({spaces}); {target}; {evaluation}; "
        f"{cfg.model.encoder} encoder, lr {a.lr:g}, {cfg.runner.backend} backend, "
        f"{a.num_actors} actors x {a.envs_per_actor} envs, unroll {a.n_rollout_steps}, "
        f"max_env_steps {cfg.max_env_steps}"
    )
    return cfg, line


def resolve_config(preset: Any, overrides: list[str] | None = None) -> RunConfig:
    """``impala train [PRESET] [key=value ...]``'s config: the preset (a name or YAML path)
    when given; else defaults for ``env.id`` (:func:`env_defaults`, said on the log); else the
    ``cartpole`` preset. Sized to the machine where it asks to be (:mod:`impala_rl.sizing`)."""
    overrides = list(overrides or [])
    if preset is not None:
        cfg = load_config(preset, overrides)
    elif not _overridden(overrides, "env.id"):
        log.info("no preset and no env.id: the %s preset", DEFAULT_PRESET)
        cfg = load_config(DEFAULT_PRESET, overrides)
    else:
        cfg, line = env_defaults(overrides)
        log.info("%s", line)
    return size_to_machine(cfg, overrides)
