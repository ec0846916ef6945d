"""Plain Gymnasium envs whose Dict observation carries an ``action_mask``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

N_ACTIONS = 5


class BestLegalEnv(gym.Env):
    """Each step 3 of 5 actions are legal, at random, and each action has a shown value; the
    reward is the chosen action's value, and an illegal choice pays -1 (counted in
    ``illegal``; ``strict=True`` raises instead). The best legal action earns 0.75 a step on
    average (6 an episode of 8), a random legal one 0.5 (4). ``multi=True``: the action is
    MultiDiscrete([5, 2]) and its second dimension's value 1 is never legal (the mask has 7
    entries: the 5 choices', then [1, 0])."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8, strict: bool = False, multi: bool = False):
        width = N_ACTIONS + (2 if multi else 0)
        self.observation_space = spaces.Dict(
            {
                "values": spaces.Box(0.0, 1.0, (N_ACTIONS,), np.float32),
                "action_mask": spaces.MultiBinary(width),
            }
        )
        self.action_space = spaces.MultiDiscrete([N_ACTIONS, 2]) if multi else spaces.Discrete(5)
        self.length, self.strict, self.multi = length, strict, multi
        self.t = 0
        self.illegal = 0
        self.legal = np.ones(N_ACTIONS, bool)

    def _obs(self) -> dict:
        self.values = self.np_random.uniform(0.0, 1.0, N_ACTIONS).astype(np.float32)
        self.legal = np.zeros(N_ACTIONS, bool)
        self.legal[self.np_random.permutation(N_ACTIONS)[: N_ACTIONS // 2 + 1]] = True
        mask = self.legal.astype(np.int8)
        if self.multi:
            mask = np.concatenate([mask, np.array([1, 0], np.int8)])
        return {"values": self.values.copy(), "action_mask": mask}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        choice, extra = (int(action[0]), int(action[1])) if self.multi else (int(action), 0)
        if not self.legal[choice] or extra:
            if self.strict:
                raise ValueError(f"illegal action {action!r}")
            self.illegal += 1
            reward = -1.0
        else:
            reward = float(self.values[choice])
        self.t += 1
        return self._obs(), reward, False, self.t >= self.length, {}


def make_env(length: int = 8, strict: bool = False, multi: bool = False) -> gym.Env:
    return BestLegalEnv(length, strict, multi)


def make_mismatched_env() -> gym.Env:
    """A mask of 6 entries for 5 actions."""
    env = BestLegalEnv()
    env.observation_space = spaces.Dict(
        {
            "values": spaces.Box(0.0, 1.0, (N_ACTIONS,), np.float32),
            "action_mask": spaces.MultiBinary(N_ACTIONS + 1),
        }
    )
    return env


class PartsEnv(gym.Env):
    """A Dict action of a choice, an amount and a slot: 3 of 5 choices are legal each step, at
    random, and the slot is one of 3 of which only the shown one is legal. The reward is the
    chosen value, plus 0.25 when the amount is within 0.25 of the shown target; an illegal
    choice or slot pays -1 (``strict=True`` raises instead). The best legal play earns 1.0 a
    step on average (8 an episode of 8); the best legal choice with the amount at random 0.81
    (6.5), a random legal choice and amount 0.56 (4.5).

    The mask covers the action's Discrete parts: ``nested=False`` one array of 8 entries (the
    choice's 5, then the slot's 3, the action space's order), ``nested=True`` a Dict keyed as
    the action (``{"choice": 5, "slot": 3}``)."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8, strict: bool = False, nested: bool = False):
        self.action_space = spaces.Dict(
            {
                "choice": spaces.Discrete(N_ACTIONS),
                "amount": spaces.Box(-1.0, 1.0, (1,), np.float32),
                "slot": spaces.Discrete(3),
            }
        )
        mask_space: spaces.Space = spaces.MultiBinary(N_ACTIONS + 3)
        if nested:
            mask_space = spaces.Dict(
                {"choice": spaces.MultiBinary(N_ACTIONS), "slot": spaces.MultiBinary(3)}
            )
        self.observation_space = spaces.Dict(
            {
                "values": spaces.Box(0.0, 1.0, (N_ACTIONS,), np.float32),
                "target": spaces.Box(-1.0, 1.0, (1,), np.float32),
                "action_mask": mask_space,
            }
        )
        self.length, self.strict, self.nested = length, strict, nested
        self.t = 0

    def _obs(self) -> dict:
        rng = self.np_random
        self.values = rng.uniform(0.0, 1.0, N_ACTIONS).astype(np.float32)
        self.target = rng.uniform(-0.5, 0.5, (1,)).astype(np.float32)
        self.legal = np.zeros(N_ACTIONS, bool)
        self.legal[rng.permutation(N_ACTIONS)[: N_ACTIONS // 2 + 1]] = True
        self.slot = int(rng.integers(3))
        choice, slot = self.legal.astype(np.int8), np.eye(3, dtype=np.int8)[self.slot]
        mask = {"choice": choice, "slot": slot} if self.nested else np.concatenate([choice, slot])
        return {"values": self.values.copy(), "target": self.target.copy(), "action_mask": mask}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        choice, slot = int(action["choice"]), int(action["slot"])
        if not self.legal[choice] or slot != self.slot:
            if self.strict:
                raise ValueError(f"illegal action {action!r}")
            reward = -1.0
        else:
            near = abs(float(np.asarray(action["amount"]).reshape(-1)[0]) - self.target[0])
            reward = float(self.values[choice]) + (0.25 if near <= 0.25 else 0.0)
        self.t += 1
        return self._obs(), reward, False, self.t >= self.length, {}


def make_parts_env(length: int = 8, strict: bool = False, nested: bool = False) -> gym.Env:
    return PartsEnv(length, strict, nested)


def make_mismatched_parts_env() -> gym.Env:
    """A Dict mask whose slot part is keyed as no part of the action."""
    env = PartsEnv(nested=True)
    env.observation_space = spaces.Dict(
        {
            "values": env.observation_space["values"],
            "action_mask": spaces.Dict(
                {"choice": spaces.MultiBinary(N_ACTIONS), "slots": spaces.MultiBinary(3)}
            ),
        }
    )
    return env


class SwitchesEnv(gym.Env):
    """A ``MultiBinary(4)`` action: four switches, each shown a target position. Each step a
    switch is held at 0 (a quarter of the time), held at 1 (a quarter) or free; the mask gives
    two entries per switch (may it be 0, may it be 1), and a held switch's target is where it
    is held. The reward is 0.25 per switch at its target; a held switch moved pays -1
    (``strict=True`` raises instead). The best play earns 1.0 a step (8 an episode of 8), the
    free switches at random 0.75 (6)."""

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 8, strict: bool = False, n: int = 4):
        self.action_space = spaces.MultiBinary(n)
        self.observation_space = spaces.Dict(
            {
                "target": spaces.Box(0.0, 1.0, (n,), np.float32),
                "action_mask": spaces.MultiBinary(2 * n),
            }
        )
        self.length, self.strict, self.n = length, strict, n
        self.t = 0

    def _obs(self) -> dict:
        rng = self.np_random
        self.target = rng.integers(0, 2, self.n)
        held = rng.random(self.n) < 0.5
        self.mask = np.ones((self.n, 2), np.int8)
        self.mask[held, 1 - self.target[held]] = 0  # a held switch may only stay at its target
        return {"target": self.target.astype(np.float32), "action_mask": self.mask.reshape(-1)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        bits = np.asarray(action).reshape(-1).astype(np.int64)
        if not self.mask[np.arange(self.n), bits].all():
            if self.strict:
                raise ValueError(f"illegal action {action!r}")
            reward = -1.0
        else:
            reward = 0.25 * float((bits == self.target).sum())
        self.t += 1
        return self._obs(), reward, False, self.t >= self.length, {}


def make_switches_env(length: int = 8, strict: bool = False) -> gym.Env:
    return SwitchesEnv(length, strict)


class OutsideMaskEnv(BestLegalEnv):
    """:class:`BestLegalEnv` whose observation is the values alone and whose legal actions come
    beside it: ``info["action_mask"]`` at reset and every step (``source="info"``, as
    Gymnasium's Taxi), or an ``action_masks()`` method (``source="method"``, sb3-contrib's).
    ``drop_at``: the step whose info has no mask."""

    def __init__(self, strict: bool = False, source: str = "info", drop_at: int | None = None):
        super().__init__(strict=strict)
        self.observation_space = spaces.Box(0.0, 1.0, (N_ACTIONS,), np.float32)
        self.source, self.drop_at = source, drop_at
        if source == "method":
            self.action_masks = lambda: self.legal.copy()

    def _split(self, obs: dict, info: dict) -> tuple[np.ndarray, dict]:
        if self.source == "info" and self.t != self.drop_at:
            info = {**info, "action_mask": obs["action_mask"]}
        return obs["values"], info

    def reset(self, *, seed=None, options=None):
        return self._split(*super().reset(seed=seed))

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        values, info = self._split(obs, info)
        return values, reward, terminated, truncated, info


def make_outside_env(strict: bool = False, source: str = "info", drop_at: int | None = None):
    return OutsideMaskEnv(strict, source, drop_at)


NATIVE_VECTORS: list[int] = []
"""The sizes :func:`make_outside_vector_env`'s native vector env was asked for."""


def make_outside_vector_env(strict: bool = False):
    """:func:`make_outside_env` whose callable also offers a native vector env (Gymnasium's,
    same-step autoreset), which knows nothing of the mask in the info."""
    return OutsideMaskEnv(strict, "info", None)


def _outside_vector(num_envs: int, strict: bool = False) -> gym.vector.VectorEnv:
    NATIVE_VECTORS.append(num_envs)
    return gym.vector.SyncVectorEnv(
        [lambda: OutsideMaskEnv(strict, "info", None)] * num_envs,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


make_outside_vector_env.make_vector = _outside_vector  # type: ignore[attr-defined]
