"""The rollout evaluator: run whole episodes with the current policy, report returns."""

from __future__ import annotations

import copy
import multiprocessing as mp
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import torch

from impala_rl.child_processes import leave_stopping_to_parent, start_child
from impala_rl.decisions import DecisionStreams, LocalActing
from impala_rl.distributed import main_file_missing
from impala_rl.envs import make_keyed_vector_env
from impala_rl.helper_processes import stop_forkserver
from impala_rl.nn import Model
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
    key's policy acts on its group through the agents' decision streams
    (:class:`~impala_rl.decisions.DecisionStreams`, which carry a core's state and the last
    action and reward from decision to decision, from zeros at every episode's start), one
    call when one key decides everywhere. Returns are agent 0's, lengths count (sub-)steps,
    and ``wins`` collects ``info["win"]`` from the final step when the env reports it.

    ``deterministic`` takes the distribution's mode; otherwise actions are sampled from a
    generator seeded with ``seed``. ``max_episode_steps`` cuts episodes that run longer.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    envs = make_keyed_vector_env(env_factory, n_episodes)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    acting = LocalActing(model, generator, deterministic)
    streams = DecisionStreams(model, acting, n_episodes, envs.n_agents, device)
    wins: list[bool | None] = [None] * n_episodes
    returns = np.zeros(n_episodes)
    lengths = np.zeros(n_episodes, dtype=np.int64)
    try:
        envs.reset(seed=seed)
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
                ids = None
                if not every or envs.n_agents > 1:
                    ids = streams.streams(idx, envs.agent_id[idx])
                acted, _ = streams.decide(k, obs, mask_t, ids)
                if every:
                    actions = acted.env_action
                else:
                    actions = actions if isinstance(actions, list) else [None] * n_episodes
                    for j, i in enumerate(idx):
                        actions[i] = acted.env_action[j]
            reward, terminated, truncated, _, final_infos = envs.step(actions)
            streams.rewarded(reward)
            for i, info in final_infos.items():
                if running[i] and "win" in info:
                    wins[i] = bool(info["win"])
            done = np.logical_or(terminated, truncated)
            if max_episode_steps is not None:  # cut: what the episode scored so far
                cut = running & ~done & (streams.episode_length >= max_episode_steps)
                returns[cut] = streams.episode_return[cut]
                lengths[cut] = streams.episode_length[cut]
                running &= ~cut
            finished = streams.end_episodes(done)  # envs autoreset: the next is not counted
            if finished is not None:
                first = running[finished.envs]
                returns[finished.envs[first]] = finished.returns[first]
                lengths[finished.envs[first]] = finished.lengths[first]
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

    def close(self) -> None:
        """Cancel the running evaluation: the thread ends with it."""
        self.cancel()

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


# How long a stopping evaluation process may take to end its episode's forward call and exit.
PROCESS_STOP_TIMEOUT_S = 30.0


class ProcessEvaluator:
    """:class:`BackgroundEvaluator`'s work in a process of its own (``rollout_evaluator.
    background=process``): the learner's process keeps its Python to itself.

    The process is started at construction (its imports overlap the first batches) with a
    CPU copy of ``model`` and ``env_factory`` (both pickled, as the subprocess actors get
    them) and runs one thread. :meth:`start` keeps a snapshot of the model here (the weights
    that earned the result, for best-model selection) and sends its state dict with the seed
    ``seed_of(tag)`` (``n_episodes``, ``deterministic`` and ``max_episode_steps`` as
    :func:`evaluate` takes them); :meth:`poll` hands back ``(tag, snapshot, result)`` and
    reports the evaluation's seconds to ``timed``; :meth:`cancel` stops a running evaluation
    at its next forward call; :meth:`close` stops and joins the process (also after an
    error).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        env_factory: Callable[[], gym.Env],
        seed_of: Callable[[int], int],
        timed: Callable[[float], None],
        n_episodes: int,
        deterministic: bool = True,
        max_episode_steps: int | None = None,
    ):
        main_file = main_file_missing()
        if main_file:
            raise ValueError(
                "algorithm.rollout_evaluator.background=process starts a process that imports "
                f"the main module, and {main_file!r} is not a file (a script read from stdin?): "
                "save the script to a file, or use background=thread"
            )
        self._seed_of, self._timed = seed_of, timed
        self._pending: tuple[int, torch.nn.Module] | None = None
        ctx = mp.get_context("spawn")
        self._cancel = ctx.RawValue("b", 0)  # a flag in shared memory (no named semaphore)
        try:
            model_bytes = cloudpickle.dumps(copy.deepcopy(model).cpu())
            pickle.dumps(env_factory)
        except Exception as exc:
            raise ValueError(
                "algorithm.rollout_evaluator.background=process sends the model and the env "
                f"factory to a process, and one does not pickle ({type(exc).__name__}: {exc}); "
                "use background=thread"
            ) from exc
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_evaluator_main,
            name="impala-evaluator",
            args=(
                child,
                model_bytes,
                env_factory,
                {
                    "n_episodes": n_episodes,
                    "deterministic": deterministic,
                    "max_episode_steps": max_episode_steps,
                },
                self._cancel,
            ),
            daemon=True,
        )
        start_child(self._process)
        child.close()

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def start(self, model: torch.nn.Module, tag: int) -> None:
        if self._pending is not None:
            raise RuntimeError("an evaluation is already running")
        snapshot = copy.deepcopy(model)
        state = {k: v.detach().cpu() for k, v in snapshot.state_dict().items()}
        try:
            self._conn.send((tag, self._seed_of(tag), state))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise RuntimeError(self._death("the evaluation process is gone", tag)) from exc
        self._pending = (tag, snapshot)

    def poll(self, wait: bool = False) -> tuple[int, torch.nn.Module, EvaluationResult] | None:
        """The finished evaluation, or None (none started, or still running and not ``wait``);
        an error inside the evaluation process is raised here."""
        if self._pending is None:
            return None
        tag, snapshot = self._pending
        message = self._receive(wait, tag)
        if message is None:
            return None
        self._pending = None
        kind, result, seconds = message
        self._timed(seconds)
        if kind == "error":
            raise RuntimeError(f"the evaluation process failed:\n{result}")
        if kind == "cancelled":
            return None
        return tag, snapshot, result

    def cancel(self) -> None:
        """Stop the running evaluation (if any) and wait for the process to say so."""
        if self._pending is None:
            return
        self._cancel.value = 1
        try:
            tag, self._pending = self._pending[0], None
            self._receive(True, tag)
        except RuntimeError:
            pass  # it died meanwhile: close() reaps it
        finally:
            self._cancel.value = 0

    def close(self) -> None:
        """Stop and join the process: a running evaluation is cancelled first."""
        if self._process is None:
            return
        process, self._process = self._process, None  # type: ignore[assignment]
        self._cancel.value = 1
        try:
            self._conn.send(None)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        process.join(PROCESS_STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()  # a SIGTERM would be taken as notice
            process.join()
        self._conn.close()
        self._pending = None

    def _receive(self, wait: bool, tag: int) -> tuple[str, Any, float] | None:
        """The process's answer to the evaluation of epoch ``tag`` (the one sent last), or
        None while it runs (not ``wait``); a process that died without one raises."""
        while True:
            if self._conn.poll(1.0 if wait else 0):
                try:
                    return self._conn.recv()
                except (EOFError, ConnectionResetError, OSError) as exc:
                    raise RuntimeError(self._death("the evaluation process is gone", tag)) from exc
            if self._process is None or not self._process.is_alive():
                raise RuntimeError(self._death("the evaluation process died", tag))
            if not wait:
                return None

    def _death(self, what: str, tag: int) -> str:
        code = None if self._process is None else self._process.exitcode
        return f"{what} (exit code {code}) during the evaluation of epoch {tag}"


def _evaluator_main(
    conn: Connection,
    model_bytes: bytes,
    env_factory: Callable[[], gym.Env],
    evaluate_kwargs: dict[str, Any],
    cancel: Any,
) -> None:
    """The evaluation process: each message ``(tag, seed, state_dict)`` is evaluated and
    answered with ``("done", result, seconds)`` (``"cancelled"``, ``"error"`` with the
    traceback); ``None`` ends it."""
    leave_stopping_to_parent()  # the learner handles Ctrl-C and SIGTERM, then stops this
    torch.set_num_threads(1)
    # Daemonic to the learner (stopped at its exit), yet the parent of its envs' processes
    # (``env.vector=async``), which each evaluation closes and joins.
    mp.current_process().daemon = False

    def check_cancel(module: torch.nn.Module, inputs: Any) -> None:
        if cancel.value:
            raise EvaluationCancelled

    try:
        model = pickle.loads(model_bytes)
        for module in model.modules():
            module.register_forward_pre_hook(check_cancel)
        while True:
            message = conn.recv()
            if message is None:
                break
            _tag, seed, state = message
            t0 = time.perf_counter()
            try:
                model.load_state_dict(state)
                result = evaluate(model, env_factory, seed=seed, **evaluate_kwargs)
                conn.send(("done", result, time.perf_counter() - t0))
            except EvaluationCancelled:
                conn.send(("cancelled", None, time.perf_counter() - t0))
            except Exception as exc:  # the learner raises it from poll()
                text = "".join(traceback.format_exception(exc))
                conn.send(("error", text, time.perf_counter() - t0))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the learner is gone or stopping us
    finally:
        stop_forkserver()  # the async envs' (none otherwise): joined, not left to notice
