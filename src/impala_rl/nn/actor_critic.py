"""Actor-critic network: encoder torso(s), an optional LSTM core, an action head and a value head.

Data flow for one step: ``obs -> encoder -> [concat last action, last reward] -> [LSTM core]
-> heads``. The encoder and core run under bf16 autocast when ``precision="bf16"`` (weights
stay float32); the heads always run in float32 so log-probabilities and values keep their
precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from impala_rl.nn.core import CORES, CoreState, LSTMCore
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
from impala_rl.nn.normalization import RunningObsNorm
from impala_rl.nn.popart import PopArtValueHead

__all__ = ["PRECISIONS", "ActorCritic", "PolicyOutput"]

PRECISIONS = ("fp32", "bf16")


@dataclass
class PolicyOutput:
    """Policy distribution and state value for a batch of observations."""

    dist: ActionDistribution  # over [*batch]
    value: Tensor  # [*batch]
    core_state: CoreState | None = None  # (h, c) [1, B, H] after the last step; None: no core


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


class ActorCritic(nn.Module):
    """Actor-critic over a ``Box`` observation.

    The torso is an encoder from :mod:`impala_rl.nn.encoders`: an MLP over the flattened
    observation (``encoder="mlp"``), or a CNN over ``uint8`` images ``[C, H, W]``. With
    ``shared_torso`` one torso feeds both heads; otherwise the policy and value each get their
    own. ``use_last_action_reward`` appends the previous action (one-hot) and the previous
    reward clipped to [-1, 1] to each torso's output. ``core="lstm"`` puts an LSTM between the
    (shared) torso and the heads.

    Models without a core take observations with any leading batch dims ``[*batch]``. With a
    core the input is a time-major sequence ``[T, B]`` with ``first [T, B]`` (episode starts:
    the state resets there) and the state before step 0; :meth:`act` and :meth:`value` take
    one step ``[B]``.
    """

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
    ) -> None:
        super().__init__()
        if not isinstance(observation_space, gymnasium.spaces.Box):
            raise ValueError(
                f"ActorCritic needs a Box observation space, got {observation_space!r}; "
                "flatten Dict/Tuple/Discrete observations on the env side first"
            )
        if core not in CORES:
            raise ValueError(f"unknown core {core!r}; valid: {', '.join(CORES)}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
        if core != "none" and not shared_torso:
            raise ValueError(f"core={core!r} needs shared_torso=true (one torso feeds the core)")
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape: tuple[int, ...] = tuple(observation_space.shape)
        self.obs_dim = int(np.prod(self.obs_shape, dtype=np.int64))
        self.shared_torso = bool(shared_torso)
        self.precision = precision
        self.use_last_action_reward = bool(use_last_action_reward)
        self.extra_features = (
            action_feature_size(action_space) + 1 if self.use_last_action_reward else 0
        )

        if self.shared_torso and (actor_hidden_sizes or critic_hidden_sizes):
            raise ValueError("separate actor/critic hidden sizes need shared_torso=false")

        def torso(sizes: Sequence[int] | None) -> nn.Module:
            return make_encoder(encoder, self.obs_shape, sizes or hidden_sizes, activation)

        self.obs_norm = RunningObsNorm(self.obs_shape) if normalize_obs else None
        self.policy_torso = torso(actor_hidden_sizes)
        self.value_torso: nn.Module | None = (
            None if self.shared_torso else torso(critic_hidden_sizes)
        )
        features = self.policy_torso.out_features + self.extra_features
        self.core: LSTMCore | None = None
        if core == "lstm":
            self.core = LSTMCore(features, lstm_hidden_size)
            features = self.core.out_features
        value_in = features
        if self.value_torso is not None:
            value_in = self.value_torso.out_features + self.extra_features
        self.action_head: ActionHead = make_action_head(action_space, features)
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

    # -- properties ------------------------------------------------------------------------------
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

    # -- internals -------------------------------------------------------------------------------
    def _check(self, obs: Tensor) -> Tensor:
        """``obs`` must be ``[*batch, *obs_shape]``; the torsos flatten or convolve what this
        returns (``obs``, normalized with ``normalize_obs``)."""
        n = len(self.obs_shape)
        batch_ndim = obs.ndim - n
        if batch_ndim < 0 or tuple(obs.shape[batch_ndim:]) != self.obs_shape:
            raise ValueError(
                f"Expected observations of shape [*batch, {', '.join(map(str, self.obs_shape))}]"
                f", got {tuple(obs.shape)}"
            )
        if self.core is not None and batch_ndim != 2:
            raise ValueError(
                "a model with a core needs time-major observations [T, B, *obs_shape], got "
                f"{tuple(obs.shape)}"
            )
        return obs if self.obs_norm is None else self.obs_norm(obs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(self.value_head.weight.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _extra(
        self,
        obs: Tensor,
        first: Tensor | None,
        last_action: Tensor | None,
        last_reward: Tensor | None,
    ) -> Tensor:
        """Last action and clipped last reward as features ``[*batch, A + 1]``; zero where
        ``first [*batch]`` is true (a one-hot would otherwise claim action 0)."""
        batch = obs.shape[: obs.ndim - len(self.obs_shape)]
        if last_action is None or last_reward is None:
            raise ValueError("use_last_action_reward needs last_action and last_reward inputs")
        features = encode_actions(self.action_head, last_action.to(obs.device))
        reward = last_reward.to(obs.device, torch.float32).clamp(-1.0, 1.0).unsqueeze(-1)
        extra = torch.cat([features, reward], dim=-1).reshape(*batch, self.extra_features)
        if first is not None:
            extra = extra * (~first.to(obs.device).bool()).unsqueeze(-1)
        return extra

    def _features(
        self,
        obs: Tensor,
        first: Tensor | None,
        core_state: CoreState | None,
        last_action: Tensor | None,
        last_reward: Tensor | None,
        with_value: bool,
    ) -> tuple[Tensor, Tensor | None, CoreState | None]:
        """Policy features, value features (``None`` when shared or not asked for), core state;
        features are float32 ``[*batch, F]``."""
        x = self._check(obs)
        extra = None
        if self.use_last_action_reward:
            extra = self._extra(obs, first, last_action, last_reward)
        state = None
        value_features = None
        with self._autocast():
            features = self.policy_torso(x)
            if extra is not None:
                features = torch.cat([features, extra.to(features.dtype)], dim=-1)
            if self.core is not None:
                features, state = self.core(features, first, core_state)
                state = (state[0].float(), state[1].float())
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
        return features, value_features, state

    # -- public API ------------------------------------------------------------------------------
    def forward(
        self,
        obs: Tensor,
        first: Tensor | None = None,
        core_state: CoreState | None = None,
        last_action: Tensor | None = None,
        last_reward: Tensor | None = None,
    ) -> PolicyOutput:
        """Action distribution and value for ``obs [*batch, *obs_shape]``.

        With a core ``obs`` is ``[T, B, *obs_shape]``, ``first [T, B]`` marks episode starts
        (the state resets before those steps; ``None``: none) and ``core_state`` is the state
        before step 0 (``None``: zeros); the output carries the state after step ``T - 1``.
        ``last_action [*batch, *action_shape]`` and ``last_reward [*batch]`` are needed with
        ``use_last_action_reward``; where ``first [*batch]`` is true they are replaced by zeros.
        """
        features, value_features, state = self._features(
            obs, first, core_state, last_action, last_reward, with_value=True
        )
        dist = self.action_head(features)
        value = self.value_head(value_features).squeeze(-1)
        return PolicyOutput(dist=dist, value=value, core_state=state)

    def act(
        self,
        obs: Tensor,
        first: Tensor | None = None,
        core_state: CoreState | None = None,
        last_action: Tensor | None = None,
        last_reward: Tensor | None = None,
    ) -> tuple[ActionDistribution, CoreState | None]:
        """One acting step: the action distribution over ``[B]`` for ``obs [B, *obs_shape]``
        and the core state after it (``None`` without a core). The value is not computed."""
        if self.core is None:
            features, _, _ = self._features(
                obs, first, None, last_action, last_reward, with_value=False
            )
            return self.action_head(features), None
        features, _, state = self._features(
            obs.unsqueeze(0),
            None if first is None else first.reshape(1, -1),
            core_state,
            None if last_action is None else last_action.unsqueeze(0),
            None if last_reward is None else last_reward.unsqueeze(0),
            with_value=False,
        )
        return self.action_head(features[0]), state

    def policy(self, obs: Tensor) -> ActionDistribution:
        """The action distribution alone for a model that reads only observations:
        ``obs [*batch, *obs_shape]``."""
        if self.needs_inputs:
            raise ValueError("this model needs more than observations: use act()")
        if self.precision == "fp32":  # the actor's hot path on plain models
            return self.action_head(self.policy_torso(self._check(obs)))
        features, _, _ = self._features(obs, None, None, None, None, with_value=False)
        return self.action_head(features)

    def value(
        self,
        obs: Tensor,
        core_state: CoreState | None = None,
        last_action: Tensor | None = None,
        last_reward: Tensor | None = None,
    ) -> Tensor:
        """State values ``[*batch]`` for ``obs [*batch, *obs_shape]``; with a core ``obs`` is
        one step ``[B, *obs_shape]`` continuing from ``core_state`` (no reset)."""
        if self.core is None:
            _, value_features, _ = self._features(
                obs, None, None, last_action, last_reward, with_value=True
            )
            return self.value_head(value_features).squeeze(-1)
        _, value_features, _ = self._features(
            obs.unsqueeze(0),
            None,
            core_state,
            None if last_action is None else last_action.unsqueeze(0),
            None if last_reward is None else last_reward.unsqueeze(0),
            with_value=True,
        )
        return self.value_head(value_features[0]).squeeze(-1)

    # -- step keys: a plain env is one agent with the single step key 0 and critic 0 -----------
    step_keys: tuple[int, ...] = (0,)
    critic_keys: tuple[int, ...] = (0,)

    def critic_key(self, step_key: int) -> int:
        """The critic that values step key ``step_key``'s observations: the only one."""
        return 0

    def popart_heads(self) -> dict[int, PopArtValueHead]:
        """The PopArt head of each critic key: the one value head's, if it is one."""
        return {0: self.value_head} if isinstance(self.value_head, PopArtValueHead) else {}

    def policy_parameters(self, step_key: int | None = None) -> list[nn.Parameter]:
        """Parameters the policy loss trains (the shared torso and the core included); the one
        step key's for ``step_key`` 0 or ``None``."""
        core = [] if self.core is None else list(self.core.parameters())
        return [*self.policy_torso.parameters(), *core, *self.action_head.parameters()]

    def critic_parameters(self, critic_key: int | None = None) -> list[nn.Parameter]:
        """Parameters the value loss trains (the shared torso and the core included); the one
        critic's for ``critic_key`` 0 or ``None``."""
        torso = self.policy_torso if self.value_torso is None else self.value_torso
        core = [] if self.core is None else list(self.core.parameters())
        return [*torso.parameters(), *core, *self.value_head.parameters()]
