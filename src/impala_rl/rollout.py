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

import copy
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala_rl.decisions import DecisionStreams, FinishedEpisodes, LocalActing
from impala_rl.envs import make_keyed_vector_env
from impala_rl.envs.structured import SingleKeyVectorEnv
from impala_rl.nn import Model
from impala_rl.nn.observations import as_obs, entry_field, map_obs, stack_obs, write_obs


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


class ActorLoop:
    """One actor: ``num_envs`` envs, a CPU copy of the policy, and its agents' decision streams
    (:class:`impala_rl.decisions.DecisionStreams`).

    Every agent of every env (a *stream*) is a sequence of decisions, and a slot's column is
    ``T`` of them (:class:`RolloutSpec`). ``seed`` fixes the envs' reset seeds and the action
    sampler, so a backend that runs the same actor index with the same weights produces the
    same slot contents. The streams carry each agent's core state and last inputs from
    decision to decision and across unrolls.

    A plain env is one agent deciding at every step of every env: its streams are the envs, a
    column closes after ``T`` steps, and :meth:`_unroll_steps` writes them in place (every
    stream decides at once, one policy call and one slice write per field and step; the
    per-step scalars staged in numpy).

    A structured env (:class:`~impala_rl.envs.structured.StructuredVectorEnv`) goes through
    :meth:`_unroll_decisions`: each env sub-step, the envs are grouped by the step key that
    acts and each group's policy runs once. The streams keep their closed decisions in a queue
    and the open one aside. An unroll steps until the streams hold ``N`` chunks of ``T`` closed
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
        keyed = make_keyed_vector_env(env_factory, num_envs)
        self.structured = not isinstance(keyed, SingleKeyVectorEnv)
        self.envs: Any
        if self.structured:
            self.envs = keyed
            self.envs.reset(seed=seed)
            self.n_agents = self.envs.n_agents
            layout = rollout_spec_for(model, None, unroll_length, num_envs)
            self.fields = {  # step key -> its obs, action and action-mask fields in a slot
                k: tuple(layout.key_field(name, k) for name in ("obs", "action", "action_mask"))
                for k in model.step_keys
            }
        else:  # the fast path steps the plain vector env itself
            self.envs = keyed.envs
            obs, _ = self.envs.reset(seed=seed)
            self.obs = as_obs(obs)
            self.n_agents = 1
        self.streams = DecisionStreams(
            model, self.acting, num_envs, self.n_agents, keep_decisions=self.structured
        )

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
        streams = self.streams
        with_last = self.model.use_last_action_reward
        for t in range(T):
            write_obs(slot, "obs", t, self.obs)
            acted, inputs = streams.decide(0, self.obs)
            first[t] = inputs.first
            if with_last:
                slot["last_inputs"][t] = inputs.extra
            if t == 0 and inputs.core_state is not None:
                slot["core_h"].copy_(inputs.core_state[0])
                slot["core_c"].copy_(inputs.core_state[1])
            action_slot[t] = acted.action
            logp_slot[t] = acted.log_prob
            obs, reward, term, trunc, info = self.envs.step(acted.env_action)
            trunc = np.logical_and(trunc, np.logical_not(term))
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc
            streams.rewarded(reward)
            if trunc.any():  # the final obs continues the episode: no reset, this step's inputs
                idx = np.flatnonzero(trunc)
                final = stack_obs([info["final_obs"][i] for i in idx])
                trunc_values[t, idx] = streams.final_values(0, idx, final).float().numpy()
            _collect(streams.end_episodes(np.logical_or(term, trunc)), returns, lengths)
            self.obs = as_obs(obs)
        write_obs(slot, "obs", T, self.obs)
        action_slot[T] = 0  # row T is the bootstrap: its action is taken in the next unroll
        bootstrap = streams.inputs()
        first[T] = bootstrap.first
        if with_last:
            slot["last_inputs"][T] = bootstrap.extra
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

    def _substep(self, returns: list[float], lengths: list[int]) -> None:
        """Every env's current actor decides and its env steps once."""
        envs, streams, A = self.envs, self.streams, self.n_agents
        actions: list = [None] * self.num_envs
        for k in envs.step_keys:
            idx = np.flatnonzero(envs.step_key == k)
            if idx.size == 0:
                continue
            obs = as_obs(envs.obs[k], index=idx)
            mask = torch.from_numpy(envs.masks[k][idx]) if k in envs.masks else None
            acted, _ = streams.decide(k, obs, mask, streams.streams(idx, envs.agent_id[idx]))
            for j, i in enumerate(idx):
                actions[i] = acted.env_action[j]
        acting = envs.agent_id.copy()
        reward, term, trunc, actor_done, _ = envs.step(actions)
        trunc = np.logical_and(trunc, np.logical_not(term))
        streams.rewarded(reward)
        for i in range(self.num_envs):
            if actor_done[i]:
                streams.close(i * A + int(acting[i]), terminated=True)
            if term[i] or trunc[i]:
                finals = envs.final_obs.get(i, {})
                for a in range(A):
                    stream = i * A + a
                    final = finals.get(a) if trunc[i] and streams.open[stream] else None
                    if final is None:  # termination, or an env without final observations
                        streams.close(stream, terminated=True)
                    else:
                        key, obs, _ = final
                        batch = map_obs(as_obs(obs), lambda x: x.unsqueeze(0))
                        value = streams.final_values(key, np.array([stream]), batch)
                        streams.close(stream, truncation_value=float(value[0]))
        _collect(streams.end_episodes(np.logical_or(term, trunc)), returns, lengths)

    def _write_column(
        self, slot: dict[str, torch.Tensor], column: int, stream: int, staged: dict
    ) -> None:
        """Pop ``T`` closed rows of ``stream`` into ``column``; peek the next as row T."""
        T = self.T
        queue = self.streams.closed[stream]
        rows = [queue.popleft() for _ in range(T)]
        bootstrap = queue[0] if queue else self.streams.open[stream]
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
        closed = self.streams.closed
        T, C = self.T, len(closed)
        returns: list[float] = []
        lengths: list[int] = []
        start = self.streams.env_steps
        while sum(len(q) // T for q in closed) < C:
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
            stream = min((q[0].age, s) for s, q in enumerate(closed) if len(q) >= T)[1]
            self._write_column(slot, column, stream, staged)
        write_staged(
            slot, staged, self.acting.unroll_version(self.policy_version), self.actor_index
        )
        return UnrollResult(returns, lengths, (self.streams.env_steps - start) * self.num_envs)

    def close(self) -> None:
        self.envs.close()


class ActorSplits:
    """An actor's envs in groups that take turns (``runner.env_splits``): group ``g`` is an
    :class:`ActorLoop` over its share of the envs that fills its block of a slot's columns.

    With one group the loop unrolls on the caller's thread. With several, each unrolls on a
    thread of its own, so that while one group waits for central inference's answer (the
    thread blocks on its pipe, without the interpreter lock) another steps its envs: Sample
    Factory's double-buffered sampling, with the actor loop unchanged. Each group's columns get
    the oldest version that acted on them, and the unroll's statistics are summed.
    """

    def __init__(self, loops: list[ActorLoop]):
        self.loops = loops
        self._pool = None
        if len(loops) > 1:
            self._pool = ThreadPoolExecutor(len(loops) - 1, thread_name_prefix="env-split")
        ends = np.cumsum([loop.num_envs * loop.n_agents for loop in loops]).tolist()
        self._bounds = list(zip([0, *ends[:-1]], ends, strict=True))  # group g's columns

    def unroll(self, slot: dict[str, torch.Tensor]) -> UnrollResult:
        """Fill ``slot``'s ``N`` columns, group ``g`` the ``g``-th block of them."""
        if self._pool is None:
            return self.loops[0].unroll(slot)
        blocks = [column_block(slot, start, stop) for start, stop in self._bounds]
        others = [
            self._pool.submit(loop.unroll, block)
            for loop, block in zip(self.loops[1:], blocks[1:], strict=True)
        ]
        results = [self.loops[0].unroll(blocks[0]), *(f.result() for f in others)]
        return UnrollResult(
            [r for result in results for r in result.episode_returns],
            [n for result in results for n in result.episode_lengths],
            sum(result.env_steps for result in results),
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for loop in self.loops:
            loop.close()


def _collect(finished: FinishedEpisodes | None, returns: list[float], lengths: list[int]) -> None:
    """Append the episodes that ended to an unroll's ``returns`` and ``lengths``."""
    if finished is not None:
        returns.extend(float(r) for r in finished.returns)
        lengths.extend(int(n) for n in finished.lengths)


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
