"""One IMPALA update on a batch: forward, V-trace, losses, backward, clipping, optimizer step.

Losses are kept per sub-step (``step_key``) and per critic (``critic_key``); a plain
Gymnasium env has the single key ``0`` for both, and structured envs add keys without
changing this flow.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from impala_rl import losses, vtrace
from impala_rl.config import ImpalaAlgorithmConfig
from impala_rl.nn import ActorCritic
from impala_rl.nn.popart import PopArtValueHead
from impala_rl.nn.structured import StructuredActorCritic

SINGLE_KEY = 0


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
    timings: dict[str, float] = field(default_factory=dict)
    padding_share: float | None = None
    """Structured batches: share of rows that are not valid decisions."""


def optimizer_settings(cfg: ImpalaAlgorithmConfig) -> dict[str, Any]:
    """The configured optimizer's hyperparameters besides the learning rate."""
    if cfg.optimizer == "adam":
        return {"betas": tuple(cfg.adam_betas), "eps": cfg.optimizer_eps}
    return {"alpha": cfg.rmsprop_alpha, "eps": cfg.optimizer_eps, "momentum": cfg.rmsprop_momentum}


def make_optimizer(model: torch.nn.Module, cfg: ImpalaAlgorithmConfig) -> torch.optim.Optimizer:
    kind = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.RMSprop
    return kind(model.parameters(), lr=cfg.lr, **optimizer_settings(cfg))


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], cfg: ImpalaAlgorithmConfig
) -> None:
    """Restore a saved optimizer state under the *current* config's hyperparameters.

    ``Optimizer.load_state_dict`` also restores the saved hyperparameters, which would silently
    drop overrides given on resume (``adam_betas``, ``optimizer_eps``, ``rmsprop_alpha``,
    ``rmsprop_momentum``). Momentum switched on at resume starts from zero, as in a fresh run.
    """
    optimizer.load_state_dict(state)
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


def scheduled_lr(cfg: ImpalaAlgorithmConfig, env_steps: int, max_env_steps: int | None) -> float:
    """The learning rate after ``env_steps`` under the configured schedule."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    horizon = cfg.lr_decay_env_steps or max_env_steps
    frac = min(1.0, env_steps / horizon) if horizon else 0.0
    return cfg.lr + (cfg.lr_final - cfg.lr) * frac


def _grad_norm(params: list[torch.nn.Parameter]) -> float:
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in params if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def clip_gradients(model: torch.nn.Module, max_grad_norm: float | None) -> float:
    """Clip the gradients' global norm in place; returns the norm before clipping.

    A finite loss can still have an Inf or NaN gradient, and clipping would turn it into NaN
    weights at the optimizer step, so a non-finite norm raises before any step is taken.
    """
    max_norm = max_grad_norm if max_grad_norm else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if not math.isfinite(grad_norm):
        raise NonFiniteError(
            f"gradient norm is {grad_norm} with a finite loss; no step was taken. Lower "
            "algorithm.lr, set algorithm.max_grad_norm, or check the env's observations"
        )
    return grad_norm


def model_inputs(model: ActorCritic, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inputs besides observations a model reads from a batch: ``first [T+1, B]``, the
    stored core state ``(h, c)`` (each ``[1, B, H]``), ``last_action``, ``last_reward``."""
    if not model.needs_inputs:
        return {}
    inputs: dict[str, Any] = {"first": batch["first"]}
    if model.has_core:
        inputs["core_state"] = (batch["core_h"], batch["core_c"])
    if model.use_last_action_reward:
        inputs["last_action"] = batch["last_action"]
        inputs["last_reward"] = batch["last_reward"]
    return inputs


class Learner:
    """Owns the trainable model and its optimizer; ``update`` runs one step on a batch."""

    def __init__(
        self,
        model: ActorCritic | StructuredActorCritic,
        cfg: ImpalaAlgorithmConfig,
        device: torch.device | str = "cpu",
    ):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.cfg = cfg
        self.optimizer = make_optimizer(self.model, cfg)
        self.num_updates = 0
        self._policy_params = list(self.model.policy_parameters())
        self._critic_params = list(self.model.critic_parameters())
        self._structured = isinstance(model, StructuredActorCritic)
        head = getattr(model, "value_head", None)
        self._popart = head if isinstance(head, PopArtValueHead) else None

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def update(
        self, batch: dict[str, torch.Tensor], train_policy: bool = True, fresh: bool = True
    ) -> UpdateStats:
        """One optimizer step on ``batch`` (a slot dict, ``[T+1, B]`` / ``[T, B]``, on device).

        ``train_policy=False`` is critic burn-in: only the baseline loss is minimised.
        ``fresh=False``: a further pass over the same batch (its observations are already in
        the normalization statistics).
        """
        if self._structured:
            return self._update_structured(batch, train_policy)
        cfg = self.cfg
        t0 = time.perf_counter()
        obs = batch["obs"]
        if obs.is_floating_point() and not bool(torch.isfinite(obs).all()):
            raise NonFiniteError("observations contain NaN or Inf")
        if fresh and self.model.obs_norm is not None:  # rows 0..T-1: row T opens the next
            self.model.obs_norm.update(obs[:-1])
        self.model.train()
        out = self.model(obs, **model_inputs(self.model, batch))  # over [T+1, B]
        action = batch["action"]
        padded = torch.cat([action, action[-1:]], dim=0)
        target_log_prob = out.dist.log_prob(padded)[:-1]
        entropy = out.dist.entropy()[:-1]
        values = out.value[:-1]
        bootstrap_value = out.value[-1].detach()
        t1 = time.perf_counter()

        terminated, truncated = batch["terminated"], batch["truncated"]
        rewards = losses.clip_rewards(batch["reward"], cfg.reward_clipping)
        rewards = rewards + cfg.gamma * truncated.float() * batch["truncation_value"]
        discounts = cfg.gamma * (~(terminated | truncated)).float()
        log_rhos = target_log_prob.detach() - batch["behaviour_log_prob"]
        vt = vtrace.from_importance_weights(
            log_rhos,
            discounts,
            rewards,
            values.detach(),
            bootstrap_value,
            clip_rho_threshold=cfg.vtrace_clip_rho_threshold,
            clip_pg_rho_threshold=cfg.vtrace_clip_pg_rho_threshold,
            clip_c_threshold=cfg.vtrace_clip_c_threshold,
            lambda_=cfg.vtrace_lambda,
        )
        pg_advantages, value_loss_scale = vt.pg_advantages, 1.0
        popart = (
            self.model.value_head if isinstance(self.model.value_head, PopArtValueHead) else None
        )
        if popart is not None:  # both losses on the normalized scale of the new statistics
            popart_old = popart.update_statistics(vt.vs)
            pg_advantages = pg_advantages / popart.sigma
            value_loss_scale = popart.sigma.pow(-2)
        pg_loss = losses.policy_gradient_loss(target_log_prob, pg_advantages)
        value_loss = losses.baseline_loss(vt.vs, values) * value_loss_scale
        ent_loss = losses.entropy_loss(entropy)
        total = cfg.value_loss_coef * value_loss
        if train_policy:
            total = total + cfg.policy_loss_coef * pg_loss + cfg.entropy_coef * ent_loss
        if not bool(torch.isfinite(total)):
            raise NonFiniteError(
                f"loss is not finite (policy {pg_loss.item()}, value {value_loss.item()}, "
                f"entropy {ent_loss.item()}); lower algorithm.lr or check the env's rewards"
            )
        t2 = time.perf_counter()

        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        if popart is not None:  # after the backward: the graph holds the old layer
            popart.preserve_outputs(*popart_old)
        policy_grad_norm = _grad_norm(self._policy_params)
        critic_grad_norm = _grad_norm(self._critic_params)
        grad_norm = clip_gradients(self.model, cfg.max_grad_norm)
        self.optimizer.step()
        self.num_updates += 1
        t3 = time.perf_counter()

        lag = (self.num_updates - 1 - batch["policy_version"]).tolist()
        rhos = vt.rhos
        rho_bar = cfg.vtrace_clip_rho_threshold
        # a relative tolerance keeps float noise of on-policy ratios (1 + 1e-7) from counting
        clipped = float((rhos > rho_bar * (1 + 1e-5)).float().mean()) if rho_bar else 0.0
        k = SINGLE_KEY
        return UpdateStats(
            total_loss=float(total.detach()),
            policy_loss={k: float(pg_loss.detach())},
            policy_entropy={k: float(entropy.detach().mean())},
            policy_grad_norm={k: policy_grad_norm},
            critic_value_loss={k: float(value_loss.detach())},
            critic_value={k: float(values.detach().mean())},
            critic_grad_norm={k: critic_grad_norm},
            grad_norm=grad_norm,
            vtrace_mean_rho={k: float(rhos.mean())},
            vtrace_clipped_fraction={k: clipped},
            policy_lag=lag,
            learning_rate=self.learning_rate,
            timings={"learner_rollout": t1 - t0, "loss_computation": t2 - t1, "backprob": t3 - t2},
        )

    def _update_structured(self, batch: dict[str, torch.Tensor], train_policy: bool) -> UpdateStats:
        """One step on a structured batch (:class:`~impala_rl.rollout.StructuredRolloutSpec`).

        Columns are agents' decision streams, so V-trace runs over the columns as in
        :meth:`update`, with the ``valid`` mask; one policy loss per step key, one value loss
        per critic, each a mean over the valid rows of that key or critic.
        """
        cfg = self.cfg
        model: StructuredActorCritic = self.model  # type: ignore[assignment]
        t0 = time.perf_counter()
        step_key = batch["step_key"]  # [T+1, B]
        T1, B = step_key.shape
        for k in model.step_keys:
            obs = batch[f"obs_{k}"]
            if obs.is_floating_point() and not bool(torch.isfinite(obs).all()):
                raise NonFiniteError(f"observations of step key {k} contain NaN or Inf")
        self.model.train()
        device = step_key.device
        # forward once per step key over the rows where it decides
        target_log_prob = torch.zeros(T1, B, device=device)
        values = torch.zeros(T1, B, device=device)
        entropy = torch.zeros(T1, B, device=device)
        for k in model.step_keys:
            tt, bb = (step_key == k).nonzero(as_tuple=True)
            if tt.numel() == 0:
                continue
            obs = batch[f"obs_{k}"][tt, bb]
            mask_name = f"action_mask_{k}"
            mask = batch[mask_name][tt, bb] if mask_name in batch else None
            dist = model.policy(k, obs, mask)
            action = batch[f"action_{k}"][tt, bb]
            target_log_prob = target_log_prob.index_put((tt, bb), dist.log_prob(action))
            entropy = entropy.index_put((tt, bb), dist.entropy())
            values = values.index_put((tt, bb), model.value(k, obs))
        t1 = time.perf_counter()

        valid = batch["valid"]  # [T, B]: decisions with a closed segment
        rewards = losses.clip_rewards(batch["reward"], cfg.reward_clipping)
        discounts = cfg.gamma * (~batch["terminal"]).float()
        # rho = c = 0 off the valid rows: there vs = V, so the last decision of a column
        # bootstraps from the value of the row after it (its latest decision point)
        log_rhos = target_log_prob[:-1].detach() - batch["behaviour_log_prob"]
        log_rhos = torch.where(valid, log_rhos, torch.full_like(log_rhos, float("-inf")))
        vt = vtrace.from_importance_weights(
            log_rhos,
            discounts,
            rewards,
            values[:-1].detach(),
            values[-1].detach(),
            clip_rho_threshold=cfg.vtrace_clip_rho_threshold,
            clip_pg_rho_threshold=cfg.vtrace_clip_pg_rho_threshold,
            clip_c_threshold=cfg.vtrace_clip_c_threshold,
            lambda_=cfg.vtrace_lambda,
        )
        keys = step_key[:-1]
        pg_loss: dict[int, torch.Tensor] = {}
        ent_loss: dict[int, torch.Tensor] = {}
        rho_mean: dict[int, float] = {}
        clipped: dict[int, float] = {}
        rho_bar = cfg.vtrace_clip_rho_threshold
        for k in model.step_keys:
            sel = valid & (keys == k)
            if not bool(sel.any()):
                continue
            pg_loss[k] = losses.policy_gradient_loss(
                target_log_prob[:-1][sel], vt.pg_advantages[sel]
            )
            ent_loss[k] = losses.entropy_loss(entropy[:-1][sel])
            rhos = vt.rhos[sel]
            rho_mean[k] = float(rhos.mean())
            clipped[k] = float((rhos > rho_bar * (1 + 1e-5)).float().mean()) if rho_bar else 0.0
        value_loss: dict[int, torch.Tensor] = {}
        critic_values: dict[int, float] = {}
        for c in model.critic_keys:
            sel = torch.zeros_like(valid)
            for k in model.step_keys:
                if model.critic_key(k) == c:
                    sel |= keys == k
            sel &= valid
            if bool(sel.any()):
                value_loss[c] = losses.baseline_loss(vt.vs[sel], values[:-1][sel])
                critic_values[c] = float(values[:-1].detach()[sel].mean())
        total = 0.0 * values.sum()  # in the graph even for a batch without valid rows
        for vl in value_loss.values():
            total = total + cfg.value_loss_coef * vl
        if train_policy:
            for pg in pg_loss.values():
                total = total + cfg.policy_loss_coef * pg
            for el in ent_loss.values():
                total = total + cfg.entropy_coef * el
        if not bool(torch.isfinite(total)):
            raise NonFiniteError(
                f"loss is not finite (policy {[float(x) for x in pg_loss.values()]}, value "
                f"{[float(x) for x in value_loss.values()]}); lower algorithm.lr or check the "
                "env's rewards"
            )
        t2 = time.perf_counter()

        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        policy_grad_norm = {k: _grad_norm(model.policy_parameters(k)) for k in model.step_keys}
        critic_grad_norm = {c: _grad_norm(model.critic_parameters(c)) for c in model.critic_keys}
        grad_norm = clip_gradients(self.model, cfg.max_grad_norm)
        self.optimizer.step()
        self.num_updates += 1
        t3 = time.perf_counter()

        lag = (self.num_updates - 1 - batch["policy_version"]).tolist()
        keys_seen = sorted(pg_loss)
        critics = sorted(value_loss)
        return UpdateStats(
            total_loss=float(total.detach()),
            policy_loss={k: float(pg_loss[k].detach()) for k in keys_seen},
            policy_entropy={k: float(-ent_loss[k].detach()) for k in keys_seen},
            policy_grad_norm={k: policy_grad_norm[k] for k in keys_seen},
            critic_value_loss={c: float(value_loss[c].detach()) for c in critics},
            critic_value=critic_values,
            critic_grad_norm={c: critic_grad_norm[c] for c in critics},
            grad_norm=grad_norm,
            vtrace_mean_rho={k: rho_mean[k] for k in keys_seen},
            vtrace_clipped_fraction={k: clipped[k] for k in keys_seen},
            padding_share=1.0 - float(valid.float().mean()),
            policy_lag=lag,
            learning_rate=self.learning_rate,
            timings={"learner_rollout": t1 - t0, "loss_computation": t2 - t1, "backprob": t3 - t2},
        )
