"""A user's encoders, importable as ``user_nets:Torso`` etc. (pytest puts ``tests/`` on
``sys.path``) for ``model.encoder`` / ``model.value_encoder`` given by import path.

The protocol: built as ``cls(observation_space, **encoder_kwargs)``, an ``nn.Module`` with
``out_features``, mapping observations ``[N, *obs_shape]`` to features ``[N, out_features]``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

NOT_A_CLASS = 3


class Torso(nn.Module):
    """``depth`` tanh layers of ``width`` units over the flattened observation."""

    def __init__(self, observation_space: gym.spaces.Box, width: int = 16, depth: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        size = int(np.prod(observation_space.shape))
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.Tanh()]
            size = width
        self.net = nn.Sequential(*layers)
        self.out_features = width
        self.batch_shapes: list[tuple[int, ...]] = []  # what forward was given

    def forward(self, obs: Tensor) -> Tensor:
        self.batch_shapes.append(tuple(obs.shape))
        return self.net(obs.float().flatten(1))


class ValueTorso(Torso):
    """Another class, for ``model.value_encoder``: a ReLU layer of ``units`` units."""

    def __init__(self, observation_space: gym.spaces.Box, units: int = 8):
        super().__init__(observation_space, width=units)
        self.net[1] = nn.ReLU()


class WrongWidth(Torso):
    """Declares ``out_features`` one more than it returns."""

    def __init__(self, observation_space: gym.spaces.Box):
        super().__init__(observation_space, width=5)
        self.out_features = 6


class NoWidth(nn.Module):
    """Forgets to declare ``out_features``."""

    def __init__(self, observation_space: gym.spaces.Box):
        super().__init__()
        self.net = nn.Linear(int(np.prod(observation_space.shape)), 4)

    def forward(self, obs: Tensor) -> Tensor:
        return self.net(obs.float().flatten(1))


class NotAModule:
    """Not an ``nn.Module``."""

    out_features = 4

    def __init__(self, observation_space: gym.spaces.Box):
        pass


class Raising(nn.Module):
    """Cannot take the observation space."""

    def __init__(self, observation_space: gym.spaces.Box):
        raise ValueError("only images, please")


class DictTorso(nn.Module):
    """Reads a Dict observation ``{image, direction, pos}`` (one batch dimension)."""

    def __init__(self, observation_space: gym.spaces.Dict, width: int = 8):
        super().__init__()
        image = int(np.prod(observation_space["image"].shape))
        self.n = int(observation_space["direction"].n)
        self.net = nn.Linear(image + self.n + 2, width)
        self.out_features = width

    def forward(self, obs: dict[str, Tensor]) -> Tensor:
        image = obs["image"].float().flatten(1) / 255.0
        direction = nn.functional.one_hot(obs["direction"].long(), self.n).float()
        return torch.tanh(self.net(torch.cat([image, direction, obs["pos"]], dim=-1)))


class HostReadTorso(Torso):
    """A torso that reads a number back to the host in its forward (a branch on it): a
    graph break for ``torch.compile``."""

    def forward(self, obs: Tensor) -> Tensor:
        features = super().forward(obs)
        if float(features.detach().abs().max()) > 1e6:  # never true: tanh features
            features = features * 0.5
        return features
