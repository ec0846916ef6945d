"""PettingZoo turn-based (AEC) environments as structured envs.

``env.id=impala_rl.envs.pettingzoo:make_aec_env`` with ``env.kwargs.env`` naming the AEC env
module (``pettingzoo.classic.tictactoe_v3``, the default). Needs ``pip install
'impala-rl[pettingzoo]'``.

Two ways to play:

- ``opponent: self_play``: every seat is a learning agent (``agent_id`` = seat index), so each
  agent's own decisions form its V-trace sequence and the rewards of the final move reach
  both players. ``policy_per_agent: true`` gives each seat its own policy (step key = seat),
  otherwise one policy plays every seat (step key 0; the observation is the acting player's
  view, as PettingZoo's classic games give it).
- ``opponent: random``: one learning agent (``agent_id`` 0) against uniformly random legal
  moves, made inside the env. Its seat alternates from episode to episode (a reset with a seed
  takes the seat ``seed % n_seats``). At the end of a game ``info["win"]`` says whether the
  learner won: the evaluator reports it as ``eval_win_rate``.

Observations with an ``action_mask`` keep it: the policy only picks legal moves.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from impala_rl.envs.factory import EnvError
from impala_rl.envs.structured import ActorID, StructuredEnv

OPPONENTS = ("self_play", "random")


def _import_aec(env: str, env_kwargs: dict[str, Any]) -> Any:
    try:
        module = importlib.import_module(env)
    except ImportError as exc:
        raise EnvError(
            f"env.kwargs.env={env!r}: cannot import it ({exc}); PettingZoo envs need "
            "pip install 'impala-rl[pettingzoo]'"
        ) from None
    if not hasattr(module, "env"):
        raise EnvError(f"env.kwargs.env={env!r} has no env() constructor (an AEC env module)")
    return module.env(**env_kwargs)


class AECStructuredEnv(StructuredEnv):
    """A PettingZoo AEC env under the structured-env protocol (see the module docstring)."""

    def __init__(
        self,
        aec_env: Any,
        opponent: str = "self_play",
        policy_per_agent: bool = False,
    ):
        if opponent not in OPPONENTS:
            raise EnvError(f"env.kwargs.opponent={opponent!r}; valid: {' | '.join(OPPONENTS)}")
        self.aec = aec_env
        self.opponent = opponent
        self.policy_per_agent = bool(policy_per_agent)
        self.seats = list(aec_env.possible_agents)
        n = len(self.seats)
        keys = range(n) if self.policy_per_agent else range(1)
        self.observation_spaces = {k: aec_env.observation_space(self.seats[k]) for k in keys}
        self.action_spaces = {k: aec_env.action_space(self.seats[k]) for k in keys}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        self.n_agents = n if opponent == "self_play" else 1
        self._rng = np.random.default_rng()
        self._learner_seat = n - 1  # the first reset without a seed moves it to seat 0
        self._return = 0.0

    # -- helpers -----------------------------------------------------------------------------
    def _seat(self) -> int:
        return self.seats.index(self.aec.agent_selection)

    def _over(self) -> bool:
        aec = self.aec
        if not aec.agents:
            return True
        return all(aec.terminations[a] or aec.truncations[a] for a in aec.agents)

    def _step_aec(self, action: Any, rewards: np.ndarray) -> None:
        """One AEC step, then dead steps for finished agents; rewards added per seat."""
        aec = self.aec
        aec.step(action)
        self._collect(rewards)
        while aec.agents and not self._over():
            agent = aec.agent_selection
            if not (aec.terminations[agent] or aec.truncations[agent]):
                break
            aec.step(None)
            self._collect(rewards)

    def _collect(self, rewards: np.ndarray) -> None:
        for agent, r in self.aec.rewards.items():
            rewards[self.seats.index(agent)] += float(r)

    def _random_move(self) -> int:
        agent = self.aec.agent_selection
        obs = self.aec.observe(agent)
        mask = obs.get("action_mask") if isinstance(obs, dict) else None
        if mask is None:
            return int(self.aec.action_space(agent).sample())
        return int(self._rng.choice(np.flatnonzero(mask)))

    def _play_opponents(self, rewards: np.ndarray) -> None:
        while not self._over() and self._seat() != self._learner_seat:
            self._step_aec(self._random_move(), rewards)

    def _observation(self) -> Any:
        agent = self.aec.agent_selection if self.aec.agents else self.seats[0]
        return self.aec.observe(agent)

    # -- the protocol ------------------------------------------------------------------------
    def actor_id(self) -> ActorID:
        seat = self._seat()
        key = seat if self.policy_per_agent else 0
        return ActorID(step_key=key, agent_id=seat if self.opponent == "self_play" else 0)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
            self._learner_seat = seed % len(self.seats)
        else:
            self._learner_seat = (self._learner_seat + 1) % len(self.seats)
        self.aec.reset(seed=seed)
        self._return = 0.0
        if self.opponent == "random":
            rewards = np.zeros(len(self.seats))
            self._play_opponents(rewards)
        return self._observation(), {}

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        rewards = np.zeros(len(self.seats))
        self._step_aec(int(action), rewards)
        if self.opponent == "random":
            self._play_opponents(rewards)
        info: dict[str, Any] = {}
        over = self._over()
        terminated = over and any(self.aec.terminations.values())
        truncated = over and not terminated
        if self.opponent == "random":
            reward: Any = float(rewards[self._learner_seat])
            self._return += reward
            if over:
                info["win"] = self._return > 0
        else:
            reward = rewards
        return self._observation(), reward, terminated, truncated, info

    def close(self) -> None:
        self.aec.close()


def make_aec_env(
    env: str = "pettingzoo.classic.tictactoe_v3",
    env_kwargs: dict[str, Any] | None = None,
    opponent: str = "self_play",
    policy_per_agent: bool = False,
) -> AECStructuredEnv:
    """The AEC env ``env`` (a module with ``env(**env_kwargs)``) as a structured env."""
    return AECStructuredEnv(_import_aec(env, dict(env_kwargs or {})), opponent, policy_per_agent)
