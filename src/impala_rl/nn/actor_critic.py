"""The actor-critic: a policy per step key, a critic per critic key, an optional LSTM core.

A plain env's model is the one-key case: step key 0, critic key 0. A structured env's step keys
each get an encoder (torso) and an action head (or share one, ``shared_policy``), and a critic
per key or one over every key (``critic``). Data flow for one decision of step key ``k``::

    obs -> [normalize] -> torso_k -> [+ last action and reward] -> [core] -> heads_k

With a core an agent's decisions form one sequence whatever their step keys (a column of
:class:`~impala_rl.rollout.RolloutSpec`): each key's torso turns its observation into features
of one width (through a linear layer per key where the torsos' widths differ, as Dict keys'
do), the core runs along the column, and each key's action head and critic read its output.
The torsos and the core run under bf16 autocast when ``precision="bf16"`` (weights stay
float32); the heads always run in float32 so log-probabilities and values keep their
precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
import torch
from torch import Tensor, nn

from impala_rl.config import CORES, CRITIC_MODES, PRECISIONS, VECTOR_ENCODERS, ConfigError
from impala_rl.envs.spaces import TextTokens
from impala_rl.nn.core import CoreState, LSTMCore
from impala_rl.nn.distributions import (
    ActionDistribution,
    ActionHead,
    action_feature_size,
    encode_actions,
    make_action_head,
)
from impala_rl.nn.encoders import MLPEncoder, is_cnn_image, make_encoder
from impala_rl.nn.init import VALUE_HEAD
from impala_rl.nn.normalization import DictObsNorm, RunningObsNorm, obs_norm_for
from impala_rl.nn.observations import Obs, any_tensor
from impala_rl.nn.popart import SIGMA_MIN, PopArtValueHead

__all__ = ["PRECISIONS", "ActorCritic", "PolicyNet", "ValueNet"]

Spaces = gymnasium.Space | Mapping[int, gymnasium.Space]


class PolicyNet(nn.Module):
    """One step key's torso and action head."""

    def __init__(self, torso: nn.Module, action_head: ActionHead):
        super().__init__()
        self.torso = torso
        self.action_head = action_head

    def head(self, features: Tensor, action_mask: Tensor | None = None) -> ActionDistribution:
        """The action distribution for ``features [*batch, F]`` (the torso's or the core's)."""
        head = self.action_head
        if action_mask is None:
            return head(features)
        if head.mask_width is None:
            raise ValueError(
                "an action_mask needs Discrete, MultiDiscrete or MultiBinary actions (or a "
                f"Tuple or Dict with such parts), got {head.action_space}"
            )
        return head(features, action_mask)


class ValueNet(nn.Module):
    """One critic's value head (``[*batch, F] -> [*batch, 1]``; PopArt when ``popart_beta`` is
    given, its scale at least ``popart_sigma_min``) and its own torso; ``torso=None``: it reads
    its step key's policy torso."""

    def __init__(
        self,
        torso: nn.Module | None,
        in_features: int,
        popart_beta: float | None,
        popart_sigma_min: float = SIGMA_MIN,
    ):
        super().__init__()
        self.torso = torso
        self.head: nn.Linear | PopArtValueHead
        if popart_beta is None:
            self.head = out = nn.Linear(in_features, 1)
        else:
            self.head = PopArtValueHead(in_features, popart_beta, popart_sigma_min)
            out = self.head.linear
        nn.init.orthogonal_(out.weight, gain=1.0)
        nn.init.zeros_(out.bias)
        setattr(out, VALUE_HEAD, True)


def _with(features: Tensor, extra: Tensor | None) -> Tensor:
    """``features [*batch, F]`` followed by the last action/reward inputs, if any."""
    return features if extra is None else torch.cat([features, extra], dim=-1)


class ActorCritic(nn.Module):
    """Policies and critics for the step keys of an env (one key, 0, for a plain env).

    ``observation_spaces`` and ``action_spaces`` are one space each (a plain env) or
    ``{step_key: space}``. An observation is a ``Box`` or a ``Dict`` (an encoder per entry,
    :class:`~impala_rl.nn.encoders.DictEncoder`). The torso is ``encoder``: ``auto`` (an MLP
    for vectors, the CNN that fits a ``uint8`` image ``[C, H, W]``), ``mlp``, a CNN over
    images, or the user's ``package.module:Class`` built from the observation space and
    ``encoder_kwargs``.

    - ``shared_torso``: each key's critic reads its policy's torso; otherwise a critic has a
      torso of its own, from ``value_encoder`` (and ``value_encoder_kwargs``) when given, and
      ``actor_hidden_sizes``/``critic_hidden_sizes`` size the two MLPs apart.
    - ``policy_obs_keys`` / ``value_obs_keys``: the Dict entries each torso reads;
      ``read_text=False``: none of its text entries (models saved before they were read).
    - ``shared_policy``: one policy for every key (their spaces must be equal).
    - ``critic="per_step_key"``: a critic per key (critic key = step key); ``"shared"``: one
      critic (key 0) over every key's observation (Box keys), flattened, zero-padded to the
      widest key and followed by a one-hot of the step key.
    - ``core="lstm"`` (needs ``shared_torso`` and critics per key): an LSTM between the torsos
      and the heads, along each agent's decisions.
    - ``use_last_action_reward``: every head (or the core) also reads the agent's previous
      decision (:meth:`last_inputs`): its action one-hot (or flat) in its step key's block,
      zeros in the other keys' blocks, and the reward since then clipped to [-1, 1].
    - ``normalize_obs``: running statistics per step key with vectors (per vector entry of a
      Dict; under ``auto`` an image is its CNN's),
      updated by the learner (``normalize_obs_center=False``: divided by the root mean square,
      not centered); ``popart_beta``: a PopArt head per critic (its scale at least
      ``popart_sigma_min``).
    - ``precision="bf16"``: torsos and core under bf16 autocast; ``channels_last``: image
      encoders keep activations channels-last.
    - ``mask_sizes``: the keys whose observations carry an action mask; ``n_agents``: the
      agents of the env (per-agent state lives in the decision streams).

    Every method takes the step key first: :meth:`act` for one acting step, :meth:`policy` and
    :meth:`policy_value` over any batch of a model without a core, :meth:`encode`, ``core``
    and :meth:`heads` along time-major columns of a model with one, :meth:`value` for a final
    observation.
    """

    def __init__(
        self,
        observation_spaces: Spaces,
        action_spaces: Spaces,
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
        shared_torso: bool = False,
        encoder: str = "auto",
        core: str = "none",
        lstm_hidden_size: int = 256,
        use_last_action_reward: bool = False,
        precision: str = "fp32",
        channels_last: bool = False,
        actor_hidden_sizes: Sequence[int] | None = None,
        critic_hidden_sizes: Sequence[int] | None = None,
        normalize_obs: bool = False,
        normalize_obs_center: bool = True,
        popart_beta: float | None = None,
        popart_sigma_min: float = SIGMA_MIN,
        encoder_kwargs: Mapping[str, Any] | None = None,
        dict_vectors: str = "joint",
        value_encoder: str | None = None,
        value_encoder_kwargs: Mapping[str, Any] | None = None,
        policy_obs_keys: Sequence[str] | None = None,
        value_obs_keys: Sequence[str] | None = None,
        read_text: bool = True,
        shared_policy: bool = False,
        critic: str = "per_step_key",
        mask_sizes: Mapping[int, int | None] | None = None,
        n_agents: int = 1,
    ) -> None:
        super().__init__()
        obs_spaces = _by_key(observation_spaces)
        act_spaces = _by_key(action_spaces)
        _check_settings(obs_spaces, act_spaces, locals())
        self.step_keys = sorted(obs_spaces)
        self.observation_spaces = obs_spaces
        self.action_spaces = act_spaces
        self.mask_sizes = dict(mask_sizes or {})
        self.n_agents = int(n_agents)
        self.shared_policy = bool(shared_policy)
        self.critic_mode = critic
        self.precision = precision
        self.use_last_action_reward = bool(use_last_action_reward)
        self._obs_shapes = {k: _shapes(s) for k, s in obs_spaces.items()}
        self._action_offsets: dict[int, int] = {}
        width = 0
        for k in self.step_keys:
            self._action_offsets[k] = width
            width += action_feature_size(act_spaces[k])
        self.extra_features = width + 1 if self.use_last_action_reward else 0

        # Built in the order data flows (torsos, core, heads): the builtin init draws each
        # layer's weights as it is built, so this order is the weights' (a plain env's too).
        policy_keys = self.step_keys[:1] if self.shared_policy else self.step_keys
        policy_sizes = actor_hidden_sizes or hidden_sizes
        critic_sizes = critic_hidden_sizes or hidden_sizes

        def torso(kind: str, kwargs: Any, sizes: Sequence[int], field: str, space: Any) -> Any:
            shape = tuple(space.shape or ())
            return make_encoder(kind, shape, sizes, activation, space, kwargs, field, dict_vectors)

        torsos = {
            k: torso(
                encoder,
                encoder_kwargs,
                policy_sizes,
                "model.encoder",
                _entries(obs_spaces[k], policy_obs_keys, "model.policy_obs_keys", read_text),
            )
            for k in policy_keys
        }
        critic_torsos: dict[int, nn.Module | None] = {}
        if critic == "shared":
            dims = {k: int(np.prod(obs_spaces[k].shape)) for k in self.step_keys}
            self._shared_width = max(dims.values()) + len(self.step_keys)
            critic_torsos[0] = MLPEncoder((self._shared_width,), critic_sizes, activation)
        for k in self.step_keys if critic == "per_step_key" else ():
            critic_torsos[k] = None
            if not shared_torso:
                value_space = _entries(
                    obs_spaces[k], value_obs_keys, "model.value_obs_keys", read_text
                )
                critic_torsos[k] = torso(
                    value_encoder or encoder,
                    value_encoder_kwargs if value_encoder else encoder_kwargs,
                    critic_sizes,
                    "model.value_encoder" if value_encoder else "model.encoder",
                    value_space,
                )
        self.critic_keys = list(critic_torsos)

        self.core: LSTMCore | None = None
        self.core_inputs: nn.ModuleDict | None = None
        if core == "lstm":
            widths = {k: torsos[self._policy_key(k)].out_features for k in self.step_keys}
            width = max(widths.values())
            if len(set(widths.values())) != 1:  # e.g. Dict keys: a linear layer each, to one width
                self.core_inputs = nn.ModuleDict(
                    {str(k): nn.Linear(w, width) for k, w in widths.items()}
                )
            self.core = LSTMCore(width + self.extra_features, lstm_hidden_size, precision)

        def head_in(torso: nn.Module) -> int:
            if self.core is not None:
                return self.core.out_features
            return torso.out_features + self.extra_features

        self.policies = nn.ModuleDict(
            {
                str(k): PolicyNet(t, make_action_head(act_spaces[k], head_in(t)))
                for k, t in torsos.items()
            }
        )
        self.critics = nn.ModuleDict(
            {
                str(c): ValueNet(
                    t, head_in(t or torsos[self._policy_key(c)]), popart_beta, popart_sigma_min
                )
                for c, t in critic_torsos.items()
            }
        )
        self.obs_norms: nn.ModuleDict | None = None
        if normalize_obs:  # the keys with vectors to normalize (auto leaves images to the CNN)
            norms = {
                str(k): obs_norm_for(s, normalize_obs_center)
                for k, s in obs_spaces.items()
                if not (encoder == "auto" and is_cnn_image(s))
            }
            kept = {k: norm for k, norm in norms.items() if norm is not None}
            self.obs_norms = nn.ModuleDict(kept) if kept else None
        # registered after the heads, where earlier checkpoints have them
        if self.core_inputs is not None:
            self.core_inputs = self._modules.pop("core_inputs")  # type: ignore[assignment]
            self.add_module("core_inputs", self.core_inputs)
        if self.core is not None:
            self.core = self._modules.pop("core")  # type: ignore[assignment]
            self.add_module("core", self.core)
        if channels_last:
            for module in self.modules():
                if module is not self and hasattr(module, "use_channels_last"):
                    module.use_channels_last()
        self._register_load_state_dict_pre_hook(_upgrade_state_dict, with_module=True)

    # -- what the model holds --------------------------------------------------------------
    @property
    def has_core(self) -> bool:
        return self.core is not None

    @property
    def needs_inputs(self) -> bool:
        """True when the model reads more than observations (a core or last action/reward)."""
        return self.core is not None or self.use_last_action_reward

    def _policy_key(self, step_key: int) -> int:
        return self.step_keys[0] if self.shared_policy else step_key

    def _policy_net(self, step_key: int) -> PolicyNet:
        return self.policies[str(self._policy_key(step_key))]  # type: ignore[return-value]

    def _critic(self, critic_key: int) -> ValueNet:
        return self.critics[str(critic_key)]  # type: ignore[return-value]

    def critic_torso(self, critic_key: int) -> nn.Module:
        """The torso critic ``critic_key`` reads: its own, or its step key's policy torso."""
        own = self._critic(critic_key).torso
        return own if own is not None else self._policy_net(critic_key).torso

    def action_head(self, step_key: int = 0) -> ActionHead:
        return self._policy_net(step_key).action_head

    def critic_key(self, step_key: int) -> int:
        """The critic that values step key ``step_key``'s observations."""
        return step_key if self.critic_mode == "per_step_key" else 0

    def observation_normalizer(self, step_key: int = 0) -> RunningObsNorm | DictObsNorm | None:
        """The running statistics ``normalize_obs`` keeps for step key ``step_key``."""
        if self.obs_norms is None or str(step_key) not in self.obs_norms:
            return None
        return self.obs_norms[str(step_key)]  # type: ignore[return-value]

    def normalized(self, step_key: int, obs: Obs) -> Obs:
        """``obs [*batch, *o_k]``, checked, as step key ``step_key``'s torsos read it."""
        _check_obs(obs, self._obs_shapes[step_key])
        norm = self.observation_normalizer(step_key)
        return obs if norm is None else norm(obs)

    def popart_heads(self) -> dict[int, PopArtValueHead]:
        """The PopArt head of each critic key (empty without PopArt)."""
        heads = {c: self._critic(c).head for c in self.critic_keys}
        return {c: h for c, h in heads.items() if isinstance(h, PopArtValueHead)}

    def initial_state(
        self, batch_size: int, device: torch.device | str = "cpu"
    ) -> CoreState | None:
        """The core state at an episode start, ``(h, c)`` each ``[1, B, H]``; None: no core."""
        return None if self.core is None else self.core.initial_state(batch_size, device)

    def last_inputs(self, step_key: int, action: Tensor, reward: Tensor) -> Tensor:
        """What an agent's next decision reads of this one (``use_last_action_reward``): its
        action ``[*batch, *a_k]`` in step key ``step_key``'s block and the agent's summed
        reward since ``[*batch]`` (clipped to [-1, 1] where read): ``[*batch, extra_features]``."""
        features = encode_actions(self.action_head(step_key), action)
        out = features.new_zeros(*features.shape[:-1], self.extra_features)
        start = self._action_offsets[step_key]
        out[..., start : start + features.shape[-1]] = features
        out[..., -1] = reward.to(out.device, torch.float32)
        return out

    # -- the pieces of a forward pass --------------------------------------------------------
    def _encode(self, torso: nn.Module, obs: Obs) -> Tensor:
        """The torso's features in float32 (under bf16 autocast for ``precision="bf16"``)."""
        if self.precision != "bf16":
            return torso(obs)
        with torch.autocast(any_tensor(obs).device.type, dtype=torch.bfloat16):
            return torso(obs).float()

    def _extra(self, extra: Tensor | None, obs: Obs) -> Tensor | None:
        """The last inputs ``[*batch, E]`` as the heads read them (reward clipped to [-1, 1]);
        ``None`` for a model that does not read them."""
        if not self.use_last_action_reward:
            return None
        if extra is None:
            raise ValueError("use_last_action_reward needs the last inputs (extra=last_inputs)")
        extra = extra.to(any_tensor(obs).device, torch.float32)
        return torch.cat([extra[..., :-1], extra[..., -1:].clamp(-1.0, 1.0)], dim=-1)

    def _value_features(
        self, step_key: int, obs: Obs, extra: Tensor | None, policy: Tensor | None = None
    ) -> Tensor:
        """The features critic ``critic_key(step_key)`` reads of normalized ``obs``;
        ``policy``: the policy torso's (with the last inputs), when already computed."""
        critic = self._critic(self.critic_key(step_key))
        if critic.torso is None:  # the policy's torso
            if policy is not None:
                return policy
            return _with(self._encode(self._policy_net(step_key).torso, obs), extra)
        if self.critic_mode == "shared":
            obs = self._shared_critic_input(step_key, obs)  # type: ignore[arg-type]
        return _with(self._encode(critic.torso, obs), extra)

    def _shared_critic_input(self, step_key: int, obs: Tensor) -> Tensor:
        """``obs [*batch, *o_k]`` flattened, zero-padded and followed by a one-hot of the key."""
        batch = obs.shape[: obs.ndim - len(self.observation_spaces[step_key].shape)]
        flat = obs.reshape(*batch, -1).to(torch.float32)
        pad = self._shared_width - flat.shape[-1] - len(self.step_keys)
        one_hot = torch.zeros(*batch, len(self.step_keys), dtype=flat.dtype, device=flat.device)
        one_hot[..., self.step_keys.index(step_key)] = 1.0
        return torch.cat([nn.functional.pad(flat, (0, pad)), one_hot], dim=-1)

    def _no_core(self, method: str) -> None:
        if self.core is not None:
            raise ValueError(
                f"{method}() reads observations alone; a model with a core reads an agent's "
                "decisions in order: act() one step, encode(), core and heads() a sequence"
            )

    # -- the keyed interface ---------------------------------------------------------------
    def policy(
        self,
        step_key: int,
        obs: Obs,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> ActionDistribution:
        """Step key ``step_key``'s action distribution for ``obs [*batch, *o_k]`` (a model
        without a core); ``extra [*batch, E]``: :meth:`last_inputs` (``use_last_action_reward``)."""
        self._no_core("policy")
        net = self._policy_net(step_key)
        features = self._encode(net.torso, self.normalized(step_key, obs))
        return net.head(_with(features, self._extra(extra, obs)), action_mask)

    def policy_value(
        self,
        step_key: int,
        obs: Obs,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> tuple[ActionDistribution, Tensor]:
        """Step key ``step_key``'s action distribution and values ``[*batch]`` for ``obs
        [*batch, *o_k]`` (a model without a core); a shared torso runs once."""
        self._no_core("policy_value")
        net = self._policy_net(step_key)
        x = self.normalized(step_key, obs)
        extra = self._extra(extra, obs)
        features = _with(self._encode(net.torso, x), extra)
        value_features = self._value_features(step_key, x, extra, features)
        value = self._critic(self.critic_key(step_key)).head(value_features).squeeze(-1)
        return net.head(features, action_mask), value

    def value(
        self,
        step_key: int,
        obs: Obs,
        extra: Tensor | None = None,
        core_state: CoreState | None = None,
    ) -> Tensor:
        """Values ``[*batch]`` of step key ``step_key``'s observations ``[*batch, *o_k]``.

        A model with a core values one step ``[B, *o_k]`` that continues the agents' sequences
        from ``core_state`` (no reset): an agent's final observation at truncation.
        """
        if self.core is None:
            features = self._value_features(
                step_key, self.normalized(step_key, obs), self._extra(extra, obs)
            )
            return self._critic(self.critic_key(step_key)).head(features).squeeze(-1)
        if core_state is None:
            raise ValueError("value() on a model with a core needs the agents' core_state")
        y, _ = self.core(self.encode(step_key, obs, extra).unsqueeze(0), None, core_state)
        return self.heads(step_key, y[0])[1]

    def encode(self, step_key: int, obs: Obs, extra: Tensor | None = None) -> Tensor:
        """Step key ``step_key``'s torso features ``[*batch, F]`` (float32), followed by the
        last action/reward inputs when the model reads them: the core's input."""
        net = self._policy_net(step_key)
        features = self._encode(net.torso, self.normalized(step_key, obs)).float()
        if self.core_inputs is not None:
            features = self.core_inputs[str(step_key)](features)
        return _with(features, self._extra(extra, obs))

    def heads(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> tuple[ActionDistribution, Tensor]:
        """Step key ``step_key``'s action distribution and value for core outputs
        ``features [*batch, H]``."""
        value = self._critic(self.critic_key(step_key)).head(features).squeeze(-1)
        return self.action_distribution(step_key, features, action_mask), value

    def action_distribution(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> ActionDistribution:
        """Step key ``step_key``'s action distribution for core outputs ``features [*batch, H]``."""
        return self._policy_net(step_key).head(features, action_mask)

    def act(
        self,
        step_key: int,
        obs: Obs,
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

    # -- what each loss trains -------------------------------------------------------------
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
        """Parameters of step key ``step_key``'s policy (every policy's for ``None``); the core
        (and the key's layer into it) is in every key's."""
        nets = self.policies.values() if step_key is None else [self._policy_net(step_key)]
        return _unique(
            [p for net in nets for p in net.parameters()], self._core_parameters(step_key)
        )

    def critic_parameters(self, critic_key: int | None = None) -> list[nn.Parameter]:
        """Parameters of critic ``critic_key`` (every critic's for ``None``), the torso it
        reads included; with a core, the core too (and the key's layer into it)."""
        keys = self.critic_keys if critic_key is None else [critic_key]
        params = [
            p
            for c in keys
            for module in (self.critic_torso(c), self._critic(c).head)
            for p in module.parameters()
        ]
        return _unique(params, self._core_parameters(critic_key))

    # -- checkpoints of earlier versions ---------------------------------------------------
    def saved_parameter_order(self, saved_names: Sequence[str]) -> list[str]:
        """The names (as this model has them) of the parameters of a saved state dict whose
        keys are ``saved_names``, in the order its model listed them: the order of the saved
        optimizer state."""
        params = dict(self.named_parameters())
        order = []
        for name in upgraded_names(self, list(saved_names), ""):
            if name in params and name not in order:
                order.append(name)
        return order


def _upgrade_state_dict(model: ActorCritic, state_dict: dict, prefix: str, *_args: Any) -> None:
    """Rename an earlier version's parameters in place (:func:`upgraded_names`)."""
    renamed = dict(zip(state_dict, upgraded_names(model, list(state_dict), prefix), strict=True))
    for old in list(state_dict):
        value = state_dict.pop(old)
        if renamed[old] is not None:
            state_dict[renamed[old]] = value


EARLIER_NAMES = {
    "policy_torso.": "policies.0.torso.",
    "value_torso.": "critics.0.torso.",
    "policy_head.": "policies.0.action_head.",
    "action_head.": "policies.0.action_head.",
    "value_head.": "critics.0.head.",
    "obs_norm.": "obs_norms.0.",
}
"""A plain env's parameter prefixes before one class served every env, and today's."""


def upgraded_names(model: ActorCritic, names: list[str], prefix: str) -> list[str | None]:
    """Today's name of each of a saved state dict's ``names`` (``None``: not kept).

    Before one class served every env, a plain env's model named its parts ``policy_torso``,
    ``value_torso``, ``policy_head`` (earlier ``action_head``), ``value_head`` and ``obs_norm``;
    they are step key 0's ``policies.0.torso``, ``critics.0.torso``, ``policies.0.action_head``,
    ``critics.0.head`` and ``obs_norms.0``. A critic that reads its policy's torso was saved
    with a copy of it under ``critics.<k>.torso``, dropped here.
    """
    borrowed = {f"critics.{c}.torso." for c in model.critic_keys if model._critic(c).torso is None}
    out: list[str | None] = []
    for name in names:
        rest = name[len(prefix) :] if name.startswith(prefix) else None
        if rest is None:
            out.append(name)
            continue
        for old, new in EARLIER_NAMES.items():
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
        if any(rest.startswith(b) for b in borrowed):
            out.append(None)
            continue
        out.append(prefix + rest)
    return out


def _unique(*groups: list[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in (p for group in groups for p in group):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _by_key(spaces: Spaces) -> dict[int, gymnasium.Space]:
    """``{step_key: space}``: one space is step key 0's (a Dict space is one space)."""
    if isinstance(spaces, gymnasium.Space):
        return {0: spaces}
    return {int(k): s for k, s in spaces.items()}


def _check_settings(
    obs_spaces: dict[int, gymnasium.Space],
    act_spaces: dict[int, gymnasium.Space],
    kw: dict[str, Any],
) -> None:
    """Settings that cannot work together, refused before anything is built."""
    for k, space in obs_spaces.items():
        if not isinstance(space, (gymnasium.spaces.Box, gymnasium.spaces.Dict)):
            raise ValueError(
                f"ActorCritic needs a Box or Dict observation space, got {space!r} (step key "
                f"{k}); flatten Tuple/Discrete observations on the env side first"
            )
    if set(obs_spaces) != set(act_spaces):
        raise ValueError(
            f"observation spaces for step keys {sorted(obs_spaces)}, action spaces for "
            f"{sorted(act_spaces)}"
        )
    core, critic, shared_torso = kw["core"], kw["critic"], kw["shared_torso"]
    if core not in CORES:
        raise ValueError(f"unknown core {core!r}; valid: {', '.join(CORES)}")
    if kw["precision"] not in PRECISIONS:
        raise ValueError(f"unknown precision {kw['precision']!r}; valid: {', '.join(PRECISIONS)}")
    if critic not in CRITIC_MODES:
        raise ValueError(f"critic must be one of {', '.join(CRITIC_MODES)}, got {critic!r}")
    if core != "none" and not shared_torso:
        raise ValueError(f"core={core!r} needs shared_torso=true (one torso feeds the core)")
    if shared_torso and critic != "per_step_key":
        raise ValueError(
            f"shared_torso=true needs critic=per_step_key (a critic per policy), got {critic!r}"
        )
    if shared_torso and (kw["actor_hidden_sizes"] or kw["critic_hidden_sizes"]):
        raise ValueError("separate actor/critic hidden sizes need shared_torso=false")
    if kw["value_encoder"] is not None and (shared_torso or critic != "per_step_key"):
        raise ValueError(
            "a value_encoder needs shared_torso=false and critic=per_step_key (a value torso of "
            "its own)"
        )
    if shared_torso and kw["value_obs_keys"] is not None:
        raise ValueError("value_obs_keys need shared_torso=false (a value torso of its own)")
    if kw["shared_policy"]:
        k0, *others = sorted(obs_spaces)
        for k in others:
            if obs_spaces[k] != obs_spaces[k0] or act_spaces[k] != act_spaces[k0]:
                raise ValueError(
                    f"shared_policy needs equal spaces for every step key; key {k} has "
                    f"{obs_spaces[k]} / {act_spaces[k]}, key {k0} has "
                    f"{obs_spaces[k0]} / {act_spaces[k0]}"
                )
    if critic == "shared":
        if kw["encoder"] not in VECTOR_ENCODERS:
            raise ValueError(
                f"critic=shared needs encoder=auto or mlp, got encoder={kw['encoder']!r}"
            )
        dicts = [k for k, s in obs_spaces.items() if isinstance(s, gymnasium.spaces.Dict)]
        if dicts:
            raise ValueError(
                f"critic=shared flattens every key's observation into one vector; step "
                f"keys {dicts} observe a Dict: use critic=per_step_key"
            )


def _shapes(space: gymnasium.Space) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
    """An observation's shape, or a Dict observation's shape per entry."""
    if isinstance(space, gymnasium.spaces.Dict):
        return {k: tuple(s.shape) for k, s in space.spaces.items()}
    return tuple(space.shape or ())


def _check_obs(obs: Any, shapes: tuple[int, ...] | dict[str, tuple[int, ...]]) -> None:
    """``obs`` must be ``[*batch, *shape]`` (``{entry: [*batch, *shape]}`` for a Dict)."""
    if not isinstance(shapes, dict):
        _check_shape(obs, shapes, "observations")
        return
    if not isinstance(obs, dict) or set(obs) != set(shapes):
        got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
        raise ValueError(f"Expected a dict of observations {sorted(shapes)}, got {got}")
    for name, shape in shapes.items():
        _check_shape(obs[name], shape, f"observations {name!r}")


def _check_shape(x: Any, shape: tuple[int, ...], what: str) -> None:
    n = len(shape)
    if not isinstance(x, Tensor) or x.ndim < n or tuple(x.shape[x.ndim - n :]) != shape:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        dims = ", ".join(map(str, shape))
        raise ValueError(f"Expected {what} of shape [*batch, {dims}], got {got}")


def _entries(
    space: gymnasium.Space, keys: Sequence[str] | None, field: str, read_text: bool = True
) -> gymnasium.Space:
    """The Dict observation's entries ``keys`` (in the space's order; all for None), without
    its text entries unless ``read_text``."""
    if keys is None:
        if read_text or not isinstance(space, gymnasium.spaces.Dict):
            return space
        keys = [k for k, s in space.spaces.items() if not isinstance(s, TextTokens)]
        if len(keys) == len(space.spaces):
            return space
    if not isinstance(space, gymnasium.spaces.Dict):
        raise ConfigError(
            f"{field}={list(keys)}: selects entries of a Dict observation; this env observes "
            f"{space}; valid: null"
        )
    unknown = [k for k in keys if k not in space.spaces]
    if unknown:
        raise ConfigError(
            f"{field}: unknown entries {unknown}; valid: entries of {', '.join(space.spaces)}"
        )
    return gymnasium.spaces.Dict({k: s for k, s in space.spaces.items() if k in keys})
