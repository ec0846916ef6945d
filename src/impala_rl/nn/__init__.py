"""Neural-network building blocks: encoders, action distributions and the actor-critic."""

from __future__ import annotations

from impala_rl.nn.acting import Acted, act
from impala_rl.nn.actor_critic import ActorCritic
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
from impala_rl.nn.encoders import ACTIVATIONS, MLP, make_activation

Model = ActorCritic
"""The actor-critic: a plain env's model is its one-step-key case."""

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "Acted",
    "Model",
    "act",
    "SUPPORTED_ACTION_SPACES",
    "ActionDistribution",
    "ActionHead",
    "ActorCritic",
    "BernoulliDistribution",
    "CategoricalDistribution",
    "DiagGaussianDistribution",
    "MultiCategoricalDistribution",
    "make_action_head",
    "make_activation",
]
