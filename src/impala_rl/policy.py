"""A trained policy for use outside training, and the config a run was started with.

``load_policy(run_dir)`` builds the model of a run directory's checkpoint and wraps it in a
:class:`Policy` with ``act(obs, deterministic=...)``; ``load_run_config(run_dir)`` reads the
config a run was started with (for ``--resume``). Neither imports the training stack.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala_rl import checkpoint
from impala_rl.config import RunConfig, config_from_dict, to_dict
from impala_rl.decisions import DecisionStreams, LocalActing
from impala_rl.envs import EnvFactory
from impala_rl.envs.factory import make_importable
from impala_rl.envs.spaces import is_text
from impala_rl.envs.structured import ACTION_MASK, OutsideActionMask, is_structured
from impala_rl.nn import Model
from impala_rl.nn.factory import build_model_for_env
from impala_rl.nn.observations import any_tensor, as_obs, map_obs, stack_obs
from impala_rl.rundir import RunDirError


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config a run was started with (from its last checkpoint), plus overrides."""
    run_dir = Path(run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    if not last.is_file():
        raise RunDirError(f"{str(run_dir)!r} is not a run directory (no checkpoints/last.pt)")
    data = checkpoint.load(last)
    make_importable(data.get("module_dirs", []))
    from impala_rl.config import load_config

    base = config_from_dict(data["config"])
    if not overrides:
        return base
    cfg = load_config(base=to_dict(base), overrides=overrides)
    check_resumable(base, cfg, overrides)
    return cfg


RESUMABLE_MODEL_KEYS = ("model.precision", "model.channels_last", "model.init", "model.popart_beta")
"""``model`` settings a resume may change: how the saved weights compute, not their shapes."""

FIXED_ENV_KEYS = (
    "env.id",
    "env.frame_stack",
    "env.max_image_side",
    "env.float_images",
    "env.float_image_bounds",
    "env.observation_entries",
    "env.action_mask",
    "env.info_action_mask",
)
"""``env`` settings that shape what the model reads: a resume keeps the saved run's."""


def check_resumable(saved: RunConfig, cfg: RunConfig, overrides: list[str]) -> None:
    """Refuse overrides on resume that the saved weights cannot follow, naming the key: another
    env or reading of it (:data:`FIXED_ENV_KEYS`) or another model (``model.*`` but
    :data:`RESUMABLE_MODEL_KEYS`). An ``env.kwargs`` override that changes the env's spaces is
    refused when the weights are loaded."""
    from impala_rl.config import ConfigError, flat_dict

    old, new = flat_dict(to_dict(saved)), flat_dict(to_dict(cfg))
    for item in overrides:
        key = item.split("=", 1)[0].strip().lstrip("+")
        fixed = key in FIXED_ENV_KEYS
        fixed |= key.startswith("model.") and key not in RESUMABLE_MODEL_KEYS
        changed = [k for k in new if (k == key or k.startswith(f"{key}.")) and new[k] != old.get(k)]
        changed += [k for k in old if k.startswith(f"{key}.") and k not in new]
        if fixed and changed:
            raise ConfigError(
                f"{key}={new.get(key, '...')!r} on resume: the run was trained with "
                f"{old.get(key, 'another value')!r}, and its saved weights fit only that env "
                "and model; resume without this override or start a new run"
            )


class Policy:
    """A trained policy for use outside training: ``act(obs, deterministic=...)``.

    It acts through decision streams (:class:`~impala_rl.decisions.DecisionStreams`) as an
    actor and the evaluator do, so a recurrent policy (``model.core=lstm``) or one that reads
    the last action and reward keeps that state between calls, per agent: call :meth:`reset`
    when an episode starts (all of a batch's columns together; a change of batch size also
    resets), and pass the reward the agent received since its previous decision as
    ``last_reward`` when the model reads it. On a structured env the policy acts per step key
    and agent: pass the acting agent's observation as the env returns it and
    ``step_key, agent_id = env.actor_id()``.
    """

    def __init__(self, model: Model, env_factory: EnvFactory, cfg: RunConfig, env: Any = None):
        self.model = model.eval()
        self.env_factory = env_factory
        self.config = cfg
        self._acting = LocalActing(self.model)
        self._streams: DecisionStreams | None = None
        from impala_rl.envs.factory import ModelObservation
        from impala_rl.envs.images import ConvertedImages, ConvertedKeyImages
        from impala_rl.envs.structured import KeyObservation

        built = env is None
        env = env_factory() if built else env
        self._key_observations = None
        self._n_agents = 1
        self._key_images = None  # a structured env's raw images as the model reads them
        self._outside_mask = _outside_mask(env)  # its checks and layout, no env calls
        if is_structured(env):
            self._key_observations = {
                k: KeyObservation(s, k, cfg.env.observation_entries)
                for k, s in env.observation_spaces.items()
            }
            self._n_agents = int(env.n_agents)
            if isinstance(env, ConvertedKeyImages):
                self._key_images = env.observation_of
        convert = env.observation if isinstance(env, ModelObservation) else None
        inner = env.env if convert is not None else env
        images = inner.observation if isinstance(inner, ConvertedImages) else None
        self._raw_space = (inner.env if images is not None else inner).observation_space
        self._to_model = _composed(images, convert)
        if built:
            env.close()

    @torch.no_grad()
    def act(
        self,
        obs: Any,
        deterministic: bool = True,
        last_reward: Any = None,
        step_key: int | None = None,
        agent_id: int = 0,
        action_mask: Any = None,
    ) -> Any:
        """Action for one observation, or for a batch ``[N, ...]`` of them, as the env returns
        them or in the model's form; returned in the env's action format (for a batch of a
        Tuple or Dict action space, a list of tuples or dicts). ``last_reward`` (a
        number or ``[N]``) is the reward since the agent's previous decision, for models that
        read it. ``step_key`` and ``agent_id``: who acts (structured envs; one observation, its
        ``action_mask`` respected). ``action_mask``: the legal actions of an env that gives
        them beside its observation (``info["action_mask"]``, ``env.action_masks()``; one
        observation; ``None``: every action)."""
        model = self.model
        streams = None
        if action_mask is not None and self._outside_mask is None:
            raise ValueError(
                "action_mask= is for an env that gives its legal actions beside its observation "
                "(info['action_mask'] or action_masks()); this run's env gives none"
            )
        if self._key_observations is not None:
            step_key = self._step_key(step_key)
            if not 0 <= agent_id < self._n_agents:
                raise ValueError(f"agent_id={agent_id!r} is not one of 0..{self._n_agents - 1}")
            outside = self._outside_mask
            if outside is not None and not (isinstance(obs, dict) and ACTION_MASK in obs):
                legal = np.ones(outside.width) if action_mask is None else action_mask
                obs = outside.with_mask(obs, legal, "Policy.act")
            if self._key_images is not None:
                obs = self._key_images(step_key, obs)
            x, mask = self._key_observations[step_key](obs)
            x = map_obs(as_obs(x), lambda t: t.unsqueeze(0))
            mask = None if mask is None else torch.as_tensor(mask).unsqueeze(0)
            batched, n_envs, streams = False, 1, np.array([agent_id])
        else:
            step_key, mask = 0, None
            x, batched = self._model_batch(obs)
            n_envs = any_tensor(x).shape[0]
        if self._streams is None or self._streams.num_envs != n_envs:  # new episodes
            self._streams = DecisionStreams(model, self._acting, n_envs, self._n_agents)
        elif last_reward is not None:
            reward = np.asarray(last_reward, dtype=np.float64).reshape(-1)
            self._streams.reported_rewards(reward, streams)
        self._acting.deterministic = deterministic
        acted, _ = self._streams.decide(step_key, x, mask, streams)
        return acted.env_action if batched else acted.env_action[0]

    def _model_batch(self, obs: Any) -> tuple[Any, bool]:
        """A plain env's ``obs`` as a model batch ``[N, *o]``, and whether it was a batch: one
        observation or a batch ``[N, ...]`` of them, as the env returns them or in the model's
        form, told apart by their shapes (not their dtypes: a float64 vector of a float32 Box
        is one observation)."""
        if isinstance(obs, torch.Tensor):
            obs = obs.detach().cpu().numpy()
        raw, model_space = self._raw_space, self.model.observation_spaces[0]
        if _fits(obs, raw, 0):
            return map_obs(as_obs(_arrays(self._to_model(obs))), lambda t: t.unsqueeze(0)), False
        if _fits(obs, raw, 1):
            rows = [self._to_model(row) for row in _rows(obs)]
            return stack_obs([_arrays(row) for row in rows]), True
        for batched in (False, True):
            if _fits(obs, model_space, int(batched)):
                x = as_obs(_arrays(obs))
                return (x if batched else map_obs(x, lambda t: t.unsqueeze(0))), batched
        raise ValueError(
            f"Policy.act takes one observation of {raw} (or of the model's {model_space}), or a "
            f"batch [N, ...] of them; got {_described(obs)}"
        )

    def _step_key(self, step_key: int | None) -> int:
        """The structured env's step key that acts, checked."""
        keys = self._key_observations
        assert keys is not None
        if step_key is None:
            if len(keys) != 1:
                raise ValueError(
                    f"this structured env has step keys {sorted(keys)}: pass "
                    "step_key=env.actor_id().step_key"
                )
            step_key = next(iter(keys))
        if step_key not in keys:
            raise ValueError(f"step_key={step_key!r} is not one of {sorted(keys)}")
        return step_key

    def reset(self) -> None:
        """Start new episodes: zero core state, last action and last reward."""
        self._streams = None


def _outside_mask(env: Any) -> OutsideActionMask | None:
    """The wrapper that puts a mask given beside the observation into it, if ``env`` has one."""
    while not isinstance(env, OutsideActionMask):
        if not isinstance(env, gym.Wrapper):
            return None
        env = env.env
    return env


def _composed(*steps: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The observation conversions ``steps`` (``None``: skipped) applied in order."""
    present = [step for step in steps if step is not None]

    def convert(obs: Any) -> Any:
        for step in present:
            obs = step(obs)
        return obs

    return convert


def _fits(obs: Any, space: Any, batch_dims: int) -> bool:
    """Whether ``obs`` is ``[*batch, *shape]`` of ``space`` with ``batch_dims`` batch dims
    (per entry of a Dict; a text entry is a string, a batch of them a sequence of strings)."""
    import gymnasium

    if isinstance(space, gymnasium.spaces.Dict):
        if not isinstance(obs, dict):
            return False
        return all(k in obs and _fits(obs[k], s, batch_dims) for k, s in space.spaces.items())
    if isinstance(obs, dict):
        return False
    if is_text(space):
        if batch_dims == 0:
            return isinstance(obs, str)
        return np.ndim(obs) == 1 and all(isinstance(x, str) for x in obs)
    if isinstance(space, gymnasium.spaces.Tuple):  # a tuple (or list) of its entries
        if batch_dims:
            rows = isinstance(obs, list | tuple) and len(obs) > 0
            return rows and all(_fits(row, space, 0) for row in obs)
        return (
            isinstance(obs, list | tuple)
            and len(obs) == len(space.spaces)
            and all(_fits(o, s, 0) for o, s in zip(obs, space.spaces, strict=True))
        )
    if space.shape is None:  # another space without a shape (a Sequence): one observation
        return batch_dims == 0
    discrete = (gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete)
    if isinstance(space, discrete) and np.asarray(obs).dtype.kind not in "iub":
        return False  # indices, not the model's float one-hot of them
    shape = np.shape(obs)
    return len(shape) == len(space.shape) + batch_dims and shape[batch_dims:] == tuple(space.shape)


def _rows(obs: Any) -> list[Any]:
    """The observations of a batch (a dict of batches: one dict per row)."""
    if isinstance(obs, dict):
        n = len(next(v for v in obs.values() if np.ndim(v) > 0))
        return [{k: (v[i] if np.ndim(v) > 0 else v) for k, v in obs.items()} for i in range(n)]
    return list(obs)


def _described(obs: Any) -> str:
    if isinstance(obs, dict):
        return "{" + ", ".join(f"{k!r}: shape {np.shape(v)}" for k, v in obs.items()) + "}"
    return f"shape {np.shape(obs)}"


def _arrays(obs: Any) -> Any:
    """A numpy array of ``obs``, or a dict of them (a Dict observation)."""
    if isinstance(obs, dict):
        return {k: np.asarray(v) for k, v in obs.items()}
    return np.asarray(obs)


def load_policy(run_dir: str | Path, which: str = "best") -> Policy:
    """The best (or ``which="last"``) policy of a run directory."""
    run_dir = Path(run_dir)
    path = run_dir / "checkpoints" / f"{which}.pt"
    if not path.is_file():
        raise RunDirError(f"{str(run_dir)!r} has no checkpoints/{which}.pt")
    data = checkpoint.load(path)
    make_importable(data.get("module_dirs", []))  # the user's env or network, from elsewhere
    cfg = config_from_dict(data["config"])
    env_factory = EnvFactory.of(cfg.env)
    env = env_factory()
    try:
        model = build_model_for_env(cfg.model, env, cfg.env.observation_entries)
        model.load_state_dict(data["model"])
        return Policy(model, env_factory, cfg, env)
    finally:
        env.close()
