"""A shipped two-sub-step example env whose optimal return is known.

``env.id=impala_rl.envs.examples:ItemPlacementEnv`` (the ``multistep_example`` preset).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from impala_rl.envs.structured import ActorID, StructuredEnv

ITEM_VALUES = (0.2, 0.6, 1.0)
SLOT_FACTORS = (0.25, 0.5, 0.75, 1.0)


class ItemPlacementEnv(StructuredEnv):
    """Pick an item (step key 0), then the slot to put it in (step key 1); ``n_rounds`` rounds.

    Each round shuffles the item values ``(0.2, 0.6, 1.0)`` and the slot factors
    ``(0.25, 0.5, 0.75, 1.0)``. Sub-step 0 sees both (``[3 + 4]``) and picks one of 3 items;
    sub-step 1 sees the picked item's value and the slot factors (``[1 + 4]``) and picks one
    of 4 slots. The placement pays ``value * factor`` at sub-step 1 and nothing at sub-step 0,
    so the item policy learns only if the reward that follows its decision is credited to it.
    The best round pays ``1.0 * 1.0``: the optimal return is ``n_rounds`` (one agent).
    """

    def __init__(self, n_rounds: int = 2):
        if n_rounds < 1:
            raise ValueError(f"n_rounds must be >= 1, got {n_rounds}")
        self.n_rounds = n_rounds
        n_items, n_slots = len(ITEM_VALUES), len(SLOT_FACTORS)
        self.observation_spaces = {
            0: spaces.Box(0.0, 1.0, (n_items + n_slots,), np.float32),
            1: spaces.Box(0.0, 1.0, (1 + n_slots,), np.float32),
        }
        self.action_spaces = {0: spaces.Discrete(n_items), 1: spaces.Discrete(n_slots)}
        self.observation_space = self.observation_spaces[0]
        self.action_space = self.action_spaces[0]
        self.n_agents = 1
        self._rng = np.random.default_rng()
        self._sub_step = 0
        self._round = 0

    @property
    def optimal_return(self) -> float:
        return float(self.n_rounds)

    def _new_round(self) -> None:
        self._values = self._rng.permutation(np.asarray(ITEM_VALUES, dtype=np.float32))
        self._factors = self._rng.permutation(np.asarray(SLOT_FACTORS, dtype=np.float32))
        self._sub_step = 0

    def _obs(self) -> np.ndarray:
        if self._sub_step == 0:
            return np.concatenate([self._values, self._factors]).astype(np.float32)
        return np.concatenate([[self._values[self._item]], self._factors]).astype(np.float32)

    def actor_id(self) -> ActorID:
        return ActorID(step_key=self._sub_step, agent_id=0)

    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._round = 0
        self._new_round()
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        a = int(action)
        if self._sub_step == 0:
            if not 0 <= a < len(ITEM_VALUES):
                raise ValueError(f"item {a} out of range 0..{len(ITEM_VALUES) - 1}")
            self._item = a
            self._sub_step = 1
            return self._obs(), 0.0, False, False, {}
        if not 0 <= a < len(SLOT_FACTORS):
            raise ValueError(f"slot {a} out of range 0..{len(SLOT_FACTORS) - 1}")
        reward = float(self._values[self._item] * self._factors[a])
        self._round += 1
        terminated = self._round >= self.n_rounds
        self._new_round()
        return self._obs(), reward, terminated, False, {}
