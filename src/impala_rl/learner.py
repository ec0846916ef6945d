"""One IMPALA update on a batch: forward, V-trace, losses, backward, clipping, optimizer step.

Losses are kept per sub-step (``step_key``) and per critic (``critic_key``); a plain
Gymnasium env has the single key ``0`` for both, and structured envs add keys without
changing this flow.

``algorithm.policy_loss=appo`` (APPO / IMPACT) adds a target network: V-trace's importance
weights are against it and the policy loss is PPO's clipped surrogate of ``pi / pi_target``;
the target moves towards the trained weights every ``target_update_frequency`` steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch

from impala_rl import losses, vtrace
from impala_rl.config import (
    ImpalaAlgorithmConfig,
    check_num_minibatches,
    compile_pays,
    decay_horizon,
    one_program_refusal,
    pixel_convolutions,
    steps_per_batch,
)
from impala_rl.distributed import LearnerGroup
from impala_rl.nn import Model
from impala_rl.nn.encoders import largest_image_side
from impala_rl.nn.observations import Obs, map_obs, read_obs
from impala_rl.rollout import columns

STEP_TARGETS = "vs"  # the field that marks a block of decisions with its targets (step_blocks)


class NonFiniteError(FloatingPointError):
    """A NaN or Inf in the observations, the loss or the gradients: training cannot go on."""


@dataclass
class UpdateStats:
    """What one update measured; the trainer turns it into events."""

    total_loss: float
    policy_loss: dict[int, float]
    policy_entropy: dict[int, float]
    policy_grad_norm: dict[int, float]
    critic_value_loss: dict[int, float]
    critic_value: dict[int, float]
    critic_grad_norm: dict[int, float]
    grad_norm: float
    vtrace_mean_rho: dict[int, float]
    vtrace_clipped_fraction: dict[int, float]
    policy_lag: list[int]
    learning_rate: float
    entropy_coef: float
    timings: dict[str, float] = field(default_factory=dict)
    policy_below_entropy_floor: dict[int, float] = field(default_factory=dict)
    critic_popart_mu: dict[int, float] = field(default_factory=dict)
    critic_popart_sigma: dict[int, float] = field(default_factory=dict)


log = logging.getLogger(__name__)


def optimizer_settings(cfg: ImpalaAlgorithmConfig) -> dict[str, Any]:
    """The configured optimizer's hyperparameters besides the learning rate.

    ``foreach``: one kernel per operation over all parameters instead of one per parameter
    (PyTorch's default on CUDA, not on the CPU), the same arithmetic; a small network's step
    is mostly that per-parameter overhead. Adam is ``fused``: one kernel per parameter for
    the whole step, the same update up to float rounding (weights within ~1e-8 of the foreach
    step's after 200 steps) at 0.37x the foreach step's time for a 64-unit MLP on a CPU.
    """
    if cfg.optimizer == "adam":
        return {"betas": tuple(cfg.adam_betas), "eps": cfg.optimizer_eps, "fused": True}
    return {
        "alpha": cfg.rmsprop_alpha,
        "eps": cfg.optimizer_eps,
        "momentum": cfg.rmsprop_momentum,
        "foreach": True,
    }


def make_optimizer(model: torch.nn.Module, cfg: ImpalaAlgorithmConfig) -> torch.optim.Optimizer:
    kind = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.RMSprop
    optimizer = kind(model.parameters(), lr=cfg.lr, **optimizer_settings(cfg))
    if cfg.optimizer == "rmsprop" and cfg.rmsprop_initial_square_avg > 0:
        start_square_avg(optimizer, cfg.rmsprop_initial_square_avg)
    return optimizer


def start_square_avg(optimizer: torch.optim.Optimizer, value: float) -> None:
    """Give every parameter RMSProp's state at step 0 with the mean square at ``value``.

    The state is what ``torch.optim.RMSprop`` creates on its first step, but for the mean
    square's start; a resume's saved state replaces it.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.get_default_dtype())
            state["square_avg"] = torch.full_like(p, value, memory_format=torch.preserve_format)
            if group["momentum"] > 0:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["centered"]:
                state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    cfg: ImpalaAlgorithmConfig,
    saved_order: list[str] | None = None,
    order: list[str] | None = None,
) -> None:
    """Restore a saved optimizer state under the *current* config's hyperparameters.

    ``Optimizer.load_state_dict`` also restores the saved hyperparameters, which would silently
    drop overrides given on resume (``adam_betas``, ``optimizer_eps``, ``rmsprop_alpha``,
    ``rmsprop_momentum``). Momentum switched on at resume starts from zero, as in a fresh run.
    ``saved_order`` and ``order`` name the parameters in the saved and in today's order
    (an earlier version listed them in another): each one's state follows its name.
    """
    if saved_order is not None and order is not None and saved_order != order:
        state = reordered_optimizer_state(state, saved_order, order)
    optimizer.load_state_dict(state)
    # a captured update's optimizer saved a tensor rate; the learner captures it again if it can
    plain_optimizer(optimizer)
    settings = optimizer_settings(cfg)
    for group in optimizer.param_groups:
        group.update(settings)
        if group.get("momentum", 0) > 0:
            for p in group["params"]:
                param_state = optimizer.state.get(p)
                if param_state and "momentum_buffer" not in param_state:
                    param_state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )


def plain_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` as the host steps it: a float learning rate, not ``capturable`` (what a
    :class:`CapturedStep` made of it)."""
    for group in optimizer.param_groups:
        group["capturable"] = False
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])


def reordered_optimizer_state(
    state: dict[str, Any], saved_order: list[str], order: list[str]
) -> dict[str, Any]:
    """A one-group optimizer state whose parameters were saved as ``saved_order``, for a
    model that lists the same parameters as ``order``."""
    groups = state["param_groups"]
    if len(groups) != 1 or sorted(saved_order) != sorted(order):
        raise ValueError(
            "the saved optimizer state does not fit this model's parameters: "
            f"saved {len(saved_order)}, now {len(order)}"
        )
    ids = groups[0]["params"]
    at = {name: ids[i] for i, name in enumerate(saved_order)}
    saved = state["state"]
    new_state = {i: saved[at[name]] for i, name in enumerate(order) if at[name] in saved}
    return {"state": new_state, "param_groups": [{**groups[0], "params": list(range(len(order)))}]}


def linear_decay(initial: float, final: float, env_steps: int, horizon: int | None) -> float:
    """``initial`` moved linearly to ``final`` over ``horizon`` env steps, then held."""
    frac = min(1.0, env_steps / horizon) if horizon else 0.0
    return initial + (final - initial) * frac


def scheduled_lr(cfg: ImpalaAlgorithmConfig, env_steps: int, max_env_steps: int | None) -> float:
    """The learning rate after ``env_steps`` under the configured schedule and warm-up."""
    warmup = min(1.0, env_steps / cfg.lr_warmup_env_steps) if cfg.lr_warmup_env_steps else 1.0
    if cfg.lr_schedule == "constant":
        return warmup * cfg.lr
    horizon = decay_horizon(cfg, "lr", max_env_steps)
    return warmup * linear_decay(cfg.lr, cfg.lr_final, env_steps, horizon)


def scheduled_entropy_coef(
    cfg: ImpalaAlgorithmConfig, env_steps: int, max_env_steps: int | None
) -> float:
    """The entropy bonus's weight after ``env_steps`` under the configured schedule."""
    if cfg.entropy_schedule == "constant":
        return cfg.entropy_coef
    horizon = decay_horizon(cfg, "entropy", max_env_steps)
    return linear_decay(cfg.entropy_coef, cfg.entropy_coef_final, env_steps, horizon)


def gradient_norms(
    params: list[torch.nn.Parameter], groups: dict[str, dict[int, list[int]]]
) -> tuple[torch.Tensor, dict[str, dict[int, torch.Tensor]]]:
    """The global norm of ``params``' gradients and the norm of each group's (``groups``:
    name -> key -> indices into ``params``), on their device (no host sync).

    One pass over the gradients: each parameter's norm once, every figure a norm of those
    (as ``torch.nn.utils.get_total_norm`` computes it, so the global norm is its value bit
    for bit). An update with few, small parameters is mostly per-tensor overhead, and the
    policy, critic and global norms would otherwise read every gradient three times."""
    present = [i for i, p in enumerate(params) if p.grad is not None]
    if not present:
        zero = torch.zeros((), device=params[0].device if params else None)
        return zero, {name: dict.fromkeys(by_key, zero) for name, by_key in groups.items()}
    norms = dict(zip(present, torch._foreach_norm([params[i].grad for i in present]), strict=True))

    def total(picked: list[torch.Tensor]) -> torch.Tensor:
        if not picked:
            return torch.zeros((), device=params[present[0]].device)
        return torch.linalg.vector_norm(torch.stack(picked))

    by_group = {
        name: {key: total([norms[i] for i in ix if i in norms]) for key, ix in by_key.items()}
        for name, by_key in groups.items()
    }
    return total(list(norms.values())), by_group


def clip_gradients(
    params: list[torch.nn.Parameter], max_grad_norm: float | None, total_norm: torch.Tensor
) -> None:
    """Scale the gradients in place so that their global norm ``total_norm`` is at most
    ``max_grad_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule; nothing for ``None``). The
    caller checks the norm is finite before any optimizer step: clipping an Inf or NaN
    gradient would make NaN weights."""
    if max_grad_norm:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            scale = torch.clamp(max_grad_norm / (total_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, scale)


@dataclass
class TargetOutputs:
    """The learner's policy and critic on every row of a batch, each ``[T+1, B]``."""

    log_prob: torch.Tensor  # log pi(a_t | x_t) of the batch's action; row T has no action
    entropy: torch.Tensor
    value: torch.Tensor  # V(x_t); row T is the bootstrap value


def forward_batch(model: Model, batch: dict[str, torch.Tensor]) -> TargetOutputs:
    """The learner's forward pass over a slot (:class:`~impala_rl.rollout.RolloutSpec`): one
    call over the batch when there is one step key, else one call per step key over the rows
    where that key decides; a core runs along every column between the keys' encoders and
    heads."""
    single = "step_key" not in batch
    if single:  # one key: every row, one call
        rows_of: dict[int, Any] = {model.step_keys[0]: (slice(None),)}
        fields = {model.step_keys[0]: ("obs", "action", "action_mask")}
    else:
        step_key = batch["step_key"]
        rows_of = {k: (step_key == k).nonzero(as_tuple=True) for k in model.step_keys}
        rows_of = {k: rows for k, rows in rows_of.items() if rows[0].numel()}
        fields = {k: (f"obs_{k}", f"action_{k}", f"action_mask_{k}") for k in rows_of}
    shape = batch["first"].shape  # [T+1, B]
    last = batch.get("last_inputs")  # [T+1, B, E]: the agent's previous action and reward

    def extra(rows: tuple[Any, ...]) -> torch.Tensor | None:
        return None if last is None else last[rows]

    def put(into: torch.Tensor, rows: tuple[Any, ...], values: torch.Tensor) -> torch.Tensor:
        return values if single else into.index_put(rows, values)

    core_out = None
    if model.core is not None:  # each key's features in place, the core along every column
        features = None
        for k, rows in rows_of.items():
            encoded = model.encode(k, _obs_rows(batch, fields[k][0], rows), extra(rows))
            if features is None:
                features = encoded.new_zeros((*shape, encoded.shape[-1]))
            features = put(features, rows, encoded)
        assert features is not None, "a batch has rows"
        core_out, _ = model.core(features, batch["first"], (batch["core_h"], batch["core_c"]))
    log_prob = torch.zeros(shape, device=batch["first"].device)
    entropy, value = torch.zeros_like(log_prob), torch.zeros_like(log_prob)
    for k, rows in rows_of.items():
        obs_field, action_field, mask_field = fields[k]
        mask = batch[mask_field][rows] if mask_field in batch else None
        if core_out is None:
            obs = _obs_rows(batch, obs_field, rows)
            dist, key_value = model.policy_value(k, obs, mask, extra(rows))
        else:
            dist, key_value = model.heads(k, core_out[rows], mask)
        log_prob = put(log_prob, rows, dist.log_prob(batch[action_field][rows]))
        entropy = put(entropy, rows, dist.entropy())
        value = put(value, rows, key_value)
    return TargetOutputs(log_prob, entropy, value)


def _obs_rows(batch: dict[str, torch.Tensor], field: str, rows: tuple[Any, ...]) -> Obs:
    """Rows ``rows`` of observation ``field`` (a tensor, or a Dict observation's entries)."""
    return map_obs(read_obs(batch, field), lambda x: x[rows])


def update_observation_statistics(
    model: Model, batch: dict[str, torch.Tensor], group: LearnerGroup | None = None
) -> None:
    """Merge a batch's trained observations into ``normalize_obs``'s statistics: rows
    0..T-1 (row T opens the next unroll, where it is trained), each step key's rows; with a
    learner ``group``, every learner's rows."""
    combine = group.combine_moments if group is not None else None
    for k in model.step_keys:
        norm = model.observation_normalizer(k)
        if norm is None:
            continue
        if "step_key" not in batch:
            norm.update(_obs_rows(batch, "obs", (slice(0, -1),)), combine)
        else:
            rows = batch["step_key"][:-1] == k
            norm.update(map_obs(read_obs(batch, f"obs_{k}"), lambda x, r=rows: x[:-1][r]), combine)


def _rows(x: torch.Tensor, selection: torch.Tensor | None) -> torch.Tensor:
    """The entries of ``x [T, B]`` that ``selection [T, B]`` picks; all of them for ``None``."""
    return x if selection is None else x[selection]


Figures = dict[str, dict[int, torch.Tensor]]
Layout = list[tuple[str, int]]


def _pack(scalars: Figures) -> tuple[Layout, torch.Tensor]:
    """An update's figures (0-d tensors by name and key) as one vector on their device, so
    that they reach the host in one copy: on a GPU every ``float(x)`` is a synchronisation."""
    flat = [(name, key, x) for name, by_key in scalars.items() for key, x in by_key.items()]
    device = flat[0][2].device
    packed = torch.stack([x.detach().to(device, torch.float32).reshape(()) for *_, x in flat])
    return [(name, key) for name, key, _ in flat], packed


def _to_host(
    layout: Layout, packed: torch.Tensor, lag: torch.Tensor
) -> tuple[dict[str, dict[int, float]], list[int]]:
    """The figures of :func:`_pack` and the columns' policy lag ``[B]`` read in one copy."""
    values = torch.cat([packed, lag.to(packed.device, torch.float32)]).tolist()
    figures: dict[str, dict[int, float]] = {}
    for (name, key), value in zip(layout, values, strict=False):
        figures.setdefault(name, {})[key] = value
    return figures, [round(x) for x in values[len(layout) :]]


def _one_program_refusal(model: Model, group: LearnerGroup | None) -> str | None:
    """:func:`~impala_rl.config.one_program_refusal` for this model and learner group."""
    return one_program_refusal(
        several_learners=group is not None,
        step_keys=len(model.step_keys),
        lstm_core=model.core is not None,
        precision=getattr(model, "precision", "fp32"),
    )


def capture_refusal(model: Model, device: torch.device, group: LearnerGroup | None) -> str | None:
    """Why an update on ``device`` cannot be captured as one CUDA graph (``None``: it can).
    The graph holds one step key's forward, V-trace, losses and backward without a host
    read (:func:`_one_program_refusal`); PopArt is left out until its statistics, now
    taken after the backward, are measured in a graph on a GPU."""
    if device.type != "cuda":
        return "the learner is not on a GPU"
    if model.popart_heads():
        return "PopArt: its statistics in a CUDA graph are not measured yet"
    return _one_program_refusal(model, group)


def compile_refusal(model: Model, device: torch.device, group: LearnerGroup | None) -> str | None:
    """Why an update on ``device`` is not compiled (``algorithm.compile_update``; ``None``:
    it can be): the one step key's forward, V-trace, losses and backward (its autograd
    traced into the program) as :func:`_one_program_refusal` allows; a GPU learner has the
    captured update (``algorithm.cuda_graph``) instead."""
    if device.type != "cpu":
        return "the learner is not on a CPU"
    return _one_program_refusal(model, group)


def has_pixel_convolutions(model: Model) -> bool:
    """Whether ``model`` holds a convolution and reads an image longer than
    :data:`~impala_rl.config.COMPILE_GRID_SIDE` a side (its step is then compute, not per-op
    overhead, and :func:`~impala_rl.config.compile_pays` says no; a grid world's 7x7 view is
    overhead-bound as an MLP is)."""
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    convolutions = any(isinstance(m, conv) for m in model.modules())
    spaces = getattr(model, "observation_spaces", {}).values()
    return pixel_convolutions(convolutions, largest_image_side(spaces))


class CapturedStep:
    """The optimizer step inside the captured update: ``take`` keeps a copy of the stepped
    tensors (the parameters and the optimizer's state) on the device and steps, all in the
    graph; the host reads the figures after the replay and ``undo`` puts the copy back when
    the loss or the gradient norm is not finite, so such an update still takes no step.

    On a GPU the optimizer becomes ``capturable`` (its step count on the device) and its
    learning rate a 0-d tensor that the graph reads, so the schedule needs no new capture."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.enabled = True  # False: a capture with the step failed; the host steps
        self._stepped: list[torch.Tensor] = []
        self._backup: list[torch.Tensor] = []

    def prepare(self) -> None:
        """The optimizer made capturable on a GPU (a CPU has no graph: it steps as is)."""
        if self.device.type != "cuda":
            return
        for group in self.optimizer.param_groups:
            group["capturable"] = True
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=self.device)
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                if isinstance(state.get("step"), torch.Tensor):  # a resume's or a start's
                    state["step"] = state["step"].to(p.device, torch.float32)

    def snapshot(self) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """The parameters and the optimizer state as they are, before the warm-up steps."""
        params = self._params()
        state = self.optimizer.state
        kept = {
            i: {k: v.clone() for k, v in state[p].items() if isinstance(v, torch.Tensor)}
            for i, p in enumerate(params)
            if p in state
        }
        return [p.detach().clone() for p in params], kept

    def restore(self, saved: tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]) -> None:
        """Undo the warm-up's steps in place (the graph keeps the tensors' addresses): the
        parameters and their state back, the state the warm-up created at its start (RMSProp's
        and Adam's are zeros); then the tensors ``take`` copies are fixed. A tensor keeps its
        copy from an earlier capture: that shape's graph writes there."""
        params, kept = saved
        copies = {id(t): c for t, c in zip(self._stepped, self._backup, strict=True)}
        self._stepped = []
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                p.copy_(params[i])
                state = self.optimizer.state.get(p, {})
                tensors = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
                for k, v in tensors:
                    if k in kept.get(i, {}):
                        v.copy_(kept[i][k])
                    else:
                        v.zero_()
                if tensors:
                    self._stepped += [p, *(v for _, v in tensors)]
        self._backup = [
            copies[id(t)] if id(t) in copies else t.detach().clone() for t in self._stepped
        ]

    def take(self) -> None:
        """Copy the stepped tensors aside, then step (in the graph when capturing)."""
        if self._stepped:
            with torch.no_grad():
                torch._foreach_copy_(self._backup, self._stepped)
        self.optimizer.step()

    def undo(self) -> None:
        """The last ``take`` undone: the parameters and the state as before its step."""
        with torch.no_grad():
            torch._foreach_copy_(self._stepped, self._backup)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]


@dataclass
class _Pending:
    """A captured update whose figures are still on the device (``settle_later``)."""

    layout: Layout
    packed: torch.Tensor
    lag: torch.Tensor
    learning_rate: float
    entropy_coef: float
    started: float  # the replay's launch; its figures' read ends its "backprob"
    timings: dict[str, float]


@dataclass
class _Captured:
    """One batch shape's static inputs, the gradients its backward writes, the graph (``None``
    on a CPU: the same function runs eagerly on the same buffers) and its packed figures."""

    inputs: dict[str, torch.Tensor]
    grads: list[torch.Tensor | None]
    graph: Any
    layout: Layout
    packed: torch.Tensor


class UpdateGraph:
    """The update's forward, V-trace, losses, backward, clipping and optimizer step as one
    CUDA graph per batch shape, replayed on static buffers: one launch instead of hundreds.
    The step (:class:`CapturedStep`) is undone when the host, reading the figures, finds the
    loss or the gradient norm not finite, so such an update still takes no step. Should its
    capture fail, the graphs are captured again without it and the host steps after the
    read. On a CPU the same path runs eagerly (what the tests compare with the eager update).

    ``compute(inputs, entropy_coef)`` returns the packed figures; the coefficient is a 0-d
    tensor that the graph reads, so its schedule needs no new capture (nor does the learning
    rate's: a tensor in the optimizer)."""

    WARMUP = 3  # eager runs on a side stream before capture (cuDNN and allocator set-up)

    def __init__(
        self,
        compute: Any,
        params: list[torch.nn.Parameter],
        device: torch.device,
        step: CapturedStep | None = None,
    ):
        self._compute, self._params, self.device, self.step = compute, params, device, step
        self.entropy_coef = torch.zeros((), device=device)
        self._captured: dict[tuple, _Captured] = {}

    @property
    def steps(self) -> bool:
        """Whether a replay takes the optimizer step (the host then checks and may undo)."""
        return self.step is not None and self.step.enabled

    def run(
        self, batch: dict[str, torch.Tensor], entropy_coef: float
    ) -> tuple[Layout, torch.Tensor]:
        """Copy ``batch`` into its shape's buffers (capturing on the first of a shape), replay,
        and return the packed figures (still on the device)."""
        self.entropy_coef.fill_(entropy_coef)
        signature = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))
        entry = self._captured.get(signature)
        if entry is None:
            entry = self._captured[signature] = self._capture_with_fallback(batch)
        for name, value in batch.items():
            entry.inputs[name].copy_(value, non_blocking=True)
        for p, grad in zip(self._params, entry.grads, strict=True):
            p.grad = grad  # each shape's graph writes its own gradient buffers
        if entry.graph is None:
            entry.layout, entry.packed = self._call(entry.inputs)
        else:
            entry.graph.replay()
        return entry.layout, entry.packed

    def _call(self, inputs: dict[str, torch.Tensor]) -> tuple[Layout, torch.Tensor]:
        return self._compute(inputs, self.entropy_coef)

    def _capture_with_fallback(self, batch: dict[str, torch.Tensor]) -> _Captured:
        """:meth:`_capture`; should it fail with the optimizer step in the graph, every shape
        is captured again without it (the host steps), and the run says why."""
        if not self.steps:
            return self._capture(batch)
        assert self.step is not None
        saved = self.step.snapshot()
        try:
            return self._capture(batch)
        except Exception as exc:  # noqa: BLE001 - any capture failure; without the step re-raises
            self.step.restore(saved)
            plain_optimizer(self.step.optimizer)
            self.step.enabled = False
            self._captured.clear()
            log.warning(
                "the optimizer step could not be captured in the update's CUDA graph (%s: %s); "
                "it runs after the graph",
                type(exc).__name__,
                (str(exc).strip().splitlines() or [""])[0],
            )
            return self._capture(batch)

    def _capture(self, batch: dict[str, torch.Tensor]) -> _Captured:
        inputs = {k: v.clone() for k, v in batch.items()}
        for p in self._params:
            p.grad = None  # the backward allocates them (in the graph's pool when capturing)
        cuda = self.device.type == "cuda"
        if not cuda and not self.steps:
            return _Captured(inputs, [None] * len(self._params), None, [], torch.empty(0))
        step = self.step if self.steps else None
        if step is not None:
            step.prepare()
            saved = step.snapshot()
        side = torch.cuda.Stream(self.device) if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (
            torch.cuda.stream(side) if side is not None else contextlib.nullcontext(),
            warnings.catch_warnings(),
        ):
            # torch warns once that a capturable optimizer steps uncaptured: the warm-up does
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            for _ in range(self.WARMUP):
                for p in self._params:
                    p.grad = None
                self._call(inputs)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        if step is not None:
            step.restore(saved)  # the warm-up's steps undone
        for p in self._params:
            p.grad = None
        if not cuda:  # a CPU: the warm-up and its undoing checked, the same function eagerly
            return _Captured(inputs, [None] * len(self._params), None, [], torch.empty(0))
        graph = torch.cuda.CUDAGraph()
        # thread_local: the actors' and the evaluator's threads keep using the GPU meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            layout, packed = self._call(inputs)
        return _Captured(inputs, [p.grad for p in self._params], graph, layout, packed)


class Learner:
    """Owns the trainable model and its optimizer; ``update`` runs one step on a batch."""

    def __init__(
        self,
        model: Model,
        cfg: ImpalaAlgorithmConfig,
        device: torch.device | str = "cpu",
        group: LearnerGroup | None = None,
        capture: bool | None = None,
        planned_steps: float = math.inf,
    ):
        self.device = torch.device(device)
        # Several learners: gradients and update statistics averaged over the group.
        self.group = group
        self.model = model.to(self.device)
        self.cfg = cfg
        self.optimizer = make_optimizer(self.model, cfg)
        self._lr: float | None = None  # the last rate set (a captured step's is a tensor)
        self.num_updates = 0
        self.entropy_coef = cfg.entropy_coef  # the trainer moves it along its schedule
        self._popart = model.popart_heads()  # {critic key: PopArt head}
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        # each step key's policy and each critic's parameters, as indices into _params
        index = {id(p): i for i, p in enumerate(self._params)}

        def indices(params: list[torch.nn.Parameter]) -> list[int]:
            return [index[id(p)] for p in params if id(p) in index]

        self._norm_groups = {
            "policy_grad_norm": {k: indices(model.policy_parameters(k)) for k in model.step_keys},
            "critic_grad_norm": {c: indices(model.critic_parameters(c)) for c in model.critic_keys},
        }
        if cfg.minibatch_of == "steps" and model.core is not None:
            raise ValueError(
                "algorithm.minibatch_of=steps needs a model without a core (the LSTM core "
                "trains on whole sequences); use minibatch_of=columns"
            )
        self.target_model: Model | None = None  # appo: the policy the surrogate clips against
        if cfg.policy_loss == "appo":
            self.target_model = copy.deepcopy(self.model).requires_grad_(False)
        # appo: (batch, the target's log-probs of its actions) while the target stands
        self._target_cache: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        # step_targets=batch: the batch's decisions with their targets, from its first pass
        self._step_rows: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        # The update as a CUDA graph (UpdateGraph): None decides at the first update (on a GPU
        # when capture_refusal allows), True insists (on a CPU: the same path eagerly).
        self.capture: bool | None = capture
        if capture is None and not cfg.cuda_graph:
            self.capture = False
        self._graph: UpdateGraph | None = None
        self._captured_step: CapturedStep | None = None
        # settle_later: the captured update whose figures wait, and the stats read since
        self._pending: _Pending | None = None
        self._settled: list[UpdateStats] = []
        # The update compiled (torch.compile): wanted by the setting, or for null by the run's
        # ``planned_steps`` (optimizer steps); ``compiled`` is decided at the first update
        wanted = cfg.compile_update
        if wanted is None:
            wanted = compile_pays(has_pixel_convolutions(model), planned_steps)
        self.compiled: bool | None = None if wanted else False
        self._compiled: Any = None
        self._compiled_ran = False  # a failure after the first compiled update is real
        self._entropy_coef_tensor = torch.zeros((), device=self.device)
        # appo: optimizer steps since the target last moved. Counted here, not from
        # ``num_updates``: a resume that changes the steps per batch must still move the target
        # at each batch's end (the checkpoint keeps it, see ``target_state``).
        self.steps_since_target = 0

    @property
    def target_update_frequency(self) -> int:
        """Optimizer steps between target moves (``null`` in the config: once per batch)."""
        return self.cfg.target_update_frequency or steps_per_batch(self.cfg)

    def minibatches(
        self, batch: dict[str, torch.Tensor], fresh: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One pass over ``batch``: ``num_minibatches`` blocks of its columns, each column in
        exactly one (shuffled by the global torch generator); the batch itself for one.

        appo, when the target moves at most once per batch (the default): each block also
        carries ``target_log_prob`` ``[T+1, b]``, the target's log-probs of its actions,
        computed over the whole batch once while the target stands, so the passes over a
        batch share one forward pass of the target instead of one per optimizer step.

        ``minibatch_of=steps``: blocks of single decisions instead (:meth:`step_blocks`);
        ``fresh``: the batch's first pass, whose observations join the normalization
        statistics here, before its targets are computed.
        """
        if self.cfg.minibatch_of == "steps":
            yield from self.step_blocks(batch, fresh)
            return
        n = self.cfg.num_minibatches
        shared = self._target_stands()
        if n == 1:
            yield {**batch, "target_log_prob": self._target_log_prob(batch)} if shared else batch
            return
        width = batch["first"].shape[1]
        check_num_minibatches(self.cfg, width)
        order = torch.randperm(width).to(batch["first"].device)
        for idx in order.view(n, width // n):
            block = columns(batch, idx)
            if shared:  # looked up at each block: the target may have moved since the last
                block["target_log_prob"] = self._target_log_prob(batch).index_select(1, idx)
            yield block

    def step_blocks(
        self, batch: dict[str, torch.Tensor], fresh: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """One pass over ``batch`` in ``num_minibatches`` blocks of its ``T * B`` decisions,
        each decision in exactly one (shuffled by the global torch generator), as PPO's
        minibatches.

        V-trace's targets and policy-gradient advantages are computed once, over the whole
        batch's columns with the weights the pass starts from (no gradient; with
        ``step_targets=batch`` the first pass's are kept for the others), and travel with
        each decision: a block is ``[1, n]`` rows with ``vs``, ``pg_advantage`` and
        ``rho`` beside its fields (no bootstrap row), and :meth:`update` trains on it
        without running V-trace again. The importance weights are the target's (appo) or
        the pass's first weights' (impala) over the behaviour policy's.
        """
        if fresh:
            update_observation_statistics(self.model, batch, self.group)
        T, B = batch["behaviour_log_prob"].shape
        per_column = [name for name, value in batch.items() if value.ndim == 1]
        kept = self._step_rows
        if not fresh and kept is not None and kept[0] is batch:
            rows = kept[1]  # step_targets=batch: the first pass's targets
        else:
            rows = self._step_rows_of(batch, per_column)
            self._step_rows = (batch, rows) if self.cfg.step_targets == "batch" else None
        n = self.cfg.num_minibatches
        check_num_minibatches(self.cfg, B, T)
        order = torch.randperm(T * B).to(batch["first"].device)
        for idx in order.view(n, T * B // n):
            block = {name: value.index_select(1, idx) for name, value in rows.items()}
            yield {name: block[name][0] if name in per_column else block[name] for name in block}

    def _step_rows_of(
        self, batch: dict[str, torch.Tensor], per_column: list[str]
    ) -> dict[str, torch.Tensor]:
        """The batch's ``T * B`` decisions as ``[1, T * B]`` rows of its fields (``per_column``:
        those with one entry per column), with V-trace's targets, advantages and importance
        weights under the current weights (and the target's log-probs while it stands), for
        :meth:`step_blocks`."""
        T, B = batch["behaviour_log_prob"].shape
        with torch.no_grad():
            out = forward_batch(self.model, batch)
            target_log_prob = None if self.target_model is None else self._target_log_prob(batch)
            vt = self._targets(batch, out, target_log_prob)
        rows = {
            name: value[:T].reshape(1, T * B, *value.shape[2:])
            for name, value in batch.items()
            if value.ndim >= 2 and name not in ("core_h", "core_c")
        }
        for name in per_column:  # policy_version, ...: one entry per decision
            rows[name] = batch[name].expand(T, B).reshape(1, T * B)
        rows[STEP_TARGETS] = vt.vs.reshape(1, T * B)
        rows["pg_advantage"] = vt.pg_advantages.reshape(1, T * B)
        rows["rho"] = vt.rhos.reshape(1, T * B)
        if target_log_prob is not None and self._target_stands():
            rows["target_log_prob"] = target_log_prob[:T].reshape(1, T * B)
        return rows

    def _target_stands(self) -> bool:
        """appo: whether the target stays put for a whole batch (it moves at most once per
        batch), so its log-probs can be computed once per batch."""
        return self.target_model is not None and (
            self.target_update_frequency >= steps_per_batch(self.cfg)
        )

    def _target_log_prob(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The target's ``log pi_target(a_t|x_t)`` ``[T+1, B]`` of ``batch``, computed once
        until the target moves or another batch comes."""
        assert self.target_model is not None
        if self._target_cache is None or self._target_cache[0] is not batch:
            with torch.no_grad():
                self._target_cache = (batch, forward_batch(self.target_model, batch).log_prob)
        return self._target_cache[1]

    def sync_target(self, tau: float = 1.0) -> None:
        """Move the target network towards the trained one: ``target <- tau * trained + (1 -
        tau) * target`` for the weights; buffers (observation and PopArt statistics) are
        copied."""
        if self.target_model is None:
            return
        self._target_cache = None
        with torch.no_grad():
            trained = dict(self.model.named_parameters())
            for name, p in self.target_model.named_parameters():
                if tau >= 1.0:
                    p.copy_(trained[name])
                else:
                    p.lerp_(trained[name], tau)
            trained_buffers = dict(self.model.named_buffers())
            for name, b in self.target_model.named_buffers():
                b.copy_(trained_buffers[name])

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # read by a captured step
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._lr = float(lr)

    @property
    def learning_rate(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):  # a captured step's: no read of the device
            if self._lr is None:
                self._lr = float(lr)
            return self._lr
        return float(lr)

    @overload
    def update(
        self,
        batch: dict[str, torch.Tensor],
        train_policy: bool = True,
        fresh: bool = True,
        settle_later: Literal[False] = False,
    ) -> UpdateStats: ...

    @overload
    def update(
        self,
        batch: dict[str, torch.Tensor],
        train_policy: bool = True,
        fresh: bool = True,
        settle_later: bool = ...,
    ) -> UpdateStats | None: ...

    def update(
        self,
        batch: dict[str, torch.Tensor],
        train_policy: bool = True,
        fresh: bool = True,
        settle_later: bool = False,
    ) -> UpdateStats | None:
        """One optimizer step on ``batch`` (a slot dict, ``[T+1, B]`` / ``[T, B]``, on device).

        Columns are agents' decision streams: a plain env's column is one env's steps, a
        structured env's one agent's decisions (rows 0..T-1 decisions, row T the bootstrap).
        One policy loss per step key and one value loss per critic, each a mean over the rows
        that key decides (or that critic values).

        ``train_policy=False`` is critic burn-in: only the baseline loss is minimised.
        ``fresh=False``: a further pass over the same batch (its observations are already in
        the normalization statistics).

        With a captured update (:class:`UpdateGraph`) or a compiled one
        (``algorithm.compile_update``) the forward, losses and backward run as one program and
        are timed together as ``backprob``.

        ``settle_later``: a captured update that took its step returns ``None`` without reading
        its figures, so the host prepares the next minibatch while the GPU replays this one;
        the next captured update, a target move or :meth:`settle` reads them (and undoes the
        step and raises if they are not finite, before anything else runs on the weights).
        ``num_updates`` counts the step once it is settled. Other updates return their stats.
        """
        t0 = time.perf_counter()
        self._settle_pending()  # the last step checked before this one runs on its weights
        _check_observations(batch)
        if fresh and STEP_TARGETS not in batch:  # a step block's pass updated them
            update_observation_statistics(self.model, batch, self.group)
        if not self.model.training:  # once: a recursive walk over the modules per step
            self.model.train()
        # burn-in stays eager: its policy parameters get no gradient, so the optimizer leaves
        # them and their state alone (a graph would give them zeros)
        graph = self._update_graph() if train_policy else None
        compiled = self._compiled_update() if train_policy and graph is None else None
        taken = False  # whether the captured update took the optimizer step
        if graph is not None:
            t1 = t2 = time.perf_counter()
            layout, packed = graph.run(batch, self.entropy_coef)
            taken = graph.steps
        elif compiled is not None:
            t1 = t2 = time.perf_counter()
            layout, packed = self._run_compiled(compiled, batch)
        else:
            marks: list[float] = []
            layout, packed = self._compute(batch, train_policy, self.entropy_coef, marks)
            t1, t2 = marks
        lag_versions = self.num_updates - batch["policy_version"]
        if settle_later and taken:
            timings = {"learner_rollout": t1 - t0, "loss_computation": 0.0}
            self._pending = _Pending(
                layout, packed, lag_versions, self.learning_rate, self.entropy_coef, t1, timings
            )
            self._follow_target()
            return None
        figures, lag = _to_host(layout, packed, lag_versions)
        self._step(figures, taken)
        self._follow_target()
        t3 = time.perf_counter()
        timings = {"learner_rollout": t1 - t0, "loss_computation": t2 - t1, "backprob": t3 - t2}
        return self._stats(figures, lag, self.learning_rate, self.entropy_coef, timings)

    def settle(self) -> list[UpdateStats]:
        """The stats of the updates made with ``settle_later`` since the last call, in order,
        their figures read and their steps checked (:class:`NonFiniteError` for a step that
        was not finite, undone); empty when none is waiting."""
        self._settle_pending()
        settled, self._settled = self._settled, []
        return settled

    def _settle_pending(self) -> None:
        """Read the waiting update's figures: check its step (undone if not finite) and count
        it, its stats kept for :meth:`settle`."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        figures, lag = _to_host(pending.layout, pending.packed, pending.lag)
        self._step(figures, taken=True)
        timings = {**pending.timings, "backprob": time.perf_counter() - pending.started}
        self._settled.append(
            self._stats(figures, lag, pending.learning_rate, pending.entropy_coef, timings)
        )

    def _stats(
        self,
        figures: dict[str, dict[int, float]],
        lag: list[int],
        learning_rate: float,
        entropy_coef: float,
        timings: dict[str, float],
    ) -> UpdateStats:
        return UpdateStats(
            total_loss=figures["total"][0],
            policy_loss=figures.get("policy_loss", {}),
            policy_entropy=figures.get("policy_entropy", {}),
            policy_grad_norm=figures.get("policy_grad_norm", {}),
            critic_value_loss=figures.get("critic_value_loss", {}),
            critic_value=figures.get("critic_value", {}),
            critic_grad_norm=figures.get("critic_grad_norm", {}),
            grad_norm=figures["grad_norm"][0],
            vtrace_mean_rho=figures.get("vtrace_mean_rho", {}),
            vtrace_clipped_fraction=figures.get("vtrace_clipped_fraction", {}),
            policy_lag=lag,
            learning_rate=learning_rate,
            entropy_coef=entropy_coef,
            timings=timings,
            policy_below_entropy_floor=figures.get("policy_below_entropy_floor", {}),
            critic_popart_mu=figures.get("critic_popart_mu", {}),
            critic_popart_sigma=figures.get("critic_popart_sigma", {}),
        )

    def _update_graph(self) -> UpdateGraph | None:
        """The captured update, decided at the first update (the group joins after
        construction): ``None`` when eager."""
        if self._graph is None and self.capture is not False:
            refusal = capture_refusal(self.model, self.device, self.group)
            if refusal is None or (self.capture is True and self.device.type == "cpu"):
                self._captured_step = CapturedStep(self.optimizer, self.device)
                self._graph = UpdateGraph(
                    self._compute_captured, self._params, self.device, self._captured_step
                )
            elif self.capture is True:
                raise ValueError(f"the update cannot be captured: {refusal}")
            self.capture = self._graph is not None
        return self._graph

    def _compiled_update(self) -> Any:
        """The compiled update (``algorithm.compile_update``), decided at the first update
        (the group joins after construction): ``None`` when eager."""
        if self.compiled is None:
            refusal = compile_refusal(self.model, self.device, self.group)
            self.compiled = refusal is None
            if self.compiled:
                # fullgraph: a graph break (a host read in a user's encoder) would run the
                # backward outside the traced program and leave no gradients; it fails the
                # compile instead, and the update runs eagerly (_run_compiled says so)
                self._compiled = torch.compile(
                    self._compute_captured, dynamic=False, fullgraph=True
                )
            elif self.cfg.compile_update:  # asked for by name: say why it runs eagerly
                log.warning("algorithm.compile_update: the update runs eagerly: %s", refusal)
        return self._compiled

    def _run_compiled(self, compiled: Any, batch: dict[str, torch.Tensor]) -> tuple[Layout, Any]:
        """The compiled update on ``batch``. Its first call compiles; should that fail (no C++
        compiler for inductor, a Python that dynamo does not support), the run goes on eagerly
        and says why: nothing of the update has run by then."""
        self.optimizer.zero_grad(set_to_none=True)
        self._entropy_coef_tensor.fill_(self.entropy_coef)  # a new value needs no compile
        try:
            with _tracing_autograd():
                packed = compiled(batch, self._entropy_coef_tensor)
        except Exception as exc:  # noqa: BLE001 - any compiler failure; eager re-raises real ones
            if self._compiled_ran:
                raise
            first_line = (str(exc).strip().splitlines() or [""])[0]
            log.warning(
                "algorithm.compile_update: the update could not be compiled (%s: %s); it runs "
                "eagerly. Set algorithm.compile_update=false to skip the attempt",
                type(exc).__name__,
                first_line,
            )
            self.compiled, self._compiled = False, None
            self.optimizer.zero_grad(set_to_none=True)
            packed = self._compute(batch, True, self.entropy_coef, None)
        self._compiled_ran = True
        return packed

    def _compute_captured(
        self, batch: dict[str, torch.Tensor], entropy_coef: torch.Tensor
    ) -> tuple[Layout, torch.Tensor]:
        """The update's one program; in a captured update also its optimizer step."""
        layout, packed = self._compute(batch, True, entropy_coef, None, zero_grad=False)
        step = self._captured_step  # None when compiled instead
        if step is not None and step.enabled:
            step.take()
        return layout, packed

    def _compute(
        self,
        batch: dict[str, torch.Tensor],
        train_policy: bool,
        entropy_coef: float | torch.Tensor,
        marks: list[float] | None,
        zero_grad: bool = True,
    ) -> tuple[Layout, torch.Tensor]:
        """Forward, V-trace, losses, backward and clipping; the figures packed on the device
        (no host read: this is what :class:`UpdateGraph` captures; ``entropy_coef`` is then
        a 0-d tensor). ``marks`` gets the times after the forward and after the losses."""
        out = forward_batch(self.model, batch)
        target_log_prob = self._target_policy(batch)
        if marks is not None:
            marks.append(time.perf_counter())
        if STEP_TARGETS in batch:  # a block of decisions (step_blocks): targets came with it
            decided = slice(None)
            vs, rhos = batch[STEP_TARGETS], batch["rho"]
            vt = vtrace.VTraceReturns(vs, batch["pg_advantage"], rhos, rhos)
        else:  # columns of decisions and their bootstrap row
            decided = slice(0, -1)
            vt = self._targets(batch, out, target_log_prob)
        rows_of, critic_rows = self._key_rows(batch, decided)
        pg_advantages, value_loss_scale, popart_new, popart_sigma = self._popart_step(
            vt, critic_rows
        )
        if self.cfg.normalize_advantages:
            pg_advantages = losses.normalize_advantages(pg_advantages)
        pg_loss, ent_loss, below_floor, value_loss, total = self._losses(
            out,
            vt,
            pg_advantages,
            value_loss_scale,
            rows_of,
            critic_rows,
            train_policy,
            target_log_prob,
            entropy_coef,
            decided,
        )
        if marks is not None:
            marks.append(time.perf_counter())
        norms = self._backward(total, popart_new, pg_loss, value_loss, zero_grad)
        rho_bar = self.cfg.vtrace_clip_rho_threshold
        rhos = {k: _rows(vt.rhos, rows_of[k]) for k in pg_loss}
        values = out.value[decided].detach()
        return _pack(
            {
                "total": {0: total},
                "policy_loss": pg_loss,
                "policy_entropy": {k: -x for k, x in ent_loss.items()},
                "policy_below_entropy_floor": below_floor,
                "critic_value_loss": value_loss,
                "critic_value": {c: _rows(values, critic_rows[c]).mean() for c in value_loss},
                "critic_popart_mu": {c: mu for c, (mu, _) in popart_new.items()},
                "critic_popart_sigma": popart_sigma,
                "vtrace_mean_rho": {k: r.mean() for k, r in rhos.items()},
                # a relative tolerance keeps float noise of on-policy ratios (1+1e-7) from counting
                "vtrace_clipped_fraction": {
                    k: (r > rho_bar * (1 + 1e-5)).float().mean() if rho_bar else r.new_zeros(())
                    for k, r in rhos.items()
                },
                **norms,
            }
        )

    # -- the phases of an update, in order -------------------------------------------------------
    def _target_policy(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """appo: the target network's ``log pi_target(a_t|x_t)`` ``[T+1, B]`` (no gradient;
        the one :meth:`minibatches` attached, if it did); ``None`` for impala."""
        if self.target_model is None:
            return None
        if "target_log_prob" in batch:
            return batch["target_log_prob"]
        with torch.no_grad():
            return forward_batch(self.target_model, batch).log_prob

    def _targets(
        self,
        batch: dict[str, torch.Tensor],
        out: TargetOutputs,
        target_log_prob: torch.Tensor | None = None,
    ) -> vtrace.VTraceReturns:
        """V-trace over the columns ``[T, B]``.

        The row after an episode's end belongs to the next episode (or the agent is done), so
        the discount there is 0; a truncated episode bootstraps from its final observation
        instead, whose value (under the acting policy) the actor stored: it is added to the
        reward as ``gamma * V(x_final)``. The importance weights are the trained policy's
        (impala) or the target network's (appo, ``target_log_prob``) over the behaviour's.
        """
        cfg = self.cfg
        rewards = losses.clip_rewards(batch["reward"], cfg.reward_clipping)
        truncated = batch["truncated"]
        rewards = rewards + cfg.gamma * truncated.float() * batch["truncation_value"]
        discounts = cfg.gamma * (~(batch["terminated"] | truncated)).float()
        log_prob = out.log_prob if target_log_prob is None else target_log_prob
        return vtrace.from_importance_weights(
            log_prob[:-1].detach() - batch["behaviour_log_prob"],
            discounts,
            rewards,
            out.value[:-1].detach(),
            out.value[-1].detach(),
            clip_rho_threshold=cfg.vtrace_clip_rho_threshold,
            clip_pg_rho_threshold=cfg.vtrace_clip_pg_rho_threshold,
            clip_c_threshold=cfg.vtrace_clip_c_threshold,
            lambda_=cfg.vtrace_lambda,
            adv_mode=cfg.adv_mode,
        )

    def _key_rows(
        self, batch: dict[str, torch.Tensor], decided: slice = slice(0, -1)
    ) -> tuple[dict[int, torch.Tensor | None], dict[int, torch.Tensor | None]]:
        """The rows ``[T, B]`` each step key decides and each critic values (``None``: every
        row, one key); ``decided``: the batch's decision rows (all of a step block's)."""
        model = self.model
        keys = batch["step_key"][decided] if "step_key" in batch else None
        rows_of: dict[int, torch.Tensor | None] = {}
        for k in model.step_keys:
            rows_of[k] = None if keys is None else keys == k
        critic_rows: dict[int, torch.Tensor | None] = {}
        for c in model.critic_keys:
            of_c = [rows_of[k] for k in model.step_keys if model.critic_key(k) == c]
            critic_rows[c] = None if None in of_c else torch.stack(of_c).any(dim=0)
        return rows_of, critic_rows

    def _popart_step(
        self, vt: vtrace.VTraceReturns, critic_rows: dict[int, torch.Tensor | None]
    ) -> tuple[
        torch.Tensor, dict[int, torch.Tensor | float], dict[int, Any], dict[int, torch.Tensor]
    ]:
        """PopArt: each critic's statistics move towards its targets; both losses of its rows
        are then on its normalized scale (advantages / sigma, value loss / sigma^2) with the
        moved sigma. Returns the advantages, each critic's value-loss scale, its moved
        statistics ``(mu, nu)``, which the heads take after the backward (:meth:`_backward`):
        nothing the forward read changes before its gradient is taken, and its moved sigma."""
        pg_advantages = vt.pg_advantages
        value_loss_scale: dict[int, torch.Tensor | float] = {c: 1.0 for c in critic_rows}
        popart_new, popart_sigma = {}, {}
        all_sum = self.group.sum_tensor if self.group is not None else None
        for c, head in self._popart.items():
            rows = critic_rows[c]
            if rows is not None and not bool(rows.any()) and all_sum is None:
                continue
            popart_new[c] = head.moved_statistics(_rows(vt.vs, rows), all_sum)
            sigma = popart_sigma[c] = head.sigma_of(*popart_new[c])
            if rows is None:
                pg_advantages = pg_advantages / sigma
            else:
                pg_advantages = torch.where(rows, pg_advantages / sigma, pg_advantages)
            value_loss_scale[c] = sigma.pow(-2)
        return pg_advantages, value_loss_scale, popart_new, popart_sigma

    def _losses(
        self,
        out: TargetOutputs,
        vt: vtrace.VTraceReturns,
        pg_advantages: torch.Tensor,
        value_loss_scale: dict[int, torch.Tensor | float],
        rows_of: dict[int, torch.Tensor | None],
        critic_rows: dict[int, torch.Tensor | None],
        train_policy: bool,
        target_log_prob: torch.Tensor | None = None,
        entropy_coef: float | torch.Tensor = 0.0,
        decided: slice = slice(0, -1),
    ) -> tuple[dict, dict, dict, dict, torch.Tensor]:
        """The policy-gradient (impala) or clipped-surrogate (appo, against
        ``target_log_prob``) and entropy losses per step key, the share of its decisions under
        ``entropy_floor`` (where one is set) and the value loss per critic, each a mean over its
        rows (``decided`` of the outputs), and their weighted sum (``entropy_coef`` is a 0-d
        tensor in a captured update)."""
        cfg = self.cfg
        log_prob, entropy = out.log_prob[decided], out.entropy[decided]
        values = out.value[decided]
        pg_loss, ent_loss, floor_loss, below_floor, value_loss = {}, {}, {}, {}, {}
        for k, rows in rows_of.items():
            if rows is None or bool(rows.any()):
                if target_log_prob is None:
                    pg_loss[k] = losses.policy_gradient_loss(
                        _rows(log_prob, rows), _rows(pg_advantages, rows)
                    )
                else:
                    pg_loss[k] = losses.clipped_surrogate_loss(
                        _rows(log_prob - target_log_prob[decided], rows),
                        _rows(pg_advantages, rows),
                        cfg.clip_param,
                    )
                key_entropy = _rows(entropy, rows)
                ent_loss[k] = losses.entropy_loss(key_entropy)
                if cfg.entropy_floor is not None:
                    floor_loss[k] = losses.entropy_floor_loss(key_entropy, cfg.entropy_floor)
                    below_floor[k] = (key_entropy.detach() < cfg.entropy_floor).float().mean()
        for c, rows in critic_rows.items():
            if rows is None or bool(rows.any()):
                value_loss[c] = value_loss_scale[c] * losses.baseline_loss(
                    _rows(vt.vs, rows), _rows(values, rows)
                )
        total = 0.0 * values.sum() if not value_loss else 0.0  # in the graph when no rows
        for c in value_loss:
            total = total + cfg.value_loss_coef * value_loss[c]
        if train_policy:
            for k in pg_loss:
                total = total + cfg.policy_loss_coef * pg_loss[k] + entropy_coef * ent_loss[k]
                if k in floor_loss:
                    total = total + cfg.entropy_floor_coef * floor_loss[k]
        return pg_loss, ent_loss, below_floor, value_loss, total  # type: ignore[return-value]

    def _backward(
        self,
        total: torch.Tensor,
        popart_new: dict[int, tuple[torch.Tensor, torch.Tensor]],
        pg_loss: dict,
        value_loss: dict,
        zero_grad: bool = True,
    ) -> dict[str, dict[int, torch.Tensor]]:
        """Backward, PopArt's moved statistics taken (outputs preserved), gradient norms and
        clipping. Returns the policy and critic gradient norms and the global one (pre-clip),
        on the device.
        ``zero_grad=False``: the caller set the gradients to ``None`` (a captured update)."""
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        if self.group is not None:
            self.group.average_gradients(self._params)
        for c, moved in popart_new.items():  # after the backward: the graph holds the old layer
            self._popart[c].set_statistics(*moved)
        groups = self._norm_groups
        total_norm, norms = gradient_norms(
            self._params,
            {
                "policy_grad_norm": {k: groups["policy_grad_norm"][k] for k in pg_loss},
                "critic_grad_norm": {c: groups["critic_grad_norm"][c] for c in value_loss},
            },
        )
        clip_gradients(self._params, self.cfg.max_grad_norm, total_norm)
        return {**norms, "grad_norm": {0: total_norm}}

    def _step(self, figures: dict[str, dict[int, float]], taken: bool = False) -> None:
        """The optimizer step, unless the loss or the gradients are not finite; ``taken``:
        the captured update took it, and a non-finite one is undone here."""
        loss_finite = math.isfinite(figures["total"][0])
        norm_finite = math.isfinite(figures["grad_norm"][0])
        if taken and not (loss_finite and norm_finite):
            assert self._captured_step is not None
            self._captured_step.undo()
        if not loss_finite:
            raise NonFiniteError(
                f"loss is not finite (policy {list(figures['policy_loss'].values())}, value "
                f"{list(figures['critic_value_loss'].values())}, entropy "
                f"{[-x for x in figures['policy_entropy'].values()]}); lower algorithm.lr or "
                "check the env's rewards"
            )
        if not norm_finite:
            raise NonFiniteError(
                f"gradient norm is {figures['grad_norm'][0]} with a finite loss; no step was "
                "taken. Lower algorithm.lr, set algorithm.max_grad_norm, or check the env's "
                "observations"
            )
        if not taken:
            self.optimizer.step()
        self.num_updates += 1

    def _follow_target(self) -> None:
        """appo: after every ``target_update_frequency``-th optimizer step since the target
        last moved, move it."""
        if self.target_model is None:
            return
        self.steps_since_target += 1
        if self.steps_since_target >= self.target_update_frequency:
            self._settle_pending()  # the target copies checked weights only
            self.sync_target(self.cfg.target_tau)
            self.steps_since_target = 0


def _tracing_autograd() -> Any:
    """While compiling: the backward traced into the update's program (with the forward, one
    fused program instead of two and the eager autograd engine between them); a PyTorch
    without the setting compiles the forward and backward as two programs."""
    config = torch._dynamo.config
    if hasattr(config, "trace_autograd_ops"):
        return config.patch(trace_autograd_ops=True)
    return contextlib.nullcontext()


def _check_observations(batch: dict[str, torch.Tensor]) -> None:
    for name, obs in batch.items():
        if name.startswith("obs") and obs.is_floating_point():
            if not bool(torch.isfinite(obs).all()):
                raise NonFiniteError(f"observations ({name}) contain NaN or Inf")
