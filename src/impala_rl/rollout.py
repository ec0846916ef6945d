"""The actor loop every backend runs: step envs with a policy copy, fill one slot.

A slot's column is one agent's decision stream in one env, and row t its t-th decision (a
plain env has one agent deciding at every step, so a column is one env's steps). Time-major,
``N`` columns of ``T`` decisions and the bootstrap row:

===========================  =================  ============================================
field                        shape              meaning
===========================  =================  ============================================
``obs`` (``obs_{k}``)        ``[T+1, N, *o]``   observation at decision t; row T bootstraps
                                                (a Dict observation: ``obs.<entry>``, each
                                                entry in its own dtype)
``action`` (``action_{k}``)  ``[T+1, N, *a]``   action taken (unclipped sample); row T unused
``action_mask`` (``_{k}``)   ``[T+1, N, n]``    legal actions (keys with an action mask)
``step_key``                 ``[T+1, N]``       which key decides at row t (several keys)
``first``                    ``[T+1, N]``       row t is the agent's first decision of an
                                                episode (resets an LSTM core)
``behaviour_log_prob``       ``[T, N]``         log mu(a_t | x_t) of the acting policy
``reward``                   ``[T, N]``         the agent's rewards from decision t up to its
                                                next decision or the episode's end
``terminated``               ``[T, N]``         the episode ended for good after row t (or the
                                                agent is done): no bootstrap
``truncated``                ``[T, N]``         the episode was cut after row t (time limit):
                                                bootstrap from the final observation
``truncation_value``         ``[T, N]``         V(final obs) of the acting policy there
``policy_version``           ``[N]``            learner update count of the acting policy
``actor_index``              ``[N]``            which actor filled the column
``core_h``, ``core_c``       ``[1, N, H]``      LSTM core state before row 0 (a core)
``last_inputs``              ``[T+1, N, E]``    (``use_last_action_reward``) the agent's
                                                previous action and the reward since, as the
                                                model's ``last_inputs`` encodes them; zero
                                                where ``first``
===========================  =================  ============================================

With one step key the fields are ``obs``, ``action``, ``action_mask``; with several each key
has its own (``obs_{k}``: zero on rows of other keys, never read) and ``step_key`` says which.
The optional fields exist only when the model reads them, so a plain model's slot (and its
copying) stays small. The core state is stored before ``first[0]`` resets it; the learner
replays the core from it over ``[T+1, N]`` with the same resets.

With same-step autoreset ``obs[t+1]`` already belongs to the next episode when step ``t``
ended one; the learner's discount is zero there, so no value leaks across the reset, and
truncation adds ``gamma * truncation_value`` instead.

One actor loop, :class:`ActorLoop`, fills this slot for every env: a plain vector env takes
its fast path (every env decides at every step: one policy call and one slice write per field
and step), a structured env its per-agent decision queues. A column is written only when its
stream holds ``T`` closed decisions, so no row is padding and the learner needs no mask.
"""

from __future__ import annotations

import collections
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala_rl.envs import make_keyed_vector_env
from impala_rl.envs.structured import SingleKeyVectorEnv
from impala_rl.nn import Acted, Model, act
from impala_rl.nn.observations import Obs, as_obs, entry_field, map_obs, stack_obs, write_obs


def allocate_fields(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    share_memory: bool = False,
    pin_memory: bool = False,
) -> dict[str, torch.Tensor]:
    """Zeroed tensors for a slot's ``{name: (shape, dtype)}``: in shared memory, or in pinned
    memory (for asynchronous uploads to a GPU), if asked."""
    slot = {
        name: torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        for name, (shape, dtype) in shapes.items()
    }
    if share_memory:
        for t in slot.values():
            t.share_memory_()
    return slot


@dataclass(frozen=True)
class KeyLayout:
    """What one step key's rows hold: its observation, its action, its action mask if any.
    A Dict observation has ``obs_entries``, ``(name, shape, dtype)`` per entry (its
    ``obs_shape`` and ``obs_dtype`` are then unused)."""

    obs_shape: tuple[int, ...]
    obs_dtype: torch.dtype
    action_shape: tuple[int, ...]
    action_dtype: torch.dtype
    mask_size: int | None = None
    obs_entries: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()

    def obs_fields(self, field: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{field name: (shape of one row, dtype)}`` of the observation called ``field``."""
        if not self.obs_entries:
            return {field: (self.obs_shape, self.obs_dtype)}
        return {entry_field(field, n): (shape, dtype) for n, shape, dtype in self.obs_entries}


@dataclass(frozen=True)
class RolloutSpec:
    """Shapes and dtypes of a slot: ``N`` columns of ``T`` decisions, for every env.

    ``keys[k]`` lays out step key ``k``'s fields. With one key (a plain env, or a game whose
    seats share one policy) they are ``obs``, ``action`` (and ``action_mask``) and every row
    is that key's; with several keys each has its own ``obs_{k}``, ``action_{k}``,
    ``action_mask_{k}`` and ``step_key`` says which one decides at each row. The fields the
    model reads besides observations exist only when it reads them (a plain model's slot, and
    its copying, stay as small as they can be): the core state, and the last action and reward
    (``last_inputs``, encoded by the model's ``last_inputs``).
    """

    T: int
    N: int
    keys: tuple[KeyLayout, ...]
    core_state_size: int = 0
    """H of the LSTM core's ``(h, c)``; 0: the model has no core."""
    last_inputs_size: int = 0
    """Width of the ``last_inputs`` field (the encoded last action and reward; 0: none)."""

    def key_field(self, name: str, key: int) -> str:
        """The field holding step key ``key``'s ``name`` (``obs``, ``action``, ``action_mask``)."""
        return name if len(self.keys) == 1 else f"{name}_{key}"

    def field_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        T, N = self.T, self.N
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for k, key in enumerate(self.keys):
            for name, (shape, dtype) in key.obs_fields(self.key_field("obs", k)).items():
                fields[name] = ((T + 1, N, *shape), dtype)
            fields[self.key_field("action", k)] = ((T + 1, N, *key.action_shape), key.action_dtype)
            if key.mask_size is not None:
                fields[self.key_field("action_mask", k)] = ((T + 1, N, key.mask_size), torch.bool)
        if len(self.keys) > 1:
            fields["step_key"] = ((T + 1, N), torch.int64)
        fields.update(
            {
                "first": ((T + 1, N), torch.bool),
                "behaviour_log_prob": ((T, N), torch.float32),
                "reward": ((T, N), torch.float32),
                "terminated": ((T, N), torch.bool),
                "truncated": ((T, N), torch.bool),
                "truncation_value": ((T, N), torch.float32),
                "policy_version": ((N,), torch.int64),
                "actor_index": ((N,), torch.int64),
            }
        )
        if self.core_state_size:
            fields["core_h"] = ((1, N, self.core_state_size), torch.float32)
            fields["core_c"] = ((1, N, self.core_state_size), torch.float32)
        if self.last_inputs_size:
            fields["last_inputs"] = ((T + 1, N, self.last_inputs_size), torch.float32)
        return fields

    def allocate(
        self, share_memory: bool = False, n_slots: int | None = None, pin_memory: bool = False
    ) -> dict[str, torch.Tensor]:
        """One slot, or with ``n_slots`` that many stacked: ``{field: [n_slots, ...]}``."""
        shapes = self.field_shapes()
        if n_slots is not None:
            shapes = {k: ((n_slots, *shape), dtype) for k, (shape, dtype) in shapes.items()}
        return allocate_fields(shapes, share_memory, pin_memory)


def columns(batch: dict[str, torch.Tensor], index: Any) -> dict[str, torch.Tensor]:
    """Columns ``index`` (a slice: views; index tensor: copies) of every field: the batch axis
    is 1, or 0 for ``[N]`` fields."""
    return {k: (v[index] if v.ndim == 1 else v[:, index]) for k, v in batch.items()}


def column_block(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Views of columns ``start:stop`` of every field."""
    return columns(batch, slice(start, stop))


def torch_dtype(np_dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=np_dtype)).dtype


def rollout_spec_for(
    model: Model, observation_space: gym.spaces.Box | None, T: int, N: int
) -> RolloutSpec:
    """The slot of an actor of ``N`` envs running ``model``: ``N * n_agents`` columns, each
    step key's fields as the model's spaces lay them out (``observation_space``: the env's
    observation space of a one-key model, when it differs in dtype from the model's)."""
    core = 0 if model.core is None else model.core.hidden_size
    keys = []
    for k in model.step_keys:
        space = model.observation_spaces[k]
        if observation_space is not None and len(model.step_keys) == 1:
            space = observation_space
        head = model.action_head(k)
        entries: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        if isinstance(space, gym.spaces.Dict):  # an entry each, in its own dtype
            entries = tuple(
                (name, tuple(sub.shape), torch_dtype(sub.dtype))
                for name, sub in space.spaces.items()
            )
        keys.append(
            KeyLayout(
                tuple(space.shape or ()),
                torch_dtype(space.dtype or np.float32),
                tuple(head.action_shape),
                head.action_dtype,
                model.mask_sizes.get(k),
                entries,
            )
        )
    return RolloutSpec(
        T, N * model.n_agents, tuple(keys), core, last_inputs_size=model.extra_features
    )


class LocalActing:
    """Inference in the actor itself, on its own copy of the policy (loaded between unrolls).

    The actor loop acts through an object like this one: :meth:`act` one decision of a group
    of agents, :meth:`value` a final observation's value, :meth:`unroll_version` the policy
    version to stamp on a finished unroll. Central inference
    (:class:`impala_rl.actors.inference.CentralActing`) has the same three methods.
    """

    def __init__(self, model: Model, generator: torch.Generator):
        self.model = model
        self.generator = generator

    def act(
        self,
        step_key: int,
        obs: torch.Tensor,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: Any,
        extra: torch.Tensor | None,
    ) -> Acted:
        return act(
            self.model, step_key, obs, action_mask, first, core_state, extra, False, self.generator
        )

    def value(
        self, step_key: int, obs: torch.Tensor, extra: torch.Tensor | None, core_state: Any
    ) -> torch.Tensor:
        return self.model.value(step_key, obs, extra, core_state)

    def unroll_version(self, loaded_version: int) -> int:
        """The version of the weights this unroll acted with: the ones loaded before it."""
        return loaded_version


@dataclass
class UnrollResult:
    """What an unroll reports besides the slot contents."""

    episode_returns: list[float]
    episode_lengths: list[int]
    env_steps: int


def write_staged(
    slot: dict[str, torch.Tensor], staged: dict[str, np.ndarray], version: int, actor_index: int
) -> None:
    """Copy an unroll's numpy-staged columns into ``slot`` and stamp its version and actor."""
    for key, values in staged.items():
        slot[key].copy_(torch.from_numpy(values))
    slot["policy_version"].fill_(version)
    slot["actor_index"].fill_(actor_index)


class EpisodeTracker:
    """Each env's running episode return and length; :meth:`step` collects finished ones."""

    def __init__(self, num_envs: int):
        self.ret = np.zeros(num_envs, dtype=np.float64)
        self.length = np.zeros(num_envs, dtype=np.int64)

    def step(
        self, reward: np.ndarray, done: np.ndarray, returns: list[float], lengths: list[int]
    ) -> None:
        """Add one step's ``reward [N]``; append the episodes that ``done [N]`` ends."""
        self.ret += reward
        self.length += 1
        if done.any():
            for i in np.flatnonzero(done):
                returns.append(float(self.ret[i]))
                lengths.append(int(self.length[i]))
            self.ret[done] = 0.0
            self.length[done] = 0


@dataclass
class Decision:
    """One row of an agent column, kept by the actor until it is written into a slot."""

    key: int
    obs: Obs  # [*o_k], or a Dict observation's entries
    mask: np.ndarray | None
    action: torch.Tensor
    log_prob: float = 0.0
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    truncation_value: float = 0.0
    age: int = 0  # the actor's sub-step count when it was taken: the oldest chunk goes first
    first: bool = False  # the agent's first decision of an episode (a model with a core)
    core_state: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, c) [H] before it
    last_inputs: torch.Tensor | None = None  # [E] the agent's previous action and reward


class ActorLoop:
    """One actor: ``num_envs`` envs, a CPU copy of the policy, and its agents' decision streams.

    Every agent of every env (a *stream*) is a sequence of decisions, and a slot's column is
    ``T`` of them (:class:`RolloutSpec`). ``seed`` fixes the envs' reset seeds and the action
    sampler, so a backend that runs the same actor index with the same weights produces the
    same slot contents. With a core every stream carries its state from decision to decision
    (reset at its first decision of an episode).

    A plain env is one agent deciding at every step of every env: its streams are the envs, a
    column closes after ``T`` steps, and :meth:`_unroll_steps` writes them in place (one
    policy call and one slice write per field and step; the per-step scalars staged in numpy).

    A structured env (:class:`~impala_rl.envs.structured.StructuredVectorEnv`) goes through
    :meth:`_unroll_decisions`: each env sub-step, the envs are grouped by the step key that
    acts and each group's policy runs once. Every stream keeps its closed decisions in a queue
    and its open one aside. An unroll steps until the streams hold ``N`` chunks of ``T`` closed
    decisions, then writes the oldest chunks, one per column: a stream that decides more often
    fills more columns. So agents acting at different rates neither wait for each other nor
    pad their columns, and no queue grows without bound (a slow agent's decisions wait, less
    than ``T`` of them, until its chunk is full). Each decision keeps the core state before
    it, so a column that starts at any decision stores the state it starts from. Episode
    returns are those of agent 0.
    """

    def __init__(
        self,
        env_factory: Callable[[], gym.Env],
        num_envs: int,
        model: Model,
        seed: int,
        unroll_length: int,
        actor_index: int = 0,
        acting: Any = None,
    ):
        self.model = model
        self.model.eval()
        self.num_envs = num_envs
        self.T = unroll_length
        self.actor_index = actor_index
        self.policy_version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.acting = LocalActing(model, self.generator) if acting is None else acting
        self.episodes = EpisodeTracker(num_envs)
        keyed = make_keyed_vector_env(env_factory, num_envs)
        self.structured = not isinstance(keyed, SingleKeyVectorEnv)
        self.envs: Any
        if self.structured:
            self.envs = keyed
            self.envs.reset(seed=seed)
            self.n_agents = self.envs.n_agents
        else:  # the fast path steps the plain vector env itself
            self.envs = keyed.envs
            obs, _ = self.envs.reset(seed=seed)
            self.obs = as_obs(obs)
            self.n_agents = 1
        streams = num_envs * self.n_agents
        self.first = np.ones(streams, dtype=bool)  # a stream's next decision starts an episode
        self.core_state = model.initial_state(streams)  # carried across steps and unrolls
        if self.structured:
            self.closed: list[collections.deque[Decision]] = [
                collections.deque() for _ in range(streams)
            ]
            self.open: list[Decision | None] = [None] * streams
            self.substeps = 0
            layout = rollout_spec_for(model, None, unroll_length, num_envs)
            self.fields = {  # step key -> its obs, action and action-mask fields in a slot
                k: tuple(layout.key_field(name, k) for name in ("obs", "action", "action_mask"))
                for k in model.step_keys
            }
        else:  # what a model reading the last action and reward reads next (zero: first)
            self.last_inputs = torch.zeros(num_envs, model.extra_features)

    def load_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Take new weights; only ever called between unrolls."""
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    @torch.inference_mode()
    def unroll(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """Fill ``slot`` with ``N`` columns of ``T`` decisions (see the module docstring)."""
        return self._unroll_decisions(slot) if self.structured else self._unroll_steps(slot)

    def _unroll_steps(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """The plain env's fast path: ``T`` steps of every env, each env's column written in
        place, one policy call per step.

        Per-step scalars are staged in numpy and copied into the slot once per unroll: on
        cheap envs the per-step tensor bookkeeping would otherwise cost as much as the env.
        """
        T, N = self.T, self.num_envs
        rewards = np.zeros((T, N), dtype=np.float32)
        terminated = np.zeros((T, N), dtype=bool)
        truncated = np.zeros((T, N), dtype=bool)
        trunc_values = np.zeros((T, N), dtype=np.float32)
        first = np.zeros((T + 1, N), dtype=bool)
        returns: list[float] = []
        lengths: list[int] = []
        action_slot, logp_slot = slot["action"], slot["behaviour_log_prob"]
        model = self.model
        with_last = model.use_last_action_reward
        if model.core is not None:
            slot["core_h"].copy_(self.core_state[0])
            slot["core_c"].copy_(self.core_state[1])
        extra = self.last_inputs if with_last else None
        state = self.core_state
        for t in range(T):
            write_obs(slot, "obs", t, self.obs)
            first[t] = self.first
            if with_last:
                slot["last_inputs"][t] = extra
            first_t = torch.from_numpy(self.first) if state is not None else None
            acted = self.acting.act(0, self.obs, None, first_t, state, extra)
            action, state = acted.action, acted.core_state
            action_slot[t] = action
            logp_slot[t] = acted.log_prob
            obs, reward, term, trunc, info = self.envs.step(acted.env_action)
            trunc = np.logical_and(trunc, np.logical_not(term))
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc
            done = np.logical_or(term, trunc)
            if with_last:  # this decision as the next one reads it, zero after an episode's end
                extra = model.last_inputs(0, action, torch.from_numpy(rewards[t]))
            if trunc.any():  # the final obs continues the episode: no reset, this step's inputs
                idx = np.flatnonzero(trunc)
                cols = torch.from_numpy(idx)
                final = stack_obs([info["final_obs"][i] for i in idx])
                value = self.acting.value(
                    0,
                    final,
                    None if extra is None else extra[cols],
                    None if state is None else (state[0][:, cols], state[1][:, cols]),
                )
                trunc_values[t, idx] = value.float().numpy()
            if with_last and done.any():
                extra = extra.masked_fill(torch.from_numpy(done).unsqueeze(-1), 0.0)
            self.episodes.step(reward, done, returns, lengths)
            self.first = done
            self.obs = as_obs(obs)
        write_obs(slot, "obs", T, self.obs)
        action_slot[T] = 0  # row T is the bootstrap: its action is taken in the next unroll
        first[T] = self.first
        self.core_state = state
        if with_last:
            slot["last_inputs"][T] = extra
            self.last_inputs = extra
        staged = {
            "first": first,
            "reward": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "truncation_value": trunc_values,
        }
        write_staged(
            slot, staged, self.acting.unroll_version(self.policy_version), self.actor_index
        )
        return UnrollResult(returns, lengths, T * N)

    def _close(
        self, column: int, terminated: bool = False, truncation_value: float | None = None
    ) -> None:
        """Close ``column``'s open decision: at its agent's next decision, or at an episode's
        end (``terminated``; truncated when a ``truncation_value`` is given)."""
        decision = self.open[column]
        if decision is not None:
            decision.terminated = terminated
            if truncation_value is not None:
                decision.truncated = True
                decision.truncation_value = truncation_value
            self.closed[column].append(decision)
            self.open[column] = None

    def _final_value(self, stream: int, key: int, obs: Any) -> float:
        """The acting policy's value of ``stream``'s final observation at truncation, which
        continues the agent's sequence (its core state and last inputs, no reset)."""
        extra = None
        if self.model.use_last_action_reward:
            extra = self._last_inputs(stream).unsqueeze(0)
        state = None
        if self.core_state is not None:
            h, c = self.core_state
            state = (h[:, stream : stream + 1], c[:, stream : stream + 1])
        batch = map_obs(as_obs(obs), lambda x: x.unsqueeze(0))
        return float(self.acting.value(key, batch, extra, state)[0])

    def _last_inputs(self, stream: int) -> torch.Tensor:
        """What ``stream``'s next decision reads of its open one (action, reward since), zero
        at its first decision of an episode."""
        decision = self.open[stream]
        if self.first[stream] or decision is None:
            return torch.zeros(self.model.extra_features)
        action = decision.action.unsqueeze(0)
        return self.model.last_inputs(decision.key, action, torch.tensor([decision.reward]))[0]

    def _substep(self, returns: list[float], lengths: list[int]) -> None:
        """Every env's current actor decides and its env steps once."""
        envs, model, A = self.envs, self.model, self.n_agents
        actions: list = [None] * self.num_envs
        for k in envs.step_keys:
            idx = np.flatnonzero(envs.step_key == k)
            if idx.size == 0:
                continue
            obs = as_obs(envs.obs[k], index=idx)
            mask = torch.from_numpy(envs.masks[k][idx]) if k in envs.masks else None
            streams = idx * A + envs.agent_id[idx]
            extra = None
            if model.use_last_action_reward:
                extra = torch.stack([self._last_inputs(int(s)) for s in streams])
            state, before, first = self.core_state, None, None
            if state is not None:
                cols = torch.from_numpy(streams)
                before = (state[0][:, cols], state[1][:, cols])
                first = torch.from_numpy(self.first[streams])
            acted = self.acting.act(k, obs, mask, first, before, extra)
            if state is not None:
                state[0][:, cols], state[1][:, cols] = acted.core_state
            action, env_actions = acted.action, acted.env_action
            log_prob = acted.log_prob.float().numpy()
            for j, i in enumerate(idx):
                actions[i] = env_actions[j]
                column = int(streams[j])
                self._close(column)  # its segment ends at this decision
                self.open[column] = Decision(
                    k,
                    map_obs(obs, lambda x, j=j: x[j].clone()),
                    None if mask is None else mask[j].numpy().copy(),
                    action[j].clone(),
                    float(log_prob[j]),
                    age=self.substeps,
                    first=bool(self.first[column]),
                    core_state=None if before is None else (before[0][0, j], before[1][0, j]),
                    last_inputs=None if extra is None else extra[j],
                )
            self.first[streams] = False
        acting = envs.agent_id.copy()
        reward, term, trunc, actor_done, _ = envs.step(actions)
        trunc = np.logical_and(trunc, np.logical_not(term))
        for i in range(self.num_envs):
            for a in range(A):
                decision = self.open[i * A + a]
                if decision is not None:
                    decision.reward += float(reward[i, a])
            if actor_done[i]:
                self._close(i * A + int(acting[i]), terminated=True)
            if term[i] or trunc[i]:
                finals = envs.final_obs.get(i, {})
                for a in range(A):
                    stream = i * A + a
                    final = finals.get(a) if trunc[i] and self.open[stream] else None
                    if final is None:  # termination, or an env without final observations
                        self._close(stream, terminated=True)
                    else:
                        key, obs, _ = final
                        self._close(stream, truncation_value=self._final_value(stream, key, obs))
                    self.first[stream] = True
        self.episodes.step(reward[:, 0], np.logical_or(term, trunc), returns, lengths)
        self.substeps += 1

    def _write_column(
        self, slot: dict[str, torch.Tensor], column: int, stream: int, staged: dict
    ) -> None:
        """Pop ``T`` closed rows of ``stream`` into ``column``; peek the next as row T."""
        T = self.T
        queue = self.closed[stream]
        rows = [queue.popleft() for _ in range(T)]
        bootstrap = queue[0] if queue else self.open[stream]
        if bootstrap is not None:
            rows.append(bootstrap)
        for t, d in enumerate(rows):
            obs_field, action_field, mask_field = self.fields[d.key]
            write_obs(slot, obs_field, (t, column), d.obs)
            if d.mask is not None:
                slot[mask_field][t, column] = torch.from_numpy(d.mask)
            slot[action_field][t, column] = d.action
            if "step_key" in staged:
                staged["step_key"][t, column] = d.key
            if d.last_inputs is not None:
                slot["last_inputs"][t, column] = d.last_inputs
            staged["first"][t, column] = d.first
            if t == 0 and d.core_state is not None:
                slot["core_h"][0, column], slot["core_c"][0, column] = d.core_state
            if t < T:  # row T, the bootstrap row, is read for its value only
                staged["behaviour_log_prob"][t, column] = d.log_prob
                staged["reward"][t, column] = d.reward
                staged["terminated"][t, column] = d.terminated
                staged["truncated"][t, column] = d.truncated
                staged["truncation_value"][t, column] = d.truncation_value

    def _unroll_decisions(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """Step until ``N`` chunks of ``T`` closed decisions are full, write them into ``slot``."""
        T, C = self.T, len(self.closed)
        returns: list[float] = []
        lengths: list[int] = []
        start = self.substeps
        while sum(len(q) // T for q in self.closed) < C:
            self._substep(returns, lengths)
        for name, value in slot.items():
            if name.startswith("action_mask"):
                value.fill_(True)
            elif name.startswith(("obs", "action")) or name == "last_inputs":
                value.zero_()
        staged = {
            "first": np.ones((T + 1, C), dtype=bool),
            "behaviour_log_prob": np.zeros((T, C), dtype=np.float32),
            "reward": np.zeros((T, C), dtype=np.float32),
            "terminated": np.zeros((T, C), dtype=bool),
            "truncated": np.zeros((T, C), dtype=bool),
            "truncation_value": np.zeros((T, C), dtype=np.float32),
        }
        if len(self.fields) > 1:
            staged["step_key"] = np.zeros((T + 1, C), dtype=np.int64)
        for column in range(C):
            stream = min((q[0].age, s) for s, q in enumerate(self.closed) if len(q) >= T)[1]
            self._write_column(slot, column, stream, staged)
        write_staged(
            slot, staged, self.acting.unroll_version(self.policy_version), self.actor_index
        )
        return UnrollResult(returns, lengths, (self.substeps - start) * self.num_envs)

    def close(self) -> None:
        self.envs.close()


def actor_loop_rate(
    env_factory: Callable[[], gym.Env],
    num_envs: int,
    model: Model,
    unroll_length: int,
    seconds: float,
) -> float:
    """Env steps per second of one actor's loop (stepping and acting on one thread, a copy of
    ``model``), after one unroll of warm-up: what ``env.vector=auto`` compares, because a
    vector env's raw stepping rate does not predict it (envpool hands each step to a worker
    thread; on one quiet 2-core machine, CartPole x64, its raw rate was 1.5x ours and its rate
    in this loop 0.8x)."""
    model = copy.deepcopy(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in an actor process
    loop = ActorLoop(env_factory, num_envs, model, seed=0, unroll_length=unroll_length)
    try:
        slot = rollout_spec_for(model, None, unroll_length, num_envs).allocate()
        loop.unroll(slot)
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            steps += loop.unroll(slot).env_steps
        return steps / elapsed
    finally:
        loop.close()
        torch.set_num_threads(threads)
