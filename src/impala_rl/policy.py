"""A trained policy for use outside training, and the config a run was started with.

``load_policy(run_dir)`` builds the model of a run directory's checkpoint and wraps it in a
:class:`Policy` with ``act(obs, deterministic=...)``; ``load_run_config(run_dir)`` reads the
config a run was started with (for ``--resume``). Neither imports the training stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from impala_rl import checkpoint
from impala_rl.config import RunConfig, config_from_dict, to_dict
from impala_rl.decisions import DecisionStreams, LocalActing
from impala_rl.envs import EnvFactory
from impala_rl.envs.structured import is_structured
from impala_rl.nn import Model
from impala_rl.nn.factory import build_model_for_env
from impala_rl.nn.observations import any_tensor, as_obs, map_obs
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
    from impala_rl.config import load_config

    base = config_from_dict(data["config"])
    return load_config(base=to_dict(base), overrides=overrides) if overrides else base


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
        from impala_rl.envs.structured import KeyObservation

        built = env is None
        env = env_factory() if built else env
        self._key_observations = None
        self._n_agents = 1
        if is_structured(env):
            self._key_observations = {
                k: KeyObservation(s, k) for k, s in env.observation_spaces.items()
            }
            self._n_agents = int(env.n_agents)
        wrapped = isinstance(env, ModelObservation)
        self._raw_space = env.env.observation_space if wrapped else env.observation_space
        self._to_model = env.observation if wrapped else (lambda obs: obs)
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
    ) -> Any:
        """Action for one observation as the env returns it, or for a batch ``[N, *obs]`` of
        model-form observations; returned in the env's action format. ``last_reward`` (a
        number or ``[N]``) is the reward since the agent's previous decision, for models that
        read it. ``step_key`` and ``agent_id``: who acts (structured envs; one observation, its
        ``action_mask`` respected)."""
        model = self.model
        streams = None
        if self._key_observations is not None:
            step_key = self._step_key(step_key)
            if not 0 <= agent_id < self._n_agents:
                raise ValueError(f"agent_id={agent_id!r} is not one of 0..{self._n_agents - 1}")
            x, mask = self._key_observations[step_key](obs)
            x = map_obs(as_obs(x), lambda t: t.unsqueeze(0))
            mask = None if mask is None else torch.as_tensor(mask).unsqueeze(0)
            batched, n_envs, streams = False, 1, np.array([agent_id])
        else:
            step_key, mask = 0, None
            entries = getattr(model, "entry_shapes", None)
            if self._raw_space.contains(obs) if not isinstance(obs, torch.Tensor) else False:
                x = map_obs(as_obs(_arrays(self._to_model(obs))), lambda t: t.unsqueeze(0))
                batched = False
            elif entries:  # model-form Dict observations: {entry: [N, *o]} or one of them
                x = as_obs(_arrays(obs))
                name, shape = next(iter(entries.items()))
                batched = x[name].ndim > len(shape)
                if not batched:
                    x = map_obs(x, lambda t: t.unsqueeze(0))
            else:
                x = torch.as_tensor(np.asarray(obs))
                batched = x.ndim > len(model.obs_shape)
                if not batched:
                    x = x.unsqueeze(0)
            n_envs = any_tensor(x).shape[0]
        if self._streams is None or self._streams.num_envs != n_envs:  # new episodes
            self._streams = DecisionStreams(model, self._acting, n_envs, self._n_agents)
        elif last_reward is not None:
            reward = np.asarray(last_reward, dtype=np.float64).reshape(-1)
            self._streams.reported_rewards(reward, streams)
        self._acting.deterministic = deterministic
        acted, _ = self._streams.decide(step_key, x, mask, streams)
        return acted.env_action if batched else acted.env_action[0]

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
    cfg = config_from_dict(data["config"])
    env_factory = EnvFactory(cfg.env.id, cfg.env.kwargs, cfg.env.max_episode_steps, cfg.env.vector)
    env = env_factory()
    try:
        model = build_model_for_env(cfg.model, env)
        model.load_state_dict(data["model"])
        return Policy(model, env_factory, cfg, env)
    finally:
        env.close()
