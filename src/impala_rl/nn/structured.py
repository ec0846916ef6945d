"""The actor-critic of a structured env: a policy per step key (or one shared), critics per
step key or one shared."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gymnasium
import numpy as np
import torch
from torch import Tensor, nn

from impala_rl.nn.distributions import (
    ActionDistribution,
    ActionHead,
    CategoricalDistribution,
    DiscreteHead,
    make_action_head,
)
from impala_rl.nn.encoders import MLPEncoder, make_encoder
from impala_rl.nn.init import VALUE_HEAD

CRITIC_MODES = ("per_step_key", "shared")


def _encode(torso: nn.Module, obs: Tensor, precision: str) -> Tensor:
    """The torso's features in float32; with ``precision="bf16"`` the torso runs under bf16
    autocast (weights stay float32), as :class:`impala_rl.nn.ActorCritic`'s encoder does."""
    if precision != "bf16":
        return torso(obs)
    with torch.autocast(obs.device.type, dtype=torch.bfloat16):
        return torso(obs).float()


class PolicyNet(nn.Module):
    """Encoder and action head for one step key's observation ``[*batch, *o_k]``."""

    def __init__(
        self,
        observation_space: gymnasium.spaces.Box,
        action_space: gymnasium.Space,
        hidden_sizes: Sequence[int],
        activation: str,
        encoder: str,
        precision: str = "fp32",
    ):
        super().__init__()
        self.precision = precision
        self.obs_shape = tuple(observation_space.shape)
        self.torso = make_encoder(encoder, self.obs_shape, hidden_sizes, activation)
        self.action_head: ActionHead = make_action_head(action_space, self.torso.out_features)

    def forward(self, obs: Tensor, action_mask: Tensor | None = None) -> ActionDistribution:
        features = _encode(self.torso, obs, self.precision)
        if action_mask is None:
            return self.action_head(features)
        if not isinstance(self.action_head, DiscreteHead):
            raise ValueError("an action_mask needs a Discrete action space")
        return CategoricalDistribution(self.action_head.logits(features), action_mask)


class ValueNet(nn.Module):
    """Encoder and scalar value head: ``[*batch, *o]`` -> ``[*batch]``."""

    def __init__(self, torso: nn.Module, precision: str = "fp32"):
        super().__init__()
        self.torso = torso
        self.precision = precision
        self.head = nn.Linear(torso.out_features, 1)
        nn.init.orthogonal_(self.head.weight, gain=1.0)
        nn.init.zeros_(self.head.bias)
        setattr(self.head, VALUE_HEAD, True)

    def forward(self, obs: Tensor) -> Tensor:
        return self.head(_encode(self.torso, obs, self.precision)).squeeze(-1)


class StructuredActorCritic(nn.Module):
    """Policies and critics for the step keys ``0..K-1`` of a structured env.

    ``shared_policy`` uses one policy network for every key (their observation and action
    spaces must be equal). ``critic="per_step_key"`` gives each key its own critic (critic key
    = step key); ``critic="shared"`` is one critic (critic key 0) over every key's observation,
    flattened, zero-padded to the widest key and followed by a one-hot of the step key.
    ``shared_torso`` gives each per-key critic its policy's encoder (``critic="per_step_key"``
    only); ``precision="bf16"`` runs the encoders under bf16 autocast; ``channels_last``
    stores image encoders' activations channels-last.
    """

    def __init__(
        self,
        observation_spaces: Mapping[int, gymnasium.spaces.Box],
        action_spaces: Mapping[int, gymnasium.Space],
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
        encoder: str = "mlp",
        shared_policy: bool = False,
        critic: str = "per_step_key",
        mask_sizes: Mapping[int, int | None] | None = None,
        n_agents: int = 1,
        shared_torso: bool = False,
        precision: str = "fp32",
        channels_last: bool = False,
        actor_hidden_sizes: Sequence[int] | None = None,
        critic_hidden_sizes: Sequence[int] | None = None,
    ):
        super().__init__()
        if shared_torso and (actor_hidden_sizes or critic_hidden_sizes):
            raise ValueError("separate actor/critic hidden sizes need shared_torso=false")
        critic_sizes = critic_hidden_sizes or hidden_sizes
        hidden_sizes = actor_hidden_sizes or hidden_sizes
        if shared_torso and critic != "per_step_key":
            raise ValueError(
                f"shared_torso=true needs critic=per_step_key (a critic per policy), got {critic!r}"
            )
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be one of fp32, bf16, got {precision!r}")
        self.n_agents = int(n_agents)
        self.step_keys = sorted(observation_spaces)
        self.observation_spaces = dict(observation_spaces)
        self.action_spaces = dict(action_spaces)
        self.mask_sizes = dict(mask_sizes or {})
        self.shared_policy = bool(shared_policy)
        if critic not in CRITIC_MODES:
            raise ValueError(f"critic must be one of {', '.join(CRITIC_MODES)}, got {critic!r}")
        self.critic_mode = critic
        if self.shared_policy:
            k0 = self.step_keys[0]
            for k in self.step_keys[1:]:
                if (
                    observation_spaces[k] != observation_spaces[k0]
                    or action_spaces[k] != action_spaces[k0]
                ):
                    raise ValueError(
                        f"shared_policy needs equal spaces for every step key; key {k} has "
                        f"{observation_spaces[k]} / {action_spaces[k]}, key {k0} has "
                        f"{observation_spaces[k0]} / {action_spaces[k0]}"
                    )
            net = PolicyNet(
                observation_spaces[k0],
                action_spaces[k0],
                hidden_sizes,
                activation,
                encoder,
                precision,
            )
            self.policies = nn.ModuleDict({"0": net})
        else:
            self.policies = nn.ModuleDict(
                {
                    str(k): PolicyNet(
                        observation_spaces[k],
                        action_spaces[k],
                        hidden_sizes,
                        activation,
                        encoder,
                        precision,
                    )
                    for k in self.step_keys
                }
            )
        if critic == "per_step_key":
            self.critic_keys = list(self.step_keys)
            self.critics = nn.ModuleDict(
                {
                    str(k): ValueNet(
                        self._policy_net(k).torso
                        if shared_torso
                        else make_encoder(
                            encoder, tuple(observation_spaces[k].shape), critic_sizes, activation
                        ),
                        precision,
                    )
                    for k in self.step_keys
                }
            )
        else:
            if encoder != "mlp":
                raise ValueError(f"critic=shared needs encoder=mlp, got encoder={encoder!r}")
            self.critic_keys = [0]
            dims = {k: int(np.prod(observation_spaces[k].shape)) for k in self.step_keys}
            self._obs_dims = dims
            self._shared_width = max(dims.values()) + len(self.step_keys)
            torso = MLPEncoder((self._shared_width,), critic_sizes, activation)
            self.critics = nn.ModuleDict({"0": ValueNet(torso, precision)})
        if channels_last:
            for module in self.modules():
                if module is not self and hasattr(module, "use_channels_last"):
                    module.use_channels_last()

    def _policy_net(self, step_key: int) -> PolicyNet:
        return self.policies["0" if self.shared_policy else str(step_key)]  # type: ignore[return-value]

    def action_head(self, step_key: int) -> ActionHead:
        return self._policy_net(step_key).action_head

    def critic_key(self, step_key: int) -> int:
        """The critic that values step key ``step_key``'s observations."""
        return step_key if self.critic_mode == "per_step_key" else 0

    def policy(
        self, step_key: int, obs: Tensor, action_mask: Tensor | None = None
    ) -> ActionDistribution:
        """The action distribution of step key ``step_key`` for ``obs [*batch, *o_k]``."""
        return self._policy_net(step_key)(obs, action_mask)

    def value(self, step_key: int, obs: Tensor) -> Tensor:
        """Values ``[*batch]`` of step key ``step_key``'s observations ``[*batch, *o_k]``."""
        if self.critic_mode == "per_step_key":
            return self.critics[str(step_key)](obs)
        batch = obs.shape[: obs.ndim - len(self.observation_spaces[step_key].shape)]
        flat = obs.reshape(*batch, -1).to(torch.float32)
        pad = self._shared_width - flat.shape[-1] - len(self.step_keys)
        one_hot = torch.zeros(*batch, len(self.step_keys), dtype=flat.dtype, device=flat.device)
        one_hot[..., self.step_keys.index(step_key)] = 1.0
        padded = torch.nn.functional.pad(flat, (0, pad))
        return self.critics["0"](torch.cat([padded, one_hot], dim=-1))

    def policy_parameters(self, step_key: int | None = None) -> list[nn.Parameter]:
        """Parameters of step key ``step_key``'s policy (all policies when ``None``)."""
        if step_key is None:
            return list(self.policies.parameters())
        return list(self._policy_net(step_key).parameters())

    def critic_parameters(self, critic_key: int | None = None) -> list[nn.Parameter]:
        """Parameters of critic ``critic_key`` (all critics when ``None``)."""
        if critic_key is None:
            return list(self.critics.parameters())
        return list(self.critics[str(critic_key)].parameters())
