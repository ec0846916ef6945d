"""A user's encoder with the built-in MLP's layers, for ``throughput.py --encoder``.

Written as a user would (``model.encoder=user_mlp:UserMLP``): ``Linear + activation`` per
hidden size, orthogonal init with gain sqrt(2) and zero biases, built in the order the
built-in MLP builds them, so a seeded run starts from the same weights and the comparison
times only the import-path route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gymnasium as gym
import numpy as np
from torch import Tensor, nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU}


class UserMLP(nn.Module):
    """``[N, *obs_shape]`` -> ``[N, hidden_sizes[-1]]``."""

    def __init__(
        self,
        observation_space: gym.spaces.Box,
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
    ):
        super().__init__()
        layers: list[nn.Module] = []
        prev = int(np.prod(observation_space.shape))
        for size in hidden_sizes:
            linear = nn.Linear(prev, int(size))
            nn.init.orthogonal_(linear.weight, gain=math.sqrt(2.0))
            nn.init.zeros_(linear.bias)
            layers += [linear, ACTIVATIONS[activation]()]
            prev = int(size)
        self.layers = nn.Sequential(*layers)
        self.out_features = prev

    def forward(self, obs: Tensor) -> Tensor:
        return self.layers(obs.flatten(1).float())
