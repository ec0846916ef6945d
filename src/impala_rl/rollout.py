"""The actor loop every backend runs: step a vector env with a policy copy, fill one slot.

A slot holds one unroll of ``T`` steps of ``N`` envs, time-major:

=====================  =================  ==================================================
field                  shape              meaning
=====================  =================  ==================================================
``obs``                ``[T+1, N, *o]``   observation before step t; ``obs[T]`` bootstraps
``first``              ``[T+1, N]``       ``obs[t]`` starts an episode (resets an LSTM core)
``action``             ``[T, N, *a]``     action taken (unclipped sample)
``behaviour_log_prob`` ``[T, N]``         log mu(a_t | x_t) of the acting policy
``reward``             ``[T, N]``         reward (unclipped)
``terminated``         ``[T, N]``         the episode ended for good: no bootstrap
``truncated``          ``[T, N]``         the episode was cut (time limit): bootstrap
``truncation_value``   ``[T, N]``         V(final obs) of the acting policy where truncated
``policy_version``     ``[N]``            learner update count of the acting policy
``actor_index``        ``[N]``            which actor filled the column
=====================  =================  ==================================================

With same-step autoreset ``obs[t+1]`` already belongs to the next episode when step ``t``
ended one; the learner's discount is zero there, so no value leaks across the reset, and
truncation adds ``gamma * truncation_value`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from impala_rl.envs import make_vector_env
from impala_rl.nn import ActorCritic

STEP_FIELDS = (
    "action",
    "behaviour_log_prob",
    "reward",
    "terminated",
    "truncated",
    "truncation_value",
)


@dataclass(frozen=True)
class RolloutSpec:
    """Shapes and dtypes of a slot: ``T`` steps of ``N`` envs."""

    T: int
    N: int
    obs_shape: tuple[int, ...]
    obs_dtype: torch.dtype
    action_shape: tuple[int, ...]
    action_dtype: torch.dtype

    def field_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        T, N = self.T, self.N
        return {
            "obs": ((T + 1, N, *self.obs_shape), self.obs_dtype),
            "first": ((T + 1, N), torch.bool),
            "action": ((T, N, *self.action_shape), self.action_dtype),
            "behaviour_log_prob": ((T, N), torch.float32),
            "reward": ((T, N), torch.float32),
            "terminated": ((T, N), torch.bool),
            "truncated": ((T, N), torch.bool),
            "truncation_value": ((T, N), torch.float32),
            "policy_version": ((N,), torch.int64),
            "actor_index": ((N,), torch.int64),
        }

    def allocate(self, share_memory: bool = False) -> dict[str, torch.Tensor]:
        slot = {
            name: torch.zeros(shape, dtype=dtype)
            for name, (shape, dtype) in self.field_shapes().items()
        }
        if share_memory:
            for t in slot.values():
                t.share_memory_()
        return slot


def column_block(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Views of columns ``start:stop`` of every field (the batch axis is 1, or 0 for ``[N]``)."""
    return {k: (v[start:stop] if v.ndim == 1 else v[:, start:stop]) for k, v in batch.items()}


def torch_dtype(np_dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=np_dtype)).dtype


def rollout_spec_for(
    model: ActorCritic, observation_space: gym.spaces.Box, T: int, N: int
) -> RolloutSpec:
    """The slot layout for ``model``; a structured model gets its own layout
    (:class:`impala_rl.structured_rollout.StructuredRolloutSpec`)."""
    if not isinstance(model, ActorCritic):
        from impala_rl.structured_rollout import structured_spec_for

        return structured_spec_for(model, T, N)  # type: ignore[return-value]
    head = model.action_head
    return RolloutSpec(
        T=T,
        N=N,
        obs_shape=tuple(observation_space.shape),
        obs_dtype=torch_dtype(observation_space.dtype),
        action_shape=tuple(head.action_shape),
        action_dtype=head.action_dtype,
    )


@dataclass
class UnrollResult:
    """What an unroll reports besides the slot contents."""

    episode_returns: list[float]
    episode_lengths: list[int]
    env_steps: int


class ActorLoop:
    """One actor: a vector env of ``num_envs`` envs and a CPU copy of the policy.

    ``seed`` fixes the envs' reset seeds and the action sampler, so a backend that runs the
    same actor index with the same weights produces the same slot contents.
    """

    def __init__(
        self,
        env_factory: Callable[[], gym.Env],
        num_envs: int,
        model: ActorCritic,
        seed: int,
        unroll_length: int,
        actor_index: int = 0,
    ):
        self.envs = make_vector_env(env_factory, num_envs)
        self.model = model
        self.model.eval()
        self.num_envs = num_envs
        self.T = unroll_length
        self.actor_index = actor_index
        self.policy_version = 0
        self.generator = torch.Generator().manual_seed(seed)
        obs, _ = self.envs.reset(seed=seed)
        self.obs = torch.as_tensor(obs)
        self.first = np.ones(num_envs, dtype=bool)
        self.ep_return = np.zeros(num_envs, dtype=np.float64)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)

    def load_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Take new weights; only ever called between unrolls."""
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    @torch.inference_mode()
    def unroll(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """Run ``T`` steps of every env, writing them into ``slot`` (see module docstring).

        Per-step scalars are staged in numpy and copied into the slot once per unroll: on
        cheap envs the per-step tensor bookkeeping would otherwise cost as much as the env.
        """
        T, N = self.T, self.num_envs
        head = self.model.action_head
        rewards = np.zeros((T, N), dtype=np.float32)
        terminated = np.zeros((T, N), dtype=bool)
        truncated = np.zeros((T, N), dtype=bool)
        trunc_values = np.zeros((T, N), dtype=np.float32)
        first = np.zeros((T + 1, N), dtype=bool)
        returns: list[float] = []
        lengths: list[int] = []
        obs_slot, action_slot, logp_slot = slot["obs"], slot["action"], slot["behaviour_log_prob"]
        for t in range(T):
            obs_slot[t] = self.obs
            first[t] = self.first
            dist = self.model.policy(self.obs)
            action = dist.sample(self.generator)
            action_slot[t] = action
            logp_slot[t] = dist.log_prob(action)
            obs, reward, term, trunc, info = self.envs.step(head.to_env(action))
            trunc = np.logical_and(trunc, np.logical_not(term))
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc
            if trunc.any():
                idx = np.flatnonzero(trunc)
                final = torch.as_tensor(np.stack([info["final_obs"][i] for i in idx]))
                trunc_values[t, idx] = self.model.value(final).float().numpy()
            self.ep_return += reward
            self.ep_length += 1
            done = np.logical_or(term, trunc)
            if done.any():
                for i in np.flatnonzero(done):
                    returns.append(float(self.ep_return[i]))
                    lengths.append(int(self.ep_length[i]))
                self.ep_return[done] = 0.0
                self.ep_length[done] = 0
            self.first = done
            self.obs = torch.as_tensor(obs)
        obs_slot[T] = self.obs
        first[T] = self.first
        slot["first"].copy_(torch.from_numpy(first))
        slot["reward"].copy_(torch.from_numpy(rewards))
        slot["terminated"].copy_(torch.from_numpy(terminated))
        slot["truncated"].copy_(torch.from_numpy(truncated))
        slot["truncation_value"].copy_(torch.from_numpy(trunc_values))
        slot["policy_version"].fill_(self.policy_version)
        slot["actor_index"].fill_(self.actor_index)
        return UnrollResult(returns, lengths, T * N)

    def close(self) -> None:
        self.envs.close()


def make_actor_loop(
    env_factory: Callable[[], gym.Env],
    num_envs: int,
    model: ActorCritic,
    seed: int,
    unroll_length: int,
    actor_index: int = 0,
) -> ActorLoop:
    """The actor loop for ``model``: :class:`ActorLoop`, or the structured-env loop."""
    if not isinstance(model, ActorCritic):
        from impala_rl.structured_rollout import StructuredActorLoop

        return StructuredActorLoop(  # type: ignore[return-value]
            env_factory, num_envs, model, seed, unroll_length, actor_index
        )
    return ActorLoop(env_factory, num_envs, model, seed, unroll_length, actor_index)
