"""The rollout evaluator: run whole episodes with the current policy, report returns."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala_rl.envs import make_vector_env
from impala_rl.envs.structured import SingleKeyVectorEnv, StructuredVectorEnv
from impala_rl.nn import ActorCritic
from impala_rl.nn.structured import StructuredActorCritic


@dataclass
class EvaluationResult:
    returns: list[float]
    lengths: list[int]
    wins: list[bool] | None = None
    """Per episode, when the env reports ``info["win"]`` at episode end (games)."""

    @property
    def win_rate(self) -> float | None:
        return float(np.mean(self.wins)) if self.wins else None

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))


@torch.no_grad()
def evaluate(
    model: ActorCritic | StructuredActorCritic,
    env_factory: Callable[[], gym.Env],
    n_episodes: int,
    deterministic: bool = True,
    seed: int = 0,
    max_episode_steps: int | None = None,
) -> EvaluationResult:
    """Run ``n_episodes`` episodes in parallel (one per env), each to its end.

    Every env is a structured one here (a plain env is one agent whose step key 0 decides at
    every step): at each step the envs are grouped by the step key that decides next and each
    key's policy acts on its group, one call when there is one key. Returns are agent 0's,
    lengths count (sub-)steps, and ``wins`` collects ``info["win"]`` from the final step when
    the env reports it.

    ``deterministic`` takes the distribution's mode; otherwise actions are sampled from a
    generator seeded with ``seed``. ``max_episode_steps`` cuts episodes that run longer.
    A model with a core carries its state from step to step (and the last action and reward
    when it reads them), starting every episode from zeros.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    keyed = isinstance(model, StructuredActorCritic)
    if keyed:
        envs: Any = StructuredVectorEnv([env_factory] * n_episodes)
    else:
        envs = SingleKeyVectorEnv(make_vector_env(env_factory, n_episodes))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    wins: list[bool | None] = [None] * n_episodes
    stateful = not keyed and model.needs_inputs
    if keyed:  # a core state and last action/reward per agent of every env, reset with its episode
        agent_states = model.initial_state(n_episodes * envs.n_agents, device)
        agent_first = np.ones(n_episodes * envs.n_agents, dtype=bool)
        agent_last = torch.zeros(n_episodes * envs.n_agents, model.extra_features)
    if stateful:  # the inputs a core or last action/reward carries from step to step
        head = model.action_head
        first = torch.ones(n_episodes, dtype=torch.bool, device=device)
        state = model.initial_state(n_episodes, device)
        last_action = torch.zeros((n_episodes, *head.action_shape), dtype=head.action_dtype)
        last_action = last_action.to(device)
        last_reward = torch.zeros(n_episodes, device=device)
    try:
        envs.reset(seed=seed)
        returns = np.zeros(n_episodes)
        lengths = np.zeros(n_episodes, dtype=np.int64)
        running = np.ones(n_episodes, dtype=bool)
        actions: Any = [None] * n_episodes
        while running.any():
            for k in envs.step_keys:
                idx = np.flatnonzero(envs.step_key == k)
                if idx.size == 0:
                    continue
                every = idx.size == n_episodes  # one key deciding everywhere: no gather
                obs = torch.as_tensor(envs.obs[k] if every else envs.obs[k][idx], device=device)
                if keyed:
                    mask = envs.masks.get(k)
                    mask_t = None if mask is None else torch.as_tensor(mask[idx], device=device)
                    head = model.action_head(k)
                    agents = idx * envs.n_agents + envs.agent_id[idx]
                    extra = None
                    if model.use_last_action_reward:  # zero at an agent's first decision
                        unset = torch.as_tensor(agent_first[agents]).unsqueeze(-1)
                        extra = agent_last[agents].masked_fill(unset, 0.0).to(device)
                    if model.has_core:
                        cols = torch.as_tensor(agents, device=device)
                        h, c = agent_states
                        first_t = torch.as_tensor(agent_first[agents], device=device)
                        dist, (h[:, cols], c[:, cols]) = model.act(
                            k, obs, mask_t, first_t, (h[:, cols], c[:, cols]), extra
                        )
                    else:
                        dist = model.policy(k, obs, mask_t, extra)
                    agent_first[agents] = False
                elif stateful:
                    dist, state = model.act(obs, first, state, last_action, last_reward)
                else:
                    dist, head = model.policy(obs), model.action_head
                action = dist.mode() if deterministic else dist.sample(generator)
                if keyed and model.use_last_action_reward:  # the reward since: summed below
                    agent_last[agents] = model.last_inputs(k, action.cpu(), torch.zeros(idx.size))
                env_actions = head.to_env(action.cpu())
                if every:
                    actions = env_actions
                else:
                    actions = actions if isinstance(actions, list) else [None] * n_episodes
                    for j, i in enumerate(idx):
                        actions[i] = env_actions[j]
            reward, terminated, truncated, _, final_infos = envs.step(actions)
            returns += np.where(running, reward[:, 0], 0.0)
            lengths += running
            for i, info in final_infos.items():
                if running[i] and "win" in info:
                    wins[i] = bool(info["win"])
            done = np.logical_or(terminated, truncated)
            if keyed:
                if model.use_last_action_reward:
                    agent_last[:, -1] += torch.as_tensor(reward, dtype=torch.float32).reshape(-1)
                for i in np.flatnonzero(done):
                    agent_first[i * envs.n_agents : (i + 1) * envs.n_agents] = True
            if stateful:  # envs autoreset: a finished env starts a new (uncounted) episode
                first = torch.as_tensor(done, device=device)
                last_action = action
                last_reward = torch.as_tensor(reward[:, 0], dtype=torch.float32, device=device)
            if max_episode_steps is not None:
                done |= lengths >= max_episode_steps
            running &= ~done
    finally:
        envs.close()
        model.train(was_training)
    reported = [w for w in wins if w is not None]
    return EvaluationResult(
        [float(r) for r in returns],
        [int(n) for n in lengths],
        reported if len(reported) == n_episodes else None,
    )


class EvaluationCancelled(Exception):
    """Raised inside a background evaluation that was cancelled."""


class BackgroundEvaluator:
    """Runs one evaluation at a time in a thread, on a snapshot of the model's weights, so
    that training goes on meanwhile.

    ``run(snapshot, tag)`` evaluates; :meth:`start` copies the model first (the learner keeps
    updating its own); :meth:`poll` hands back ``(tag, snapshot, result)`` once it is done,
    with the snapshot whose weights earned the result; :meth:`cancel` stops it at the
    snapshot's next forward call and joins the thread.
    """

    def __init__(self, run: Callable[[torch.nn.Module, int], EvaluationResult]):
        self._run = run
        self._thread: threading.Thread | None = None
        self._done: tuple[int, torch.nn.Module, EvaluationResult] | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, model: torch.nn.Module, tag: int) -> None:
        if self._thread is not None:
            raise RuntimeError("an evaluation is already running")
        snapshot = copy.deepcopy(model)
        for module in snapshot.modules():
            module.register_forward_pre_hook(self._check_cancel)
        self._done, self._error = None, None
        self._thread = threading.Thread(
            target=self._work, args=(snapshot, tag), name="impala-evaluator", daemon=True
        )
        self._thread.start()

    def poll(self, wait: bool = False) -> tuple[int, torch.nn.Module, EvaluationResult] | None:
        """The finished evaluation, or None (none started, or still running and not ``wait``);
        an error inside the evaluation is raised here."""
        if self._thread is None or (not wait and self._thread.is_alive()):
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return self._done

    def cancel(self) -> None:
        if self._thread is None:
            return
        self._cancel.set()
        self._thread.join()
        self._thread = None
        self._cancel.clear()

    def _check_cancel(self, module: torch.nn.Module, inputs: Any) -> None:
        if self._cancel.is_set():
            raise EvaluationCancelled

    def _work(self, snapshot: torch.nn.Module, tag: int) -> None:
        try:
            self._done = (tag, snapshot, self._run(snapshot, tag))
        except EvaluationCancelled:
            self._done = None
        except BaseException as exc:  # handed to the trainer's thread by poll()
            self._error = exc
