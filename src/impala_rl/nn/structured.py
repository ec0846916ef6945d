"""The actor-critic of a structured env: a policy per step key (or one shared), critics per
step key or one shared, and an optional LSTM core that every key's encoder feeds.

With a core an agent's decisions form one sequence whatever their step keys (a column of
:class:`~impala_rl.rollout.RolloutSpec`): each key's encoder turns its observation
into features of one width (through a linear layer per key where the encoders' widths
differ, as Dict keys' do), the core runs along the column, and each key's action head and
critic read the core's output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium.spaces import Dict as DictSpace
from torch import Tensor, nn

from impala_rl.config import CORES, CRITIC_MODES, PRECISIONS
from impala_rl.nn.actor_critic import action_feature_size, encode_actions
from impala_rl.nn.core import CoreState, LSTMCore
from impala_rl.nn.distributions import (
    ActionDistribution,
    ActionHead,
    CategoricalDistribution,
    DiscreteHead,
    make_action_head,
)
from impala_rl.nn.encoders import MLPEncoder, make_encoder
from impala_rl.nn.init import VALUE_HEAD
from impala_rl.nn.keyed import KeyedActorCritic
from impala_rl.nn.normalization import DictObsNorm, RunningObsNorm, obs_norm_for
from impala_rl.nn.observations import Obs, any_tensor
from impala_rl.nn.popart import PopArtValueHead


def _encode(torso: nn.Module, obs: Obs, precision: str) -> Tensor:
    """The torso's features in float32; with ``precision="bf16"`` the torso runs under bf16
    autocast (weights stay float32), as :class:`impala_rl.nn.ActorCritic`'s encoder does."""
    if precision != "bf16":
        return torso(obs)
    with torch.autocast(any_tensor(obs).device.type, dtype=torch.bfloat16):
        return torso(obs).float()


def _with(features: Tensor, extra: Tensor | None) -> Tensor:
    """``features [*batch, F]`` followed by the last action/reward inputs, if any."""
    return features if extra is None else torch.cat([features, extra], dim=-1)


class PolicyNet(nn.Module):
    """Encoder and action head for one step key's observation ``[*batch, *o_k]`` (a Dict
    observation: ``{entry: [*batch, *o_entry]}``, an encoder per entry)."""

    def __init__(
        self,
        observation_space: gymnasium.spaces.Box | gymnasium.spaces.Dict,
        action_space: gymnasium.Space,
        hidden_sizes: Sequence[int],
        activation: str,
        encoder: str,
        precision: str = "fp32",
        head_in: int | None = None,
        extra_in: int = 0,
        encoder_kwargs: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.precision = precision
        self.obs_shape = tuple(observation_space.shape or ())
        self.torso = make_encoder(
            encoder, self.obs_shape, hidden_sizes, activation, observation_space, encoder_kwargs
        )
        self.action_head: ActionHead = make_action_head(
            action_space, (head_in or self.torso.out_features) + extra_in
        )

    def forward(
        self, obs: Obs, action_mask: Tensor | None = None, extra: Tensor | None = None
    ) -> ActionDistribution:
        return self.head(_with(_encode(self.torso, obs, self.precision), extra), action_mask)

    def head(self, features: Tensor, action_mask: Tensor | None = None) -> ActionDistribution:
        """The action distribution for ``features [*batch, F]`` (the torso's or the core's)."""
        if action_mask is None:
            return self.action_head(features)
        if not isinstance(self.action_head, DiscreteHead):
            raise ValueError("an action_mask needs a Discrete action space")
        return CategoricalDistribution(self.action_head.logits(features), action_mask)


class ValueNet(nn.Module):
    """Encoder and scalar value head: ``[*batch, *o]`` -> ``[*batch]``; a PopArt head
    (:class:`~impala_rl.nn.popart.PopArtValueHead`) when ``popart_beta`` is given."""

    def __init__(
        self,
        torso: nn.Module,
        precision: str = "fp32",
        head_in: int | None = None,
        popart_beta: float | None = None,
        extra_in: int = 0,
    ):
        super().__init__()
        self.torso = torso
        self.precision = precision
        self.head: nn.Linear | PopArtValueHead
        features = (head_in or torso.out_features) + extra_in
        if popart_beta is None:
            self.head = out = nn.Linear(features, 1)
        else:
            self.head = PopArtValueHead(features, popart_beta)
            out = self.head.linear
        nn.init.orthogonal_(out.weight, gain=1.0)
        nn.init.zeros_(out.bias)
        setattr(out, VALUE_HEAD, True)

    def forward(self, obs: Obs, extra: Tensor | None = None) -> Tensor:
        return self.head(_with(_encode(self.torso, obs, self.precision), extra)).squeeze(-1)


class StructuredActorCritic(KeyedActorCritic):
    """Policies and critics for the step keys ``0..K-1`` of a structured env.

    ``shared_policy`` uses one policy network for every key (their observation and action
    spaces must be equal). A key whose observation is a ``Dict`` gets an encoder per entry, as a
    plain env's model does. ``critic="per_step_key"`` gives each key its own critic (critic key
    = step key); ``critic="shared"`` is one critic (critic key 0) over every key's observation
    (Box keys only), flattened, zero-padded to the widest key and followed by a one-hot of the
    step key. ``shared_torso`` gives each per-key critic its policy's encoder
    (``critic="per_step_key"`` only); ``core="lstm"`` puts one LSTM between every key's
    encoder and the heads, along each agent's decisions (needs
    ``shared_torso``); ``precision="bf16"`` runs the encoders under bf16 autocast;
    ``channels_last`` stores image encoders' activations channels-last. ``normalize_obs``
    keeps running statistics per step key (per vector entry of a Dict key; updated by the
    learner) and normalizes each key's observations before its policy and critic;
    ``popart_beta`` gives every critic a PopArt head with its own statistics.
    ``use_last_action_reward`` feeds every head (or the core) the agent's previous decision
    next to the features: its action one-hot (or flat) in the block of its step key, zeros in
    the other keys' blocks, and the agent's clipped reward since then (:meth:`last_inputs`;
    zero at an agent's first decision of an episode).
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
        core: str = "none",
        lstm_hidden_size: int = 256,
        normalize_obs: bool = False,
        popart_beta: float | None = None,
        use_last_action_reward: bool = False,
        encoder_kwargs: Mapping[str, Any] | None = None,
        value_encoder: str | None = None,
        value_encoder_kwargs: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        if core not in CORES:
            raise ValueError(f"unknown core {core!r}; valid: {', '.join(CORES)}")
        if core != "none" and not (shared_torso and critic == "per_step_key"):
            raise ValueError(
                f"core={core!r} needs shared_torso=true and critic=per_step_key (each key's "
                "encoder feeds the core, whose output the key's policy and critic read)"
            )
        if shared_torso and (actor_hidden_sizes or critic_hidden_sizes):
            raise ValueError("separate actor/critic hidden sizes need shared_torso=false")
        if value_encoder is not None and (shared_torso or critic != "per_step_key"):
            raise ValueError(
                "a value_encoder needs shared_torso=false and critic=per_step_key (a value "
                "torso per step key)"
            )
        critic_sizes = critic_hidden_sizes or hidden_sizes
        hidden_sizes = actor_hidden_sizes or hidden_sizes
        if shared_torso and critic != "per_step_key":
            raise ValueError(
                f"shared_torso=true needs critic=per_step_key (a critic per policy), got {critic!r}"
            )
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.n_agents = int(n_agents)
        self.step_keys = sorted(observation_spaces)
        self.observation_spaces = dict(observation_spaces)
        self.action_spaces = dict(action_spaces)
        self.mask_sizes = dict(mask_sizes or {})
        self.shared_policy = bool(shared_policy)
        if critic not in CRITIC_MODES:
            raise ValueError(f"critic must be one of {', '.join(CRITIC_MODES)}, got {critic!r}")
        self.critic_mode = critic
        self.use_last_action_reward = bool(use_last_action_reward)
        self._action_offsets: dict[int, int] = {}
        width = 0
        for k in self.step_keys:
            self._action_offsets[k] = width
            width += action_feature_size(action_spaces[k])
        self.extra_features = width + 1 if self.use_last_action_reward else 0
        head_in = lstm_hidden_size if core != "none" else None
        extra_in = self.extra_features if core == "none" else 0  # else the core reads them
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
                head_in,
                extra_in,
                encoder_kwargs,
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
                        head_in,
                        extra_in,
                        encoder_kwargs,
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
                            value_encoder or encoder,
                            tuple(observation_spaces[k].shape or ()),
                            critic_sizes,
                            activation,
                            observation_spaces[k],
                            value_encoder_kwargs if value_encoder else encoder_kwargs,
                            "model.value_encoder" if value_encoder else "model.encoder",
                        ),
                        precision,
                        head_in,
                        popart_beta,
                        extra_in,
                    )
                    for k in self.step_keys
                }
            )
        else:
            if encoder != "mlp":
                raise ValueError(f"critic=shared needs encoder=mlp, got encoder={encoder!r}")
            dicts = [k for k in self.step_keys if isinstance(observation_spaces[k], DictSpace)]
            if dicts:
                raise ValueError(
                    f"critic=shared flattens every key's observation into one vector; step "
                    f"keys {dicts} observe a Dict: use critic=per_step_key"
                )
            self.critic_keys = [0]
            dims = {k: int(np.prod(observation_spaces[k].shape)) for k in self.step_keys}
            self._obs_dims = dims
            self._shared_width = max(dims.values()) + len(self.step_keys)
            torso = MLPEncoder((self._shared_width,), critic_sizes, activation)
            self.critics = nn.ModuleDict(
                {"0": ValueNet(torso, precision, None, popart_beta, extra_in)}
            )
        self.obs_norms: nn.ModuleDict | None = None
        if normalize_obs:
            if encoder != "mlp":
                raise ValueError(f"normalize_obs needs encoder=mlp, got encoder={encoder!r}")
            self.obs_norms = nn.ModuleDict(
                {str(k): obs_norm_for(observation_spaces[k]) for k in self.step_keys}
            )
        self.core: LSTMCore | None = None
        self.core_inputs: nn.ModuleDict | None = None
        if core != "none":
            widths = {k: self._policy_net(k).torso.out_features for k in self.step_keys}
            width = max(widths.values())
            if len(set(widths.values())) != 1:  # e.g. Dict keys: a linear layer each, to one width
                self.core_inputs = nn.ModuleDict(
                    {str(k): nn.Linear(w, width) for k, w in widths.items()}
                )
            self.core = LSTMCore(width + self.extra_features, lstm_hidden_size, precision)
        if channels_last:
            for module in self.modules():
                if module is not self and hasattr(module, "use_channels_last"):
                    module.use_channels_last()

    def _policy_net(self, step_key: int) -> PolicyNet:
        return self.policies["0" if self.shared_policy else str(step_key)]  # type: ignore[return-value]

    def action_head(self, step_key: int) -> ActionHead:
        return self._policy_net(step_key).action_head

    def observation_normalizer(self, step_key: int) -> RunningObsNorm | DictObsNorm | None:
        """The running statistics ``normalize_obs`` keeps for step key ``step_key``."""
        return None if self.obs_norms is None else self.obs_norms[str(step_key)]  # type: ignore[return-value]

    def normalized(self, step_key: int, obs: Obs) -> Obs:
        """``obs`` as step key ``step_key``'s policy and critic read it (``normalize_obs``)."""
        norm = self.observation_normalizer(step_key)
        return obs if norm is None else norm(obs)

    def popart_heads(self) -> dict[int, PopArtValueHead]:
        """The PopArt head of each critic key (empty without PopArt)."""
        heads = {c: self.critics[str(c)].head for c in self.critic_keys}
        return {c: h for c, h in heads.items() if isinstance(h, PopArtValueHead)}

    def critic_key(self, step_key: int) -> int:
        """The critic that values step key ``step_key``'s observations."""
        return step_key if self.critic_mode == "per_step_key" else 0

    def last_inputs(self, step_key: int, action: Tensor, reward: Tensor) -> Tensor:
        """What an agent's next decision reads of this one (``use_last_action_reward``): its
        action ``[B, *a_k]`` in step key ``step_key``'s block and the agent's summed reward
        since ``[B]`` (clipped to [-1, 1] where read), as ``[B, extra_features]``."""
        out = torch.zeros(action.shape[0], self.extra_features)
        features = encode_actions(self.action_head(step_key), action)
        start = self._action_offsets[step_key]
        out[:, start : start + features.shape[-1]] = features
        out[:, -1] = reward.float()
        return out

    def policy(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> ActionDistribution:
        """The action distribution of step key ``step_key`` for ``obs [*batch, *o_k]`` (a model
        without a core); ``extra [*batch, E]``: :meth:`last_inputs` (``use_last_action_reward``)."""
        self._no_core("policy")
        net = self._policy_net(step_key)
        return net(self.normalized(step_key, obs), action_mask, self._extra(extra, obs))

    def policy_value(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> tuple[ActionDistribution, Tensor]:
        """Step key ``step_key``'s action distribution and values ``[*batch]`` for ``obs
        [*batch, *o_k]`` (a model without a core)."""
        return self.policy(step_key, obs, action_mask, extra), self.value(step_key, obs, extra)

    def value(
        self,
        step_key: int,
        obs: Tensor,
        extra: Tensor | None = None,
        core_state: CoreState | None = None,
    ) -> Tensor:
        """Values ``[*batch]`` of step key ``step_key``'s observations ``[*batch, *o_k]``.

        A model with a core values one step ``[B, *o_k]`` that continues the agents' sequences
        from ``core_state`` (no reset): an agent's final observation at truncation.
        """
        if self.core is not None:
            return self._core_value(step_key, obs, extra, core_state)
        extra = self._extra(extra, obs)
        obs = self.normalized(step_key, obs)
        if self.critic_mode == "per_step_key":
            return self.critics[str(step_key)](obs, extra)
        batch = obs.shape[: obs.ndim - len(self.observation_spaces[step_key].shape)]
        flat = obs.reshape(*batch, -1).to(torch.float32)
        pad = self._shared_width - flat.shape[-1] - len(self.step_keys)
        one_hot = torch.zeros(*batch, len(self.step_keys), dtype=flat.dtype, device=flat.device)
        one_hot[..., self.step_keys.index(step_key)] = 1.0
        padded = torch.nn.functional.pad(flat, (0, pad))
        return self.critics["0"](torch.cat([padded, one_hot], dim=-1), extra)

    # -- the core: an agent's decisions as one sequence --------------------------------------
    def encode(self, step_key: int, obs: Tensor, extra: Tensor | None = None) -> Tensor:
        """Step key ``step_key``'s encoder features ``[*batch, F]`` (float32), followed by the
        last action/reward inputs when the model reads them: the core's input."""
        net = self._policy_net(step_key)
        features = _encode(net.torso, self.normalized(step_key, obs), net.precision).float()
        if self.core_inputs is not None:
            features = self.core_inputs[str(step_key)](features)
        return _with(features, self._extra(extra, obs))

    def heads(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> tuple[ActionDistribution, Tensor]:
        """Step key ``step_key``'s action distribution and value for core outputs
        ``features [*batch, H]``."""
        critic: ValueNet = self.critics[str(step_key)]  # type: ignore[assignment]
        value = critic.head(features).squeeze(-1)
        return self.action_distribution(step_key, features, action_mask), value

    def action_distribution(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> ActionDistribution:
        """Step key ``step_key``'s action distribution for core outputs ``features [*batch, H]``."""
        return self._policy_net(step_key).head(features, action_mask)

    def _core_parameters(self, key: int | None) -> list[nn.Parameter]:
        """The core's parameters, and key ``key``'s layer into it (every key's for ``None``)."""
        if self.core is None:
            return []
        inputs: list[nn.Parameter] = []
        if self.core_inputs is not None:
            layers = self.core_inputs if key is None else self.core_inputs[str(key)]
            inputs = list(layers.parameters())
        return [*inputs, *self.core.parameters()]

    def policy_parameters(self, step_key: int | None = None) -> list[nn.Parameter]:
        """Parameters of step key ``step_key``'s policy (all policies when ``None``); the core
        (and the key's layer into it) is in every key's."""
        core = self._core_parameters(step_key)
        if step_key is None:
            return [*self.policies.parameters(), *core]
        return [*self._policy_net(step_key).parameters(), *core]

    def critic_parameters(self, critic_key: int | None = None) -> list[nn.Parameter]:
        """Parameters of critic ``critic_key`` (all critics when ``None``); with a core, the
        core too (and the key's layer into it)."""
        core = self._core_parameters(critic_key)
        if critic_key is None:
            return [*self.critics.parameters(), *core]
        return [*self.critics[str(critic_key)].parameters(), *core]
