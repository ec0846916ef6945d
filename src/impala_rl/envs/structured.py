"""Structured (multi-step, multi-agent) environments: the protocol and its vector env.

An environment step may be made of several **sub-steps**, each with its own observation and
action space and its own policy (a hierarchical decision: first pick an item, then where to
put it), or of several **agents** acting in turn. A :class:`StructuredEnv` says, before each
sub-step, who acts: :meth:`StructuredEnv.actor_id` returns the ``step_key`` (which policy and
which spaces) and the ``agent_id`` (whose rewards and whose decision sequence).

The protocol, in Gymnasium terms:

- ``observation_spaces[k]`` / ``action_spaces[k]``: the spaces of step key ``k``; the keys are
  ``0..K-1``. ``observation_space`` / ``action_space`` are those of key 0 (for tools that
  expect one).
- ``n_agents``: how many agents receive rewards (1 for a hierarchical single-agent env).
- ``reset()`` returns the observation of the first actor; ``step(action)`` takes the action of
  the current actor and returns the observation of the **next** actor, the reward (a float
  that every agent receives, or an array ``[n_agents]`` of per-agent rewards),
  ``terminated`` and ``truncated`` for the whole episode, and an info dict.
- ``final_observation(agent_id)``, asked after a truncating step (before the reset), gives
  that agent's final ``(step_key, observation)``; without it truncation is termination.
- ``actor_id()`` is the actor that acts next; ``is_actor_done()``, asked after a step, says
  whether the actor that made that step takes no more decisions in this episode (an agent
  eliminated while the others play on). It defaults to ``False``.
- A ``Dict`` observation with an ``action_mask`` entry (``[n]`` of 0/1 for a ``Discrete(n)``
  action space; for a ``MultiDiscrete`` one per value of each dimension, concatenated)
  restricts that sub-step's policy to the legal actions. The other entries reach
  the network as a plain env's Dict does, an encoder each (one entry left: as that entry).

A plain Gymnasium env is the case of one agent whose step key 0 decides at every step:
:class:`SingleKeyVectorEnv` presents a plain vector env under :class:`StructuredVectorEnv`'s
contract, stepping every env in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from impala_rl.envs.spaces import (
    EnvError,
    ObservationConverter,
    flat_mask,
    mask_layout,
    mask_width,
    space_leaves,
)

ACTION_MASK = "action_mask"


class ActorID(NamedTuple):
    """Who acts at a sub-step: the policy / spaces (``step_key``) and the agent."""

    step_key: int
    agent_id: int


class StructuredEnv(gym.Env):
    """Base class of the structured-env protocol (see the module docstring).

    Subclasses set ``observation_spaces``, ``action_spaces`` (dicts keyed ``0..K-1``),
    ``n_agents``, and implement ``reset``, ``step`` and :meth:`actor_id`.
    """

    observation_spaces: dict[int, spaces.Space]
    action_spaces: dict[int, spaces.Space]
    n_agents: int = 1

    def actor_id(self) -> ActorID:
        """The actor that takes the next sub-step."""
        raise NotImplementedError

    def is_actor_done(self) -> bool:
        """After a step: the actor that made it takes no more decisions this episode."""
        return False

    def final_observation(self, agent_id: int) -> tuple[int, Any] | None:
        """After a truncating step: ``(step_key, observation)`` agent ``agent_id`` would
        decide on next, so its last decision bootstraps from it; ``None`` (the default) makes
        truncation end that agent's segment like termination."""
        return None


def is_structured(env: Any) -> bool:
    """Whether ``env`` implements the structured-env protocol."""
    return isinstance(env, StructuredEnv)


def check_mask_fits(mask_space: spaces.Space, action_space: spaces.Space, where: str) -> None:
    """An :class:`EnvError` unless an ``action_mask`` of ``mask_space`` covers ``action_space``:
    one entry per action of each of its ``Discrete`` and ``MultiDiscrete`` parts and two per
    bit of its ``MultiBinary`` ones (:func:`~impala_rl.envs.spaces.mask_layout`), flat and
    concatenated, or a ``Tuple`` of those parts' masks in order, or a ``Dict`` keyed as the
    action's masked parts."""
    layout = mask_layout(action_space)
    needs = " + ".join(f"{w} for {p or 'its actions'}" for p, w in layout) or "no mask"
    parts = [(p, int(spaces.flatdim(leaf))) for p, leaf in space_leaves(mask_space)]
    size = sum(w for _, w in parts)
    if isinstance(mask_space, spaces.Dict):  # keyed as the masked parts
        fits = parts == layout
    elif isinstance(mask_space, spaces.Tuple):  # the masked parts in order
        fits = [w for _, w in parts] == [w for _, w in layout]
    else:
        fits = bool(layout) and size == sum(w for _, w in layout)
    if not fits:
        nested = isinstance(mask_space, (spaces.Dict, spaces.Tuple))
        got = f"{size} entries" + (
            f" ({', '.join(f'{p}: {w}' for p, w in parts)})" if nested else ""
        )
        raise EnvError(
            f"{where} has an action_mask of {got}; its action space {action_space} needs "
            f"{needs} (0/1 per action of its Discrete and MultiDiscrete parts, two per bit of "
            "its MultiBinary parts: may it be 0, may it be 1)"
        )


def has_action_mask(space: spaces.Space) -> bool:
    """A ``Dict`` observation space with an ``action_mask`` entry."""
    return isinstance(space, spaces.Dict) and ACTION_MASK in space.spaces


class MaskedActionsEnv(gym.Wrapper, StructuredEnv):
    """A plain env whose Dict observation has an ``action_mask``, as the protocol's case of
    one step key and one agent, so the mask reaches the policy as a structured env's does."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.mask_from = getattr(env, "mask_from", "the observation's action_mask")
        self.observation_spaces = {0: env.observation_space}
        self.action_spaces = {0: env.action_space}
        self._last: Any = None

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._last = obs
        return obs, reward, terminated, truncated, info

    def actor_id(self) -> ActorID:
        return ActorID(0, 0)

    def final_observation(self, agent_id: int) -> tuple[int, Any] | None:
        """The truncating step's observation: the last decision bootstraps from it."""
        return 0, self._last


MASK_METHOD = "action_masks"
"""sb3-contrib's name for an env's method that returns the legal actions (MaskablePPO)."""

OBSERVATION_ENTRY = "obs"
"""The entry a non-Dict observation takes beside a mask the env gives outside it."""


def outside_mask_source(env: gym.Env, info: dict | None) -> str | None:
    """Where a plain env gives its legal actions outside its observation: ``"method"`` (an
    ``action_masks()`` method, sb3-contrib's convention), ``"info"`` (``info["action_mask"]``
    at reset, Gymnasium's Taxi's), else ``None``. ``info``: the info of one reset (``None``:
    not looked at)."""
    if mask_width(env.action_space) is None or has_action_mask(env.observation_space):
        return None
    try:
        method = env.get_wrapper_attr(MASK_METHOD)
    except AttributeError:
        method = None
    if callable(method):
        return "method"
    if isinstance(info, dict) and ACTION_MASK in info:
        return "info"
    return None


class OutsideActionMask(gym.Wrapper):
    """A plain env whose legal actions come beside its observation (``source``: ``"info"``,
    ``info["action_mask"]`` at reset and every step; ``"method"``, its ``action_masks()``
    after each), as an env whose Dict observation has an ``action_mask`` entry: the
    observation's entries (or :data:`OBSERVATION_ENTRY` for a non-Dict one) and the mask, so
    :class:`MaskedActionsEnv` applies it."""

    def __init__(self, env: gym.Env, source: str):
        super().__init__(env)
        self.source = source
        self.mask_from = f"its {MASK_METHOD}()" if source == "method" else "info's action_mask"
        width = mask_width(env.action_space)
        mask_space = spaces.Box(0, 1, (width,), np.int8)
        inner = env.observation_space
        entries = inner.spaces if isinstance(inner, spaces.Dict) else {OBSERVATION_ENTRY: inner}
        self.observation_space = spaces.Dict({**entries, ACTION_MASK: mask_space})
        self.width = width

    def with_mask(self, obs: Any, mask: Any, when: str) -> dict:
        """``obs`` as this wrapper observes it: its entries and ``mask`` (checked), as the
        env's steps give them and as :meth:`~impala_rl.policy.Policy.act` takes them apart."""
        mask = flat_mask(self.env.action_space, mask)
        if mask.shape != (self.width,):
            raise EnvError(
                f"the action_mask ({self.source}) has {mask.size} entries at {when}; "
                f"{self.env.action_space} needs {self.width} (0/1 per action)"
            )
        entries = dict(obs) if isinstance(obs, dict) else {OBSERVATION_ENTRY: obs}
        return {**entries, ACTION_MASK: mask.astype(np.int8)}

    def _mask(self, info: dict, when: str) -> Any:
        if self.source == "method":
            return self.env.get_wrapper_attr(MASK_METHOD)()
        if ACTION_MASK not in info:
            raise EnvError(
                f"{self.env.spec.id if self.env.spec else type(self.env.unwrapped).__name__}: "
                f"{when}'s info has no 'action_mask' (its reset's had one); give it at every "
                "step, or set env.info_action_mask=false to act without a mask"
            )
        return info[ACTION_MASK]

    def reset(self, **kwargs: Any) -> tuple[dict, dict]:
        obs, info = self.env.reset(**kwargs)
        return self.with_mask(obs, self._mask(info, "reset"), "reset"), info

    def step(self, action: Any) -> tuple[dict, Any, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        obs = self.with_mask(obs, self._mask(info, "a step"), "a step")
        return obs, reward, terminated, truncated, info


class KeyObservation:
    """Converts one step key's observations to the model's form plus a mask.

    ``space`` is the model's observation space of the key (a ``Box``, or a ``Dict`` that keeps
    its entries: :class:`~impala_rl.envs.spaces.ObservationConverter`); ``mask_size`` is the
    number of entries of its ``action_mask`` (``None`` without one), which the policy reads
    flat: a ``Dict`` or ``Tuple`` mask (one part per masked part of a composite action) is
    concatenated in its space's order; ``entries`` is ``env.observation_entries``.
    """

    def __init__(self, source: spaces.Space, key: int, entries: bool = True):
        self.source = source
        self.mask_size: int | None = None
        self.mask_space: spaces.Space | None = None
        self._nested_mask = False
        rest = source
        if has_action_mask(source):
            self.mask_space = source.spaces[ACTION_MASK]
            self.mask_size = int(spaces.flatdim(self.mask_space))
            self._nested_mask = isinstance(self.mask_space, (spaces.Dict, spaces.Tuple))
            rest = spaces.Dict({k: v for k, v in source.spaces.items() if k != ACTION_MASK})
            if len(rest.spaces) == 1:
                rest = next(iter(rest.spaces.values()))
        if isinstance(rest, spaces.Dict) and not rest.spaces:
            raise EnvError(f"observation_spaces[{key}] has nothing but an action_mask")
        self.rest = rest
        self._convert = ObservationConverter(rest, entries)
        self.space = self._convert.space
        self.dropped = self._convert.dropped

    def __call__(self, obs: Any) -> tuple[Any, np.ndarray | None]:
        """The model's form of ``obs`` (an array, or a dict of arrays) and its mask."""
        mask = None
        if self.mask_size is not None:
            mask = obs[ACTION_MASK]
            if self._nested_mask:
                mask = spaces.flatten(self.mask_space, mask)
            mask = np.asarray(mask).reshape(-1).astype(bool)
            obs = {k: v for k, v in obs.items() if k != ACTION_MASK}
            if not isinstance(self.rest, spaces.Dict):
                obs = next(iter(obs.values()))
        converted = self._convert(obs)
        return converted if isinstance(converted, dict) else np.asarray(converted), mask


def _zeros(n: int, space: spaces.Space) -> Any:
    """``[n, *o]`` zeros of a model space: an array, or a dict of them for a ``Dict``."""
    if isinstance(space, spaces.Dict):
        return {name: _zeros(n, sub) for name, sub in space.spaces.items()}
    return np.zeros((n, *space.shape), dtype=space.dtype)


def _put(into: Any, i: int, obs: Any) -> None:
    """``into[i] = obs``, per entry for a Dict observation."""
    if isinstance(into, dict):
        for name, value in into.items():
            value[i] = obs[name]
    else:
        into[i] = obs


class StructuredVectorEnv:
    """``num_envs`` structured envs stepped in turn, with same-step autoreset.

    After :meth:`reset` and every :meth:`step`, ``step_key[i]`` / ``agent_id[i]`` say who acts
    next in env ``i`` and ``obs[k][i]`` (``[N, *o_k]``) / ``masks[k][i]`` (``[N, n_k]``) hold
    its observation in the slot of its step key (a dict of such arrays for a key whose
    observation is a Dict); the entries of other keys are stale.
    """

    def __init__(self, factories: Sequence[Callable[[], gym.Env]], entries: bool = True):
        self.envs = [factory() for factory in factories]
        self.num_envs = n = len(self.envs)
        first = self.envs[0]
        check_structured_env(first)
        self.step_keys = sorted(first.observation_spaces)
        self.n_agents = int(first.n_agents)
        self.key_obs = {
            k: KeyObservation(first.observation_spaces[k], k, entries) for k in self.step_keys
        }
        self.action_spaces = dict(first.action_spaces)
        self.obs = {k: _zeros(n, c.space) for k, c in self.key_obs.items()}
        self.masks = {
            k: np.ones((n, c.mask_size), dtype=bool)
            for k, c in self.key_obs.items()
            if c.mask_size is not None
        }
        self.step_key = np.zeros(n, dtype=np.int64)
        self.agent_id = np.zeros(n, dtype=np.int64)
        self.final_obs: dict[int, dict[int, tuple[int, Any, np.ndarray | None]]] = {}
        """After :meth:`step`: env -> agent -> ``(step_key, obs, mask)`` where truncated."""
        self.single_observation_space = self.key_obs[self.step_keys[0]].space
        self.single_action_space = self.action_spaces[self.step_keys[0]]

    def _write(self, i: int, obs: Any) -> None:
        env = self.envs[i]
        key, agent = env.actor_id()
        if key not in self.key_obs:
            raise EnvError(
                f"env {i}: actor_id() returned step_key {key!r}; valid: {self.step_keys}"
            )
        if not 0 <= agent < self.n_agents:
            raise EnvError(
                f"env {i}: actor_id() returned agent_id {agent!r}; valid: 0..{self.n_agents - 1}"
            )
        converted, mask = self.key_obs[key](obs)
        _put(self.obs[key], i, converted)
        if mask is not None:
            self.masks[key][i] = mask
        self.step_key[i] = key
        self.agent_id[i] = agent

    def reset(self, seed: int | None = None) -> None:
        for i, env in enumerate(self.envs):
            try:
                obs, _ = env.reset(seed=None if seed is None else seed + i)
                self._write(i, obs)
            except EnvError:
                raise
            except Exception as exc:
                raise EnvError(f"env {i} raised {type(exc).__name__} in reset: {exc}") from exc

    def _rewards(self, i: int, reward: Any) -> np.ndarray:
        r = np.asarray(reward, dtype=np.float64)
        if r.ndim == 0:
            return np.full(self.n_agents, float(r))
        if r.shape != (self.n_agents,):
            raise EnvError(
                f"env {i}: step returned rewards of shape {r.shape}; valid: a float or "
                f"an array of shape ({self.n_agents},) (one per agent)"
            )
        return r

    def step(
        self, actions: Sequence[Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, dict]]:
        """Step env ``i`` with ``actions[i]`` (the action of its current actor).

        Returns ``rewards [N, n_agents]``, ``terminated [N]``, ``truncated [N]``,
        ``actor_done [N]`` (the actor that just acted is done) and the final info of every
        env whose episode ended, by env index.
        """
        n = self.num_envs
        rewards = np.zeros((n, self.n_agents), dtype=np.float64)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        actor_done = np.zeros(n, dtype=bool)
        final_infos: dict[int, dict] = {}
        self.final_obs = {}
        for i, env in enumerate(self.envs):
            try:
                obs, reward, term, trunc, info = env.step(actions[i])
                rewards[i] = self._rewards(i, reward)
                actor_done[i] = bool(env.is_actor_done())
                if trunc and not term:
                    self.final_obs[i] = self._final_observations(env)
                if term or trunc:
                    final_infos[i] = info
                    obs, _ = env.reset()
                self._write(i, obs)
            except EnvError:
                raise
            except Exception as exc:
                raise EnvError(f"env {i} raised {type(exc).__name__} in step: {exc}") from exc
            terminated[i] = term
            truncated[i] = trunc
        return rewards, terminated, truncated, actor_done, final_infos

    def _final_observations(self, env: Any) -> dict[int, tuple[int, Any, np.ndarray | None]]:
        finals = {}
        for agent in range(self.n_agents):
            final = env.final_observation(agent)
            if final is not None:
                key, obs = final
                array, mask = self.key_obs[key](obs)
                finals[agent] = (key, array, mask)
        return finals

    def close(self) -> None:
        for env in self.envs:
            env.close()


class SingleKeyVectorEnv:
    """A plain vector env (``make_vector_env``) under :class:`StructuredVectorEnv`'s contract:
    one agent, step key 0 at every step, no action masks. ``obs[0]`` is the wrapped env's
    observation array (which it may overwrite at the next step)."""

    step_keys = (0,)
    n_agents = 1

    def __init__(self, envs: Any):
        self.envs = envs
        self.num_envs = n = int(envs.num_envs)
        self.step_key = np.zeros(n, dtype=np.int64)
        self.agent_id = np.zeros(n, dtype=np.int64)
        self.obs: dict[int, np.ndarray] = {}
        self.masks: dict[int, np.ndarray] = {}
        self.final_obs: dict[int, dict[int, tuple[int, Any, np.ndarray | None]]] = {}
        self.single_observation_space = envs.single_observation_space
        self.single_action_space = envs.single_action_space

    def reset(self, seed: int | None = None) -> None:
        self.obs[0], _ = self.envs.reset(seed=seed)

    def step(
        self, actions: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, dict]]:
        """:meth:`StructuredVectorEnv.step` for ``actions [N, ...]``: every env at once."""
        obs, reward, terminated, truncated, _ = self.envs.step(actions)
        self.obs[0] = obs
        rewards = np.asarray(reward, dtype=np.float64).reshape(self.num_envs, 1)
        return rewards, terminated, truncated, np.zeros(self.num_envs, dtype=bool), {}

    def close(self) -> None:
        self.envs.close()


def check_structured_env(env: Any) -> None:
    """Raise :class:`EnvError` naming what is wrong with a structured env's declarations."""
    name = type(env).__name__
    obs_spaces = getattr(env, "observation_spaces", None)
    act_spaces = getattr(env, "action_spaces", None)
    if not isinstance(obs_spaces, dict) or not isinstance(act_spaces, dict) or not obs_spaces:
        raise EnvError(
            f"{name}: a StructuredEnv needs observation_spaces and action_spaces dicts keyed by "
            "step key"
        )
    keys = sorted(obs_spaces)
    if keys != list(range(len(keys))) or sorted(act_spaces) != keys:
        raise EnvError(
            f"{name}: step keys must be 0..K-1 in both observation_spaces and action_spaces, "
            f"got {sorted(obs_spaces)} and {sorted(act_spaces)}"
        )
    if int(getattr(env, "n_agents", 1)) < 1:
        raise EnvError(f"{name}: n_agents must be >= 1, got {env.n_agents!r}")
    for k in keys:
        mask_space = KeyObservation(obs_spaces[k], k).mask_space
        if mask_space is not None:
            check_mask_fits(mask_space, act_spaces[k], f"{name}: step key {k}")
