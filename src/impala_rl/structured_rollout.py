"""The actor loop for structured envs (:mod:`impala_rl.envs.structured`): one slot per unroll.

A structured slot holds ``T`` sub-steps of ``N`` envs, time-major. Every row is one sub-step of
one actor; the observation and action of a row live in the fields of its step key ``k``:

==========================  ====================  ============================================
field                       shape                 meaning
==========================  ====================  ============================================
``step_key``                ``[T+1, N]`` int64    who acts at row t: the step key...
``agent_id``                ``[T+1, N]`` int64    ...and the agent (row T: for bootstrapping)
``obs_{k}``                 ``[T+1, N, *o_k]``    observation at row t where ``step_key == k``
``action_mask_{k}``         ``[T+1, N, n_k]``     legal actions (keys with an action mask)
``action_{k}``              ``[T, N, *a_k]``      action taken at row t where ``step_key == k``
``first``                   ``[T+1, N]``          row t starts an episode
``behaviour_log_prob``      ``[T, N]``            log mu(a_t | x_t) of the acting policy
``reward``                  ``[T, N, n_agents]``  reward of every agent for sub-step t
``terminated``              ``[T, N]``            the episode ended for good after sub-step t
``truncated``               ``[T, N]``            the episode was cut after sub-step t
``actor_done``              ``[T, N]``            the actor of row t takes no more decisions
``policy_version``          ``[N]``               learner update count of the acting policy
``actor_index``             ``[N]``               which actor filled the column
==========================  ====================  ============================================

Entries of ``obs_{k}`` / ``action_{k}`` on rows of other keys are stale and never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from impala_rl.envs.structured import StructuredVectorEnv
from impala_rl.nn.structured import StructuredActorCritic
from impala_rl.rollout import EpisodeTracker, UnrollResult, torch_dtype, write_staged


@dataclass(frozen=True)
class StructuredRolloutSpec:
    """Shapes and dtypes of a structured slot: ``T`` sub-steps of ``N`` envs."""

    T: int
    N: int
    n_agents: int
    obs: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]  # (key, shape, dtype)
    actions: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    masks: tuple[tuple[int, int], ...]  # (key, n)

    def field_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        T, N = self.T, self.N
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "step_key": ((T + 1, N), torch.int64),
            "agent_id": ((T + 1, N), torch.int64),
        }
        for k, shape, dtype in self.obs:
            fields[f"obs_{k}"] = ((T + 1, N, *shape), dtype)
        for k, n in self.masks:
            fields[f"action_mask_{k}"] = ((T + 1, N, n), torch.bool)
        for k, shape, dtype in self.actions:
            fields[f"action_{k}"] = ((T, N, *shape), dtype)
        fields.update(
            {
                "first": ((T + 1, N), torch.bool),
                "behaviour_log_prob": ((T, N), torch.float32),
                "reward": ((T, N, self.n_agents), torch.float32),
                "terminated": ((T, N), torch.bool),
                "truncated": ((T, N), torch.bool),
                "actor_done": ((T, N), torch.bool),
                "policy_version": ((N,), torch.int64),
                "actor_index": ((N,), torch.int64),
            }
        )
        return fields

    def allocate(self, share_memory: bool = False) -> dict[str, torch.Tensor]:
        slot = {
            name: torch.zeros(shape, dtype=dtype)
            for name, (shape, dtype) in self.field_shapes().items()
        }
        if share_memory:
            for t in slot.values():
                t.share_memory_()
        return slot


def structured_spec_for(model: StructuredActorCritic, T: int, N: int) -> StructuredRolloutSpec:
    obs = tuple(
        (
            k,
            tuple(model.observation_spaces[k].shape),
            torch_dtype(model.observation_spaces[k].dtype),
        )
        for k in model.step_keys
    )
    actions = tuple(
        (k, tuple(model.action_head(k).action_shape), model.action_head(k).action_dtype)
        for k in model.step_keys
    )
    masks = tuple((k, n) for k, n in sorted(model.mask_sizes.items()) if n is not None)
    return StructuredRolloutSpec(T, N, model.n_agents, obs, actions, masks)


class StructuredActorLoop:
    """:class:`impala_rl.rollout.ActorLoop` for a structured env: the same interface.

    At each sub-step the envs are grouped by the step key that acts; each group's policy runs
    once on its observations. Episode returns are those of agent 0.
    """

    def __init__(
        self,
        env_factory: Callable[[], gym.Env],
        num_envs: int,
        model: StructuredActorCritic,
        seed: int,
        unroll_length: int,
        actor_index: int = 0,
    ):
        self.envs = StructuredVectorEnv([env_factory] * num_envs)
        self.model = model
        self.model.eval()
        self.num_envs = num_envs
        self.T = unroll_length
        self.actor_index = actor_index
        self.policy_version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.envs.reset(seed=seed)
        self.first = np.ones(num_envs, dtype=bool)
        self.episodes = EpisodeTracker(num_envs)

    def load_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Take new weights; only ever called between unrolls."""
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    def _record_row(self, slot: dict[str, torch.Tensor], t: int) -> list[tuple[int, np.ndarray]]:
        """Write the observations of row ``t`` into the slot; returns (key, env indices)."""
        envs = self.envs
        groups = []
        for k in envs.step_keys:
            idx = np.flatnonzero(envs.step_key == k)
            if idx.size == 0:
                continue
            tidx = torch.from_numpy(idx)
            slot[f"obs_{k}"][t, tidx] = torch.from_numpy(envs.obs[k][idx])
            if k in envs.masks:
                slot[f"action_mask_{k}"][t, tidx] = torch.from_numpy(envs.masks[k][idx])
            groups.append((k, idx))
        return groups

    @torch.inference_mode()
    def unroll(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """Run ``T`` sub-steps of every env, writing them into ``slot`` (module docstring)."""
        T, N = self.T, self.num_envs
        envs, model = self.envs, self.model
        A = envs.n_agents
        rewards = np.zeros((T, N, A), dtype=np.float32)
        terminated = np.zeros((T, N), dtype=bool)
        truncated = np.zeros((T, N), dtype=bool)
        actor_done = np.zeros((T, N), dtype=bool)
        first = np.zeros((T + 1, N), dtype=bool)
        step_key = np.zeros((T + 1, N), dtype=np.int64)
        agent_id = np.zeros((T + 1, N), dtype=np.int64)
        log_probs = np.zeros((T, N), dtype=np.float32)
        returns: list[float] = []
        lengths: list[int] = []
        actions: list = [None] * N
        for t in range(T):
            step_key[t], agent_id[t], first[t] = envs.step_key, envs.agent_id, self.first
            for k, idx in self._record_row(slot, t):
                tidx = torch.from_numpy(idx)
                obs = slot[f"obs_{k}"][t, tidx]
                mask = slot[f"action_mask_{k}"][t, tidx] if k in envs.masks else None
                dist = model.policy(k, obs, mask)
                action = dist.sample(self.generator)
                slot[f"action_{k}"][t, tidx] = action
                log_probs[t, idx] = dist.log_prob(action).float().numpy()
                env_actions = model.action_head(k).to_env(action)
                for j, i in enumerate(idx):
                    actions[i] = env_actions[j]
            reward, term, trunc, done_actor, _ = envs.step(actions)
            trunc = np.logical_and(trunc, np.logical_not(term))
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc
            actor_done[t] = done_actor
            done = np.logical_or(term, trunc)
            self.episodes.step(reward[:, 0], done, returns, lengths)
            self.first = done
        step_key[T], agent_id[T], first[T] = envs.step_key, envs.agent_id, self.first
        self._record_row(slot, T)
        staged = {
            "step_key": step_key,
            "agent_id": agent_id,
            "first": first,
            "behaviour_log_prob": log_probs,
            "reward": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "actor_done": actor_done,
        }
        write_staged(slot, staged, self.policy_version, self.actor_index)
        return UnrollResult(returns, lengths, T * N)

    def close(self) -> None:
        self.envs.close()
