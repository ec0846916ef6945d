"""The one acting step that the actor loop, evaluation and ``Policy.act`` share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from impala_rl.nn.core import CoreState


@dataclass
class Acted:
    """One decision of ``B`` agents of one step key."""

    action: Tensor  # [B, *a]: the model's action (sampled, or the mode)
    log_prob: Tensor  # [B]: log pi(action | obs) of the acting policy
    env_action: Any  # the action as the env takes it (numpy, on the CPU)
    core_state: CoreState | None  # (h, c) [1, B, H] after the decision; None: no core


def act(
    model: nn.Module,
    step_key: int,
    obs: Tensor,
    action_mask: Tensor | None = None,
    first: Tensor | None = None,
    core_state: CoreState | None = None,
    extra: Tensor | None = None,
    deterministic: bool = False,
    generator: torch.Generator | None = None,
) -> Acted:
    """Decide for ``obs [B, *o_k]`` with step key ``step_key``'s policy: sample (with
    ``generator``) or take the mode (``deterministic``). ``first [B]`` and ``core_state``
    drive a core, ``extra [B, E]`` is the agents' last inputs (zeros at an episode's first
    decision) for a model that reads them; a model reading neither ignores them."""
    dist, state = model.act(step_key, obs, action_mask, first, core_state, extra)
    action = dist.mode() if deterministic else dist.sample(generator)
    env_action = model.action_head(step_key).to_env(action.cpu())
    return Acted(action, dist.log_prob(action), env_action, state)
