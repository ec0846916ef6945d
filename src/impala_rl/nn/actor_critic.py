"""Actor-critic network: encoder torso(s), an optional LSTM core, an action head and a value head.

Data flow for one step: ``obs -> encoder -> [concat last action, last reward] -> [LSTM core]
-> heads``. The encoder and core run under bf16 autocast when ``precision="bf16"`` (weights
stay float32); the heads always run in float32 so log-probabilities and values keep their
precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from impala_rl.config import CORES, PRECISIONS, ConfigError
from impala_rl.nn.core import CoreState, LSTMCore
from impala_rl.nn.distributions import (
    ActionDistribution,
    ActionHead,
    BoxHead,
    DiscreteHead,
    MultiBinaryHead,
    MultiDiscreteHead,
    make_action_head,
)
from impala_rl.nn.encoders import make_encoder
from impala_rl.nn.init import VALUE_HEAD
from impala_rl.nn.keyed import KeyedActorCritic
from impala_rl.nn.normalization import DictObsNorm, RunningObsNorm, obs_norm_for
from impala_rl.nn.popart import PopArtValueHead

__all__ = ["PRECISIONS", "ActorCritic"]


def action_feature_size(space: gymnasium.Space) -> int:
    """Width of :func:`encode_actions`' output for ``space``."""
    if isinstance(space, gymnasium.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        return int(np.asarray(space.nvec).sum())
    return int(np.prod(space.shape, dtype=np.int64))


def encode_actions(head: ActionHead, actions: Tensor) -> Tensor:
    """Model actions ``[*batch, *action_shape]`` as float features ``[*batch, A]``: one-hot
    for (multi-)discrete actions, the flat vector for binary and continuous ones."""
    if isinstance(head, DiscreteHead):
        return F.one_hot(actions.long(), head.n).float()
    if isinstance(head, MultiDiscreteHead):
        parts = [F.one_hot(actions[..., i].long(), n) for i, n in enumerate(head.nvec)]
        return torch.cat(parts, dim=-1).float()
    if isinstance(head, (MultiBinaryHead, BoxHead)):
        return actions.float()
    raise ValueError(f"cannot encode actions of {type(head).__name__}")


class ActorCritic(KeyedActorCritic):
    """Actor-critic over a ``Box`` observation: the one-step-key case of the keyed model
    interface (:class:`~impala_rl.nn.structured.StructuredActorCritic` has several keys).

    The torso is an encoder from :mod:`impala_rl.nn.encoders`: an MLP over the flattened
    observation (``encoder="mlp"``), a CNN over ``uint8`` images ``[C, H, W]``, or the user's
    ``package.module:Class`` built from the observation space and ``encoder_kwargs`` (see
    :class:`~impala_rl.nn.encoders.ImportedEncoder`). With ``shared_torso`` one torso feeds
    both heads; otherwise the policy and value each get their own, the value's from
    ``value_encoder`` and ``value_encoder_kwargs`` when given. ``use_last_action_reward``
    appends the previous decision's :meth:`last_inputs` (action one-hot, reward clipped to
    [-1, 1]) to each torso's output. ``core="lstm"`` puts an LSTM
    between the (shared) torso and the heads.

    Every method takes the step key first (always 0 here) so code outside ``nn/`` treats this
    model and a structured one alike: :meth:`act` for one acting step, :meth:`policy_value`
    over any batch of a model without a core, :meth:`encode`, ``core`` and :meth:`heads` along
    time-major columns of a model with one, :meth:`value` for a final observation.
    """

    step_keys: tuple[int, ...] = (0,)
    critic_keys: tuple[int, ...] = (0,)
    n_agents = 1

    def __init__(
        self,
        observation_space: gymnasium.spaces.Box,
        action_space: gymnasium.Space,
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
        shared_torso: bool = False,
        encoder: str = "mlp",
        core: str = "none",
        lstm_hidden_size: int = 256,
        use_last_action_reward: bool = False,
        precision: str = "fp32",
        channels_last: bool = False,
        actor_hidden_sizes: Sequence[int] | None = None,
        critic_hidden_sizes: Sequence[int] | None = None,
        normalize_obs: bool = False,
        popart_beta: float | None = None,
        encoder_kwargs: Mapping[str, Any] | None = None,
        value_encoder: str | None = None,
        value_encoder_kwargs: Mapping[str, Any] | None = None,
        policy_obs_keys: Sequence[str] | None = None,
        value_obs_keys: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(observation_space, (gymnasium.spaces.Box, gymnasium.spaces.Dict)):
            raise ValueError(
                f"ActorCritic needs a Box or Dict observation space, got {observation_space!r}; "
                "flatten Tuple/Discrete observations on the env side first"
            )
        # a Dict observation: an encoder per entry (DictEncoder), each entry's shape checked
        self.entry_shapes: dict[str, tuple[int, ...]] = {}
        if isinstance(observation_space, gymnasium.spaces.Dict):
            self.entry_shapes = {k: tuple(s.shape) for k, s in observation_space.spaces.items()}
        norm = obs_norm_for(observation_space) if normalize_obs else None
        if core not in CORES:
            raise ValueError(f"unknown core {core!r}; valid: {', '.join(CORES)}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
        if core != "none" and not shared_torso:
            raise ValueError(f"core={core!r} needs shared_torso=true (one torso feeds the core)")
        self.observation_space = observation_space
        self.action_space = action_space
        self.observation_spaces = {0: observation_space}
        self.action_spaces = {0: action_space}
        self.mask_sizes: dict[int, int | None] = {}
        self.obs_shape: tuple[int, ...] = tuple(observation_space.shape or ())
        self.obs_dim = int(np.prod(self.obs_shape, dtype=np.int64))
        self.shared_torso = bool(shared_torso)
        self.precision = precision
        self.use_last_action_reward = bool(use_last_action_reward)
        self.extra_features = (
            action_feature_size(action_space) + 1 if self.use_last_action_reward else 0
        )

        if self.shared_torso and (actor_hidden_sizes or critic_hidden_sizes):
            raise ValueError("separate actor/critic hidden sizes need shared_torso=false")
        if self.shared_torso and value_encoder is not None:
            raise ValueError("a value_encoder needs shared_torso=false (a value torso of its own)")

        if self.shared_torso and value_obs_keys is not None:
            raise ValueError("value_obs_keys need shared_torso=false (a value torso of its own)")
        policy_space = _entries(observation_space, policy_obs_keys, "model.policy_obs_keys")
        value_space = _entries(observation_space, value_obs_keys, "model.value_obs_keys")

        def torso(
            kind: str,
            kwargs: Mapping[str, Any] | None,
            sizes: Sequence[int] | None,
            field: str,
            space: gymnasium.Space,
        ) -> nn.Module:
            sizes = sizes or hidden_sizes
            return make_encoder(kind, self.obs_shape, sizes, activation, space, kwargs, field)

        self.obs_norm: RunningObsNorm | DictObsNorm | None = norm
        self.policy_torso = torso(
            encoder, encoder_kwargs, actor_hidden_sizes, "model.encoder", policy_space
        )
        self.value_torso: nn.Module | None = None
        if not self.shared_torso and value_encoder is None:
            self.value_torso = torso(
                encoder, encoder_kwargs, critic_hidden_sizes, "model.encoder", value_space
            )
        elif not self.shared_torso:
            self.value_torso = torso(
                value_encoder,
                value_encoder_kwargs,
                critic_hidden_sizes,
                "model.value_encoder",
                value_space,
            )
        features = self.policy_torso.out_features + self.extra_features
        self.core: LSTMCore | None = None
        if core == "lstm":
            self.core = LSTMCore(features, lstm_hidden_size, precision)
            features = self.core.out_features
        value_in = features
        if self.value_torso is not None:
            value_in = self.value_torso.out_features + self.extra_features
        self.policy_head: ActionHead = make_action_head(action_space, features)
        self.value_head: nn.Linear | PopArtValueHead
        if popart_beta is None:
            self.value_head = out = nn.Linear(value_in, 1)
        else:
            self.value_head = PopArtValueHead(value_in, popart_beta)
            out = self.value_head.linear
        nn.init.orthogonal_(out.weight, gain=1.0)
        nn.init.zeros_(out.bias)
        setattr(out, VALUE_HEAD, True)
        if channels_last:
            for module in (self.policy_torso, self.value_torso):
                if module is not None and hasattr(module, "use_channels_last"):
                    module.use_channels_last()
        self._register_load_state_dict_pre_hook(_renamed_action_head)

    def action_head(self, step_key: int = 0) -> ActionHead:
        """The action head of step key ``step_key`` (the only one)."""
        return self.policy_head

    def observation_normalizer(self, step_key: int = 0) -> RunningObsNorm | DictObsNorm | None:
        """The running statistics ``normalize_obs`` keeps for the key's observations."""
        return self.obs_norm

    def critic_key(self, step_key: int) -> int:
        """The critic that values step key ``step_key``'s observations: the only one."""
        return 0

    def popart_heads(self) -> dict[int, PopArtValueHead]:
        """The PopArt head of each critic key: the one value head's, if it is one."""
        return {0: self.value_head} if isinstance(self.value_head, PopArtValueHead) else {}

    def last_inputs(self, step_key: int, action: Tensor, reward: Tensor) -> Tensor:
        """What the next decision reads of this one (``use_last_action_reward``): the action
        ``[B, *a]`` encoded and the reward since ``[B]`` (clipped where read), ``[B, A + 1]``."""
        features = encode_actions(self.policy_head, action)
        return torch.cat([features, reward.to(features.device, torch.float32).unsqueeze(-1)], -1)

    # -- internals -------------------------------------------------------------------------------
    def _check(self, obs: Tensor) -> Tensor:
        """``obs`` must be ``[*batch, *obs_shape]``; returns it normalized (``normalize_obs``)."""
        if self.entry_shapes:
            _check_entries(obs, self.entry_shapes)
            return obs if self.obs_norm is None else self.obs_norm(obs)
        n = len(self.obs_shape)
        batch_ndim = obs.ndim - n
        if batch_ndim < 0 or tuple(obs.shape[batch_ndim:]) != self.obs_shape:
            raise ValueError(
                f"Expected observations of shape [*batch, {', '.join(map(str, self.obs_shape))}]"
                f", got {tuple(obs.shape)}"
            )
        return obs if self.obs_norm is None else self.obs_norm(obs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.value_head.weight.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _features(
        self, obs: Tensor, extra: Tensor | None, with_value: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Torso features for the policy (or the core) and, ``with_value``, for the value
        (the policy's when shared); float32 ``[*batch, F]``."""
        x = self._check(obs)
        extra = self._extra(extra, obs)
        value_features = None
        with self._autocast():
            features = self.policy_torso(x)
            if extra is not None:
                features = torch.cat([features, extra.to(features.dtype)], dim=-1)
            if with_value and self.value_torso is not None:
                value_features = self.value_torso(x)
                if extra is not None:
                    value_features = torch.cat(
                        [value_features, extra.to(value_features.dtype)], dim=-1
                    )
        features = features.float()
        if value_features is not None:
            value_features = value_features.float()
        elif with_value:
            value_features = features
        return features, value_features

    # -- the keyed interface -------------------------------------------------------------------
    def policy(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> ActionDistribution:
        """The action distribution for ``obs [*batch, *obs_shape]`` (a model without a core);
        ``extra [*batch, A + 1]``: :meth:`last_inputs` (``use_last_action_reward``)."""
        self._no_core("policy")
        _no_mask(action_mask)
        if self.precision == "fp32" and not self.use_last_action_reward:  # the actors' hot path
            return self.policy_head(self.policy_torso(self._check(obs)))
        features, _ = self._features(obs, extra, with_value=False)
        return self.policy_head(features)

    def policy_value(
        self,
        step_key: int,
        obs: Tensor,
        action_mask: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> tuple[ActionDistribution, Tensor]:
        """Action distribution and values ``[*batch]`` for ``obs [*batch, *obs_shape]`` (a
        model without a core), a shared torso run once."""
        self._no_core("policy_value")
        _no_mask(action_mask)
        features, value_features = self._features(obs, extra, with_value=True)
        return self.policy_head(features), self.value_head(value_features).squeeze(-1)

    def value(
        self,
        step_key: int,
        obs: Tensor,
        extra: Tensor | None = None,
        core_state: CoreState | None = None,
    ) -> Tensor:
        """Values ``[*batch]`` of ``obs [*batch, *obs_shape]``. A model with a core values one
        step ``[B, *obs_shape]`` that continues from ``core_state`` (no reset): a final
        observation at truncation."""
        if self.core is None:
            _, value_features = self._features(obs, extra, with_value=True)
            return self.value_head(value_features).squeeze(-1)
        return self._core_value(step_key, obs, extra, core_state)

    def encode(self, step_key: int, obs: Tensor, extra: Tensor | None = None) -> Tensor:
        """Torso features ``[*batch, F]`` (float32) followed by the last inputs when the model
        reads them: the core's input."""
        return self._features(obs, extra, with_value=False)[0]

    def action_distribution(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> ActionDistribution:
        """The action distribution for core outputs ``features [*batch, H]``."""
        _no_mask(action_mask)
        return self.policy_head(features)

    def heads(
        self, step_key: int, features: Tensor, action_mask: Tensor | None = None
    ) -> tuple[ActionDistribution, Tensor]:
        """Action distribution and value for core outputs ``features [*batch, H]``."""
        dist = self.action_distribution(step_key, features, action_mask)
        return dist, self.value_head(features).squeeze(-1)

    def policy_parameters(self, step_key: int | None = None) -> list[nn.Parameter]:
        """Parameters the policy loss trains (the shared torso and the core included); the one
        step key's for ``step_key`` 0 or ``None``."""
        core = [] if self.core is None else list(self.core.parameters())
        return [*self.policy_torso.parameters(), *core, *self.policy_head.parameters()]

    def critic_parameters(self, critic_key: int | None = None) -> list[nn.Parameter]:
        """Parameters the value loss trains (the shared torso and the core included); the one
        critic's for ``critic_key`` 0 or ``None``."""
        torso = self.policy_torso if self.value_torso is None else self.value_torso
        core = [] if self.core is None else list(self.core.parameters())
        return [*torso.parameters(), *core, *self.value_head.parameters()]


def _entries(space: gymnasium.Space, keys: Sequence[str] | None, field: str) -> gymnasium.Space:
    """The Dict observation's entries ``keys`` (in the space's order); ``space`` for None."""
    if keys is None:
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


def _check_entries(obs: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """``obs`` must be ``{entry: [*batch, *shape]}`` with every entry of ``shapes``."""
    if not isinstance(obs, dict) or set(obs) != set(shapes):
        got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
        raise ValueError(f"Expected a dict of observations {sorted(shapes)}, got {got}")
    for name, shape in shapes.items():
        x = obs[name]
        if x.ndim < len(shape) or tuple(x.shape[x.ndim - len(shape) :]) != shape:
            raise ValueError(
                f"Expected observations {name!r} of shape [*batch, "
                f"{', '.join(map(str, shape))}], got {tuple(x.shape)}"
            )


def _no_mask(action_mask: Tensor | None) -> None:
    if action_mask is not None:
        raise ValueError("action masks come with structured envs; this model has none")


def _renamed_action_head(state_dict: dict, prefix: str, *_args) -> None:
    """Checkpoints written before the keyed interface named the action head ``action_head``."""
    old = prefix + "action_head."
    for name in [n for n in state_dict if n.startswith(old)]:
        state_dict[prefix + "policy_head." + name[len(old) :]] = state_dict.pop(name)
