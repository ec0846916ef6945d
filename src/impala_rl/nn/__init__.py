"""Neural-network building blocks: MLP torsos, action distributions and the actor-critic."""

from __future__ import annotations

from impala_rl.nn.actor_critic import ActorCritic, PolicyOutput
from impala_rl.nn.distributions import (
    SUPPORTED_ACTION_SPACES,
    ActionDistribution,
    ActionHead,
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    MultiCategoricalDistribution,
    make_action_head,
)
from impala_rl.nn.mlp import ACTIVATIONS, MLP, make_activation

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "SUPPORTED_ACTION_SPACES",
    "ActionDistribution",
    "ActionHead",
    "ActorCritic",
    "BernoulliDistribution",
    "CategoricalDistribution",
    "DiagGaussianDistribution",
    "MultiCategoricalDistribution",
    "PolicyOutput",
    "make_action_head",
    "make_activation",
]
