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
- ``opponent: mixed``: each episode is a random-opponent game with probability
  ``random_opponent_prob`` (the learner's seat alternating), self-play otherwise; ``agent_id``
  is the seat in both, so one agent per seat learns from both kinds of games.

Observations with an ``action_mask`` keep it: the policy only picks legal moves.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import gymnasium
import numpy as np

from impala_rl.envs.spaces import (
    EnvError,
    assemble_leaves,
    flat_mask,
    is_composite,
    mask_layout,
    mask_width,
    space_leaves,
)
from impala_rl.envs.structured import ActorID, StructuredEnv

OPPONENTS = ("self_play", "random", "mixed")
REDEALS = 100
"""Games a reset deals at most until the learning seat gets a move against random opponents."""


def _import_aec(env: str, env_kwargs: dict[str, Any], field: str = "env.kwargs.env") -> Any:
    """The AEC env of module ``env`` (``field``: where the user gave it, for the errors)."""
    try:
        module = importlib.import_module(env)
    except ImportError as exc:
        missing = exc.name or ""
        if importlib.util.find_spec("pettingzoo") is None:
            hint = "PettingZoo envs need pip install 'impala-rl[pettingzoo]'"
        elif missing in ("", env) or env.startswith(f"{missing}."):
            hint = "no such module; a game is a module such as pettingzoo.classic.tictactoe_v3"
        elif env.startswith("pettingzoo.") and env.count(".") >= 2:  # a game's own package
            hint = f"the game needs {missing}: pip install 'pettingzoo[{env.split('.')[1]}]'"
        else:
            hint = f"it needs {missing}, which is not installed"
        raise EnvError(f"{field}={env!r}: cannot import it ({exc}); {hint}") from None
    if not hasattr(module, "env"):
        raise EnvError(f"{field}={env!r} has no env() constructor (an AEC env module)")
    try:
        return module.env(**env_kwargs)
    except ImportError as exc:  # a game that imports its package when built (Hanabi: OpenSpiel)
        raise EnvError(f"{field}={env!r}: {exc}") from None


class AECStructuredEnv(StructuredEnv):
    """A PettingZoo AEC env under the structured-env protocol (see the module docstring)."""

    def __init__(
        self,
        aec_env: Any,
        opponent: str = "self_play",
        policy_per_agent: bool = False,
        random_opponent_prob: float = 0.5,
    ):
        if opponent not in OPPONENTS:
            raise EnvError(f"env.kwargs.opponent={opponent!r}; valid: {' | '.join(OPPONENTS)}")
        self.aec = aec_env
        # attribute reads through PettingZoo's wrappers cost more than a tic-tac-toe move:
        # read the state from the raw env, step (and observe) through the wrappers
        self._raw = getattr(aec_env, "unwrapped", aec_env)
        self.opponent = opponent
        self.policy_per_agent = bool(policy_per_agent)
        self.seats = list(aec_env.possible_agents)
        n = len(self.seats)
        keys = range(n) if self.policy_per_agent else range(1)
        self.observation_spaces = {k: aec_env.observation_space(self.seats[k]) for k in keys}
        self.action_spaces = {k: aec_env.action_space(self.seats[k]) for k in keys}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        if not 0.0 <= random_opponent_prob <= 1.0:
            raise EnvError(
                f"env.kwargs.random_opponent_prob={random_opponent_prob!r}; valid: [0, 1]"
            )
        self.random_opponent_prob = float(random_opponent_prob)
        # a Discrete move goes to the env as an int (a board game's check); any other as is
        self._discrete = {
            seat: isinstance(aec_env.action_space(seat), gymnasium.spaces.Discrete)
            for seat in self.seats
        }
        self.n_agents = 1 if opponent == "random" else n
        self._vs_random = opponent == "random"
        self._rng = np.random.default_rng()
        self._learner_seat = n - 1  # the first reset without a seed moves it to seat 0
        self._return = 0.0

    # -- helpers -----------------------------------------------------------------------------
    def _seat(self) -> int:
        return self.seats.index(self._raw.agent_selection)

    def _over(self) -> bool:
        aec = self._raw
        if not aec.agents:
            return True
        return all(aec.terminations[a] or aec.truncations[a] for a in aec.agents)

    def _step_aec(self, action: Any, rewards: np.ndarray) -> None:
        """One AEC step, then dead steps for finished agents; rewards added per seat."""
        raw = self._raw
        self.aec.step(action)
        self._collect(rewards)
        while raw.agents and not self._over():
            agent = raw.agent_selection
            if not (raw.terminations[agent] or raw.truncations[agent]):
                break
            self.aec.step(None)
            self._collect(rewards)

    def _collect(self, rewards: np.ndarray) -> None:
        for agent, r in self._raw.rewards.items():
            rewards[self.seats.index(agent)] += float(r)

    def _random_move(self) -> Any:
        agent = self._raw.agent_selection
        obs = self.aec.observe(agent)
        mask = obs.get("action_mask") if isinstance(obs, dict) else None
        return self._move(agent, random_legal_move(self.aec.action_space(agent), mask, self._rng))

    def _move(self, agent: str, action: Any) -> Any:
        return int(action) if self._discrete[agent] else action

    def _play_opponents(self, rewards: np.ndarray) -> None:
        while not self._over() and self._seat() != self._learner_seat:
            self._step_aec(self._random_move(), rewards)

    def _observation(self) -> Any:
        agent = self._raw.agent_selection if self._raw.agents else self.seats[0]
        return self.aec.observe(agent)

    # -- the protocol ------------------------------------------------------------------------
    def actor_id(self) -> ActorID:
        seat = self._seat()
        key = seat if self.policy_per_agent else 0
        return ActorID(step_key=key, agent_id=0 if self.opponent == "random" else seat)

    def final_observation(self, agent_id: int) -> tuple[int, Any] | None:
        """The seat's ``observe(agent)`` after a truncation, for its last decision's bootstrap."""
        seat = self._learner_seat if self.opponent == "random" else agent_id
        try:
            obs = self.aec.observe(self.seats[seat])
        except Exception:  # an AEC env that cannot observe a finished agent: termination
            return None
        return (seat if self.policy_per_agent else 0), obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
            self._learner_seat = seed % len(self.seats)
        else:
            self._learner_seat = (self._learner_seat + 1) % len(self.seats)
        self.aec.reset(seed=seed)
        self._return = 0.0
        if self.opponent == "mixed":
            self._vs_random = bool(self._rng.random() < self.random_opponent_prob)
        if self._vs_random:
            for _ in range(REDEALS):
                self._play_opponents(np.zeros(len(self.seats)))
                if not self._over():
                    break
                # the opponents ended the game before the learner's first move (a poker fold):
                # no decision to learn from, so the game is dealt again (seeded from the env's)
                self.aec.reset(seed=int(self._rng.integers(2**31)))
            else:
                raise EnvError(
                    f"the random opponents ended {REDEALS} games in a row before the learning "
                    "seat moved"
                )
        return self._observation(), {}

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        rewards = np.zeros(len(self.seats))
        self._step_aec(self._move(self._raw.agent_selection, action), rewards)
        if self._vs_random:
            self._play_opponents(rewards)
        info: dict[str, Any] = {}
        over = self._over()
        terminated = over and any(self._raw.terminations.values())
        truncated = over and not terminated
        if self._vs_random:
            self._return += float(rewards[self._learner_seat])
            if over:
                info["win"] = self._return > 0
        reward: Any = float(rewards[self._learner_seat]) if self.n_agents == 1 else rewards
        return self._observation(), reward, terminated, truncated, info

    def close(self) -> None:
        self.aec.close()


def random_legal_move(space: gymnasium.Space, mask: Any, rng: np.random.Generator) -> Any:
    """A uniformly random move of ``space`` that ``mask`` allows, drawn from ``rng`` (the env's
    seeded generator, so a seeded game replays).

    ``mask``: ``None``, or 0/1 per action of a ``Discrete`` or per value of each
    ``MultiDiscrete`` dimension (concatenated, as the policy reads it; a tuple of per-dimension
    masks is taken too), or two per bit of a ``MultiBinary`` (may it be 0, may it be 1), or for
    a ``Tuple`` or ``Dict`` one those of its Discrete, MultiDiscrete and MultiBinary parts
    (:func:`~impala_rl.envs.spaces.flat_mask`), each part drawn on its own. Other spaces, and
    an unmasked MultiBinary, take the space's own sampler, seeded from ``rng``.
    """
    if isinstance(space, gymnasium.spaces.Discrete):
        n = int(space.n)
        legal = np.arange(n) if mask is None else np.flatnonzero(np.asarray(mask).reshape(-1))
        if legal.size == 0:
            raise EnvError("the opponent's action_mask allows no move")
        return int(space.start) + int(rng.choice(legal))
    if is_composite(space):  # each part as its own space, a masked one on its own mask
        widths = [w for _, w in mask_layout(space)]
        masks = iter([] if mask is None else np.split(flat_mask(space, mask), np.cumsum(widths)))
        moves = [
            random_legal_move(leaf, None if mask_width(leaf) is None else next(masks, None), rng)
            for _, leaf in space_leaves(space)
        ]
        return assemble_leaves(space, iter(moves))
    if isinstance(space, gymnasium.spaces.MultiBinary) and mask is not None:
        two_values = gymnasium.spaces.MultiDiscrete(np.full(space.shape, 2))  # as the mask reads
        return random_legal_move(two_values, mask, rng).astype(space.dtype)
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        nvec = np.asarray(space.nvec).reshape(-1)
        if mask is None:
            parts = [np.ones(int(n), bool) for n in nvec]
        elif isinstance(mask, (tuple, list)):
            parts = [np.asarray(m).reshape(-1).astype(bool) for m in mask]
        else:
            parts = np.split(np.asarray(mask).reshape(-1).astype(bool), np.cumsum(nvec)[:-1])
        if any(not part.any() for part in parts):
            raise EnvError("the opponent's action_mask allows no value for a dimension")
        values = [int(rng.choice(np.flatnonzero(part))) for part in parts]
        move = np.asarray(values, dtype=space.dtype).reshape(np.shape(space.nvec))
        return move + np.asarray(space.start, dtype=space.dtype)
    space.seed(int(rng.integers(2**31)))
    return space.sample()


def make_aec_env(
    env: str = "pettingzoo.classic.tictactoe_v3",
    env_kwargs: dict[str, Any] | None = None,
    opponent: str = "self_play",
    policy_per_agent: bool = False,
    random_opponent_prob: float = 0.5,
    *,
    game_field: str = "env.kwargs.env",
) -> AECStructuredEnv:
    """The AEC env ``env`` (a module with ``env(**env_kwargs)``) as a structured env;
    ``game_field``: where the user named the game (``env.id`` for
    ``env.id=pettingzoo.classic.connect_four_v3``), for the errors."""
    return AECStructuredEnv(
        _import_aec(env, dict(env_kwargs or {}), game_field),
        opponent,
        policy_per_agent,
        random_opponent_prob,
    )
