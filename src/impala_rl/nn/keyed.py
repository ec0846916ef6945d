"""What every actor-critic of the keyed interface shares: its core, the last inputs, acting.

:class:`~impala_rl.nn.ActorCritic` (one step key) and
:class:`~impala_rl.nn.structured.StructuredActorCritic` (several) derive from
:class:`KeyedActorCritic`; they define how a key's observations are encoded (``encode``,
``policy``, ``value`` without a core) and read (``action_distribution``, ``heads``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from impala_rl.nn.core import CoreState, LSTMCore
from impala_rl.nn.distributions import ActionDistribution
from impala_rl.nn.observations import any_tensor


class KeyedActorCritic(nn.Module):
    """The keyed interface's shared part; ``core`` and ``use_last_action_reward`` are set by
    the subclass."""

    core: LSTMCore | None
    use_last_action_reward: bool

    @property
    def has_core(self) -> bool:
        return self.core is not None

    @property
    def needs_inputs(self) -> bool:
        """True when the model reads more than observations (a core or last action/reward)."""
        return self.core is not None or self.use_last_action_reward

    def initial_state(
        self, batch_size: int, device: torch.device | str = "cpu"
    ) -> CoreState | None:
        """The core state at an episode start, ``(h, c)`` each ``[1, B, H]``; None: no core."""
        return None if self.core is None else self.core.initial_state(batch_size, device)

    def _extra(self, extra: Tensor | None, obs: Tensor) -> Tensor | None:
        """The last inputs ``[*batch, E]`` as the heads read them (reward clipped to [-1, 1]);
        ``None`` for a model that does not read them."""
        if not self.use_last_action_reward:
            return None
        if extra is None:
            raise ValueError("use_last_action_reward needs the last inputs (extra=last_inputs)")
        extra = extra.to(any_tensor(obs).device, torch.float32)
        return torch.cat([extra[..., :-1], extra[..., -1:].clamp(-1.0, 1.0)], dim=-1)

    def _no_core(self, method: str) -> None:
        if self.core is not None:
            raise ValueError(
                f"{method}() reads observations alone; a model with a core reads an agent's "
                "decisions in order: act() one step, encode(), core and heads() a sequence"
            )

    def _core_value(
        self, step_key: int, obs: Tensor, extra: Tensor | None, core_state: CoreState | None
    ) -> Tensor:
        """Values ``[B]`` of one step ``[B, *o_k]`` that continues the agents' sequences from
        ``core_state`` (no reset): a final observation at truncation."""
        if core_state is None:
            raise ValueError("value() on a model with a core needs the agents' core_state")
        assert self.core is not None
        y, _ = self.core(self.encode(step_key, obs, extra).unsqueeze(0), None, core_state)
        return self.heads(step_key, y[0])[1]

    def act(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        first: Tensor | None = None,
        core_state: CoreState | None = None,
        extra: Tensor | None = None,
    ) -> tuple[ActionDistribution, CoreState | None]:
        """One decision of ``B`` agents whose step key is ``step_key``: ``obs [B, *o_k]``;
        with a core ``first [B]`` (an agent's first decision of an episode: the state resets)
        and ``core_state`` the agents' states ``(h, c)`` each ``[1, B, H]``. Returns the action
        distribution and the state after it (``None`` without a core)."""
        if self.core is None:
            return self.policy(step_key, obs, action_mask, extra), None
        features = self.encode(step_key, obs, extra).unsqueeze(0)
        first = None if first is None else first.reshape(1, -1)
        y, state = self.core(features, first, core_state)
        return self.action_distribution(step_key, y[0], action_mask), state

    # defined by each actor-critic
    def encode(self, step_key: int, obs: Tensor, extra: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def policy(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> ActionDistribution:
        raise NotImplementedError

    def action_distribution(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> ActionDistribution:
        raise NotImplementedError

    def heads(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> tuple[ActionDistribution, Tensor]:
        raise NotImplementedError
