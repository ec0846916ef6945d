"""Every agent's decision stream: what its next decision reads, and what it decided.

A *stream* is one agent of one env (stream ``i * A + a`` for agent ``a`` of env ``i``; a plain
env is one agent, so its streams are its envs). :class:`DecisionStreams` owns, per stream:

- ``first``: the next decision is the agent's first of an episode (it resets a core);
- the core state the next decision starts from (a model with a core);
- the last inputs: the agent's previous action and the reward since (a model that reads them;
  zero at an episode's first decision);
- the open decision and the closed ones waiting for a slot (when it keeps them);

and per env the running episode's return (agent 0's) and length.

An actor (:class:`impala_rl.rollout.ActorLoop`), the rollout evaluator and
:class:`impala_rl.policy.Policy` all step through it: :meth:`DecisionStreams.decide` gathers
a group of streams' inputs (none when every stream decides: the plain env's fast path), acts
through one acting object, and scatters the new state back; :meth:`rewarded` and
:meth:`end_episodes` follow the env's step. How to act is the acting object's business:
:class:`LocalActing` runs the model in the caller's process, central inference
(:class:`impala_rl.actors.inference.CentralActing`) asks a server.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from impala_rl.nn import Acted, Model, act
from impala_rl.nn.core import CoreState
from impala_rl.nn.observations import Obs, map_obs


class LocalActing:
    """Inference in the caller's process, on its own copy of the policy.

    The decision streams act through an object like this one: :meth:`act` one decision of a
    group of agents, :meth:`value` a final observation's value, :meth:`unroll_version` the
    policy version to stamp on a finished unroll. Central inference
    (:class:`impala_rl.actors.inference.CentralActing`) has the same three methods.
    ``deterministic`` takes the distribution's mode instead of sampling with ``generator``.
    """

    def __init__(
        self,
        model: Model,
        generator: torch.Generator | None = None,
        deterministic: bool = False,
    ):
        self.model = model
        self.generator = generator
        self.deterministic = deterministic

    def act(
        self,
        step_key: int,
        obs: Obs,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: CoreState | None,
        extra: torch.Tensor | None,
    ) -> Acted:
        return act(
            self.model,
            step_key,
            obs,
            action_mask,
            first,
            core_state,
            extra,
            self.deterministic,
            self.generator,
        )

    def value(
        self, step_key: int, obs: Obs, extra: torch.Tensor | None, core_state: CoreState | None
    ) -> torch.Tensor:
        return self.model.value(step_key, obs, extra, core_state)

    def unroll_version(self, loaded_version: int) -> int:
        """The version of the weights this unroll acted with: the ones loaded before it."""
        return loaded_version


@dataclass
class Decision:
    """One decision of a stream, kept until it is written into a slot."""

    key: int
    obs: Obs  # [*o_k], or a Dict observation's entries
    mask: np.ndarray | None
    action: torch.Tensor
    log_prob: float = 0.0
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    truncation_value: float = 0.0
    age: int = 0  # the env steps taken before it: the oldest chunk goes first
    first: bool = False  # the agent's first decision of an episode (a model with a core)
    core_state: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, c) [H] before it
    last_inputs: torch.Tensor | None = None  # [E] the agent's previous action and reward


@dataclass
class Inputs:
    """What a group of ``B`` streams' decision reads besides its observation."""

    first: np.ndarray  # [B] bool: the agent's first decision of an episode
    core_state: CoreState | None  # (h, c) [1, B, H] before it; None: no core
    extra: torch.Tensor | None  # [B, E] previous action and reward since; None: not read


@dataclass
class FinishedEpisodes:
    """Episodes that ended at one env step: their envs, agent 0's returns, their lengths."""

    envs: np.ndarray  # [n] env indices, ascending
    returns: np.ndarray  # [n] float64
    lengths: np.ndarray  # [n] int64 env steps


class DecisionStreams:
    """The decision streams of ``num_envs`` envs of ``n_agents`` agents each (see the module
    docstring), acting through ``acting`` (with ``model``'s inputs, core state on ``device``).

    ``keep_decisions`` keeps each stream's open decision and a queue of its closed ones (what
    an actor of a structured env writes into slots); without it only the inputs of the next
    decision are kept.
    """

    def __init__(
        self,
        model: Model,
        acting: Any,
        num_envs: int,
        n_agents: int = 1,
        device: torch.device | str = "cpu",
        keep_decisions: bool = False,
    ):
        self.model = model
        self.acting = acting
        self.num_envs = num_envs
        self.n_agents = n_agents
        self.device = device
        n = num_envs * n_agents
        self.size = n
        self.first = np.ones(n, dtype=bool)
        self.core_state = model.initial_state(n, device)
        self.reward_since = np.zeros(n, dtype=np.float64)  # since the stream's last decision
        self.last_features: torch.Tensor | None = None  # [n, E]: the last action, encoded
        self.has_last = np.zeros(n, dtype=bool)  # last_features holds this episode's action
        if model.use_last_action_reward:
            self.last_features = torch.zeros(n, model.extra_features)
        self.episode_return = np.zeros(num_envs, dtype=np.float64)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self.env_steps = 0
        self.keep_decisions = keep_decisions
        self.open: list[Decision | None] = [None] * n if keep_decisions else []
        self.closed: list[collections.deque[Decision]] = (
            [collections.deque() for _ in range(n)] if keep_decisions else []
        )

    def streams(self, envs: np.ndarray, agents: np.ndarray) -> np.ndarray:
        """The streams of agent ``agents[j]`` of env ``envs[j]``."""
        return envs * self.n_agents + agents

    def inputs(self, streams: np.ndarray | None = None) -> Inputs:
        """What the next decision of ``streams`` (None: all, in order) reads."""
        if streams is None:
            first = self.first.copy()
            state = self.core_state
        else:
            first = self.first[streams]
            state = None
            if self.core_state is not None:
                cols = torch.as_tensor(streams, device=self.core_state[0].device)
                state = (self.core_state[0][:, cols], self.core_state[1][:, cols])
        extra = None
        if self.last_features is not None:
            if streams is None:
                extra, reward, unset = self.last_features.clone(), self.reward_since, ~self.has_last
            else:
                rows = torch.from_numpy(streams)
                extra, reward = self.last_features[rows], self.reward_since[streams]
                unset = ~self.has_last[streams]
            extra[:, -1] = torch.from_numpy(reward).float()
            extra = extra.masked_fill(torch.from_numpy(unset).unsqueeze(-1), 0.0)
            extra = extra.to(self.device)
        return Inputs(first, state, extra)

    def decide(
        self,
        step_key: int,
        obs: Obs,
        action_mask: torch.Tensor | None = None,
        streams: np.ndarray | None = None,
    ) -> tuple[Acted, Inputs]:
        """One decision of ``streams`` (None: every stream, in order) on ``obs [B, *o_k]``
        with step key ``step_key``'s policy; returns it and the inputs it read."""
        inputs = self.inputs(streams)
        first = None
        if inputs.core_state is not None:
            first = torch.as_tensor(inputs.first, device=self.core_state[0].device)
        acted = self.acting.act(step_key, obs, action_mask, first, inputs.core_state, inputs.extra)
        if self.core_state is not None:
            if streams is None:
                self.core_state = acted.core_state
            else:
                cols = torch.as_tensor(streams, device=self.core_state[0].device)
                self.core_state[0][:, cols], self.core_state[1][:, cols] = acted.core_state
        if self.keep_decisions:
            self._open(step_key, obs, action_mask, acted, inputs, streams)
        index = slice(None) if streams is None else streams
        if self.last_features is not None:
            action = acted.action.cpu()
            rows = index if streams is None else torch.from_numpy(streams)
            zero = torch.zeros(action.shape[0])
            self.last_features[rows] = self.model.last_inputs(step_key, action, zero)
            self.has_last[index] = True
        self.reward_since[index] = 0.0
        self.first[index] = False
        return acted, inputs

    def _open(
        self,
        step_key: int,
        obs: Obs,
        mask: torch.Tensor | None,
        acted: Acted,
        inputs: Inputs,
        streams: np.ndarray | None,
    ) -> None:
        """Close each stream's open decision (its segment ends here) and open this one."""
        ids = range(self.size) if streams is None else streams.tolist()
        log_prob = acted.log_prob.float().cpu().numpy()
        state, extra = inputs.core_state, inputs.extra
        for j, s in enumerate(ids):
            self.close(s)
            self.open[s] = Decision(
                step_key,
                map_obs(obs, lambda x, j=j: x[j].clone()),
                None if mask is None else mask[j].numpy().copy(),
                acted.action[j].clone(),
                float(log_prob[j]),
                age=self.env_steps,
                first=bool(inputs.first[j]),
                core_state=None if state is None else (state[0][0, j], state[1][0, j]),
                last_inputs=None if extra is None else extra[j],
            )

    def close(
        self, stream: int, terminated: bool = False, truncation_value: float | None = None
    ) -> None:
        """Close ``stream``'s open decision with the reward since it: at the agent's next
        decision, or at its episode's end (``terminated``; truncated when a
        ``truncation_value`` is given). Its next decision reads no last inputs of it."""
        self.has_last[stream] = False
        if not self.keep_decisions:
            return
        decision = self.open[stream]
        if decision is not None:
            decision.reward = float(self.reward_since[stream])
            decision.terminated = terminated
            if truncation_value is not None:
                decision.truncated = True
                decision.truncation_value = truncation_value
            self.closed[stream].append(decision)
            self.open[stream] = None

    def final_values(self, step_key: int, streams: np.ndarray, obs: Obs) -> torch.Tensor:
        """``[B]`` the acting policy's values of ``streams``' final observations at a
        truncation, which continue each agent's sequence (its core state and last inputs, no
        reset): ask before :meth:`end_episodes`."""
        inputs = self.inputs(streams)
        return self.acting.value(step_key, obs, inputs.extra, inputs.core_state)

    def rewarded(self, reward: np.ndarray) -> None:
        """One env step's rewards, ``[num_envs]`` (one agent) or ``[num_envs, n_agents]``:
        every stream's reward since its last decision, and agent 0's episode return."""
        per_agent = reward.reshape(self.num_envs, self.n_agents)
        self.reward_since += per_agent.reshape(-1)
        self.episode_return += per_agent[:, 0]
        self.episode_length += 1
        self.env_steps += 1

    def reported_rewards(self, reward: np.ndarray, streams: np.ndarray | None = None) -> None:
        """The reward each of ``streams`` (None: all) received since its last decision, as a
        caller that steps its env itself reports it (:class:`impala_rl.policy.Policy`)."""
        self.reward_since[slice(None) if streams is None else streams] = reward

    def end_episodes(self, done: np.ndarray) -> FinishedEpisodes | None:
        """End the episodes of the envs where ``done [num_envs]``: every agent's next decision
        there is its first; returns what they scored (None: none ended)."""
        if not done.any():
            return None
        envs = np.flatnonzero(done)
        finished = FinishedEpisodes(
            envs, self.episode_return[envs].copy(), self.episode_length[envs].copy()
        )
        self.episode_return[envs] = 0.0
        self.episode_length[envs] = 0
        streams = np.repeat(done, self.n_agents)  # every agent of those envs
        self.first[streams] = True
        self.has_last[streams] = False
        self.reward_since[streams] = 0.0
        return finished
