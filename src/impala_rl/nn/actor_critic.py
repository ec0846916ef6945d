"""Actor-critic network: MLP torso(s), an action head and a scalar value head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium
import numpy as np
from torch import Tensor, nn

from impala_rl.nn.distributions import ActionDistribution, ActionHead, make_action_head
from impala_rl.nn.encoders import make_encoder

__all__ = ["ActorCritic", "PolicyOutput"]


@dataclass
class PolicyOutput:
    """Policy distribution and state value for a batch of observations."""

    dist: ActionDistribution  # over [*batch]
    value: Tensor  # [*batch]


class ActorCritic(nn.Module):
    """Actor-critic over a ``Box`` observation.

    The torso is an encoder from :mod:`impala_rl.nn.encoders`: an MLP over the flattened
    observation (``encoder="mlp"``), or the Nature CNN / IMPALA ResNet over ``uint8`` images
    ``[C, H, W]``. With ``shared_torso`` one torso feeds both heads; otherwise the policy and
    value each get their own.
    """

    def __init__(
        self,
        observation_space: gymnasium.spaces.Box,
        action_space: gymnasium.Space,
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
        shared_torso: bool = False,
        encoder: str = "mlp",
    ) -> None:
        super().__init__()
        if not isinstance(observation_space, gymnasium.spaces.Box):
            raise ValueError(
                f"ActorCritic needs a Box observation space, got {observation_space!r}; "
                "flatten Dict/Tuple/Discrete observations on the env side first"
            )
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape: tuple[int, ...] = tuple(observation_space.shape)
        self.obs_dim = int(np.prod(self.obs_shape, dtype=np.int64))
        self.shared_torso = bool(shared_torso)

        def torso() -> nn.Module:
            return make_encoder(encoder, self.obs_shape, hidden_sizes, activation)

        self.policy_torso = torso()
        self.value_torso: nn.Module | None = None if self.shared_torso else torso()
        value_in = self.policy_torso.out_features
        if self.value_torso is not None:
            value_in = self.value_torso.out_features

        self.action_head: ActionHead = make_action_head(
            action_space, self.policy_torso.out_features
        )
        self.value_head = nn.Linear(value_in, 1)
        nn.init.orthogonal_(self.value_head.weight, gain=1.0)
        nn.init.zeros_(self.value_head.bias)

    def _check(self, obs: Tensor) -> Tensor:
        """``obs`` must be ``[*batch, *obs_shape]``; the torsos flatten or convolve it."""
        n = len(self.obs_shape)
        batch_ndim = obs.ndim - n
        if batch_ndim < 0 or tuple(obs.shape[batch_ndim:]) != self.obs_shape:
            raise ValueError(
                f"Expected observations of shape [*batch, {', '.join(map(str, self.obs_shape))}]"
                f", got {tuple(obs.shape)}"
            )
        return obs

    def _value_from(self, x: Tensor, policy_features: Tensor | None) -> Tensor:
        if self.value_torso is None:
            features = policy_features if policy_features is not None else self.policy_torso(x)
        else:
            features = self.value_torso(x)
        return self.value_head(features).squeeze(-1)

    def forward(self, obs: Tensor) -> PolicyOutput:
        """Return the action distribution and value for ``obs [*batch, *obs_shape]``."""
        x = self._check(obs)
        policy_features = self.policy_torso(x)
        dist = self.action_head(policy_features)
        return PolicyOutput(dist=dist, value=self._value_from(x, policy_features))

    def policy(self, obs: Tensor) -> ActionDistribution:
        """The action distribution alone (acting needs no value): ``obs [*batch, *obs_shape]``."""
        return self.action_head(self.policy_torso(self._check(obs)))

    def value(self, obs: Tensor) -> Tensor:
        """State values ``[*batch]`` for ``obs [*batch, *obs_shape]``."""
        return self._value_from(self._check(obs), None)

    def policy_parameters(self) -> list[nn.Parameter]:
        """Parameters the policy loss trains (the shared torso included)."""
        return [*self.policy_torso.parameters(), *self.action_head.parameters()]

    def critic_parameters(self) -> list[nn.Parameter]:
        """Parameters the value loss trains (the shared torso included)."""
        torso = self.policy_torso if self.value_torso is None else self.value_torso
        return [*torso.parameters(), *self.value_head.parameters()]
