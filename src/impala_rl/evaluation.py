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

from impala_rl.envs import make_keyed_vector_env
from impala_rl.nn import Model, act
from impala_rl.nn.observations import as_obs


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
    model: Model,
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
    envs = make_keyed_vector_env(env_factory, n_episodes)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    wins: list[bool | None] = [None] * n_episodes
    # a core state and last inputs per agent of every env, reset with its episode
    n_agents = envs.n_agents
    agent_states = model.initial_state(n_episodes * n_agents, device)
    agent_first = np.ones(n_episodes * n_agents, dtype=bool)
    agent_last = torch.zeros(n_episodes * n_agents, model.extra_features)
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
                obs = as_obs(envs.obs[k], device, None if every else idx)
                mask = envs.masks.get(k)
                mask_t = None if mask is None else torch.as_tensor(mask[idx], device=device)
                agents = idx * n_agents + envs.agent_id[idx]
                extra = None
                if model.use_last_action_reward:  # zero at an agent's first decision
                    unset = torch.as_tensor(agent_first[agents]).unsqueeze(-1)
                    extra = agent_last[agents].masked_fill(unset, 0.0).to(device)
                before, first = None, None
                if agent_states is not None:
                    cols = torch.as_tensor(agents, device=device)
                    before = (agent_states[0][:, cols], agent_states[1][:, cols])
                    first = torch.as_tensor(agent_first[agents], device=device)
                acted = act(model, k, obs, mask_t, first, before, extra, deterministic, generator)
                if agent_states is not None:
                    agent_states[0][:, cols], agent_states[1][:, cols] = acted.core_state
                agent_first[agents] = False
                if model.use_last_action_reward:  # the reward since: summed below
                    action = acted.action.cpu()
                    agent_last[agents] = model.last_inputs(k, action, torch.zeros(idx.size))
                if every:
                    actions = acted.env_action
                else:
                    actions = actions if isinstance(actions, list) else [None] * n_episodes
                    for j, i in enumerate(idx):
                        actions[i] = acted.env_action[j]
            reward, terminated, truncated, _, final_infos = envs.step(actions)
            returns += np.where(running, reward[:, 0], 0.0)
            lengths += running
            for i, info in final_infos.items():
                if running[i] and "win" in info:
                    wins[i] = bool(info["win"])
            done = np.logical_or(terminated, truncated)
            if model.use_last_action_reward:
                agent_last[:, -1] += torch.as_tensor(reward, dtype=torch.float32).reshape(-1)
            for i in np.flatnonzero(done):  # envs autoreset: the next (uncounted) episode
                agent_first[i * n_agents : (i + 1) * n_agents] = True
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
