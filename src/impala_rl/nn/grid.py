"""An encoder for grid worlds whose image entry holds small integer codes, not pixels.

MiniGrid's (and BabyAI's) ``image`` is ``uint8 [7, 7, 3]``: per cell an object, a colour and a
state index (0-10, 0-5, 0-2). The built-in image encoders read pixels (scaled by 1/255), which
squashes these codes to near 0 and puts "key" (5) numerically between "door" (4) and "ball"
(6). :class:`GridEncoder` embeds each channel's code instead (a table per channel), as the
MiniGrid baselines do with one-hot codes, then runs a small CNN over the cells.

It follows the user-encoder protocol (``model.encoder=impala_rl.nn.grid:GridEncoder``, its
options in ``model.encoder_kwargs``): built from the observation space, ``out_features``
declared, one batch dimension. It reads a ``Dict`` observation (the model presents an image
entry channels first, ``[C, H, W]``; a ``Discrete`` entry as its index, one-hot here; a text
entry such as the mission as its words, embedded by position; any other entry flattened) or a
lone ``uint8`` image ``Box``.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import torch
from torch import Tensor, nn

from impala_rl.envs.spaces import TextTokens
from impala_rl.nn.encoders import TextEncoder, is_image

__all__ = ["GridEncoder"]


class GridEncoder(nn.Module):
    """Per-channel code embeddings and a CNN over the cells, plus the other Dict entries.

    Args:
        observation_space: a ``Dict`` with one ``uint8 [C, H, W]`` entry (``image_key``), or
            that ``Box`` alone.
        image_key: the Dict entry holding the codes.
        codes: codes per channel (``null``: the space's bound plus one, 256 for MiniGrid's
            ``Box(0, 255)``; only the codes that occur are trained).
        embed_dim: the width of each channel's code embedding.
        channels: the CNN's channels (two 3x3 convolutions, padding 1, ReLU); ``0``: no CNN,
            the linear layer reads the embedded cells themselves (a fraction of the work).
        out_features: the width of the features (a linear layer over the cells and the other
            entries, ReLU).
    """

    def __init__(
        self,
        observation_space: gymnasium.Space,
        image_key: str = "image",
        codes: int | None = None,
        embed_dim: int = 8,
        channels: int = 32,
        out_features: int = 128,
    ):
        super().__init__()
        if isinstance(observation_space, gymnasium.spaces.Dict):
            if image_key not in observation_space.spaces:
                raise ValueError(
                    f"no entry {image_key!r} in the observation (entries: "
                    f"{', '.join(observation_space.spaces)}); set image_key"
                )
            image = observation_space[image_key]
            self.others = {k: s for k, s in observation_space.spaces.items() if k != image_key}
        else:
            image, self.others = observation_space, {}
        if not is_image(image):
            raise ValueError(f"the grid entry must be a uint8 [C, H, W] Box, got {image}")
        self.image_key = image_key
        self.is_dict = isinstance(observation_space, gymnasium.spaces.Dict)
        c, h, w = (int(d) for d in image.shape)
        self.codes = int(image.high.max()) + 1 if codes is None else int(codes)
        self.embed = nn.Embedding(c * self.codes, embed_dim)
        self.register_buffer("offsets", torch.arange(c).view(1, c, 1, 1) * self.codes, False)
        if channels < 0:
            raise ValueError(f"channels must be >= 0 (0: no CNN), got {channels}")
        if channels:
            self.cnn = nn.Sequential(
                nn.Conv2d(c * embed_dim, channels, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.ReLU(),
                nn.Flatten(),
            )
        else:
            self.cnn = nn.Flatten()
        width = (channels or c * embed_dim) * h * w
        self.discrete: dict[str, int] = {}
        texts: dict[str, TextEncoder] = {}  # a text entry's words (a mission), by position
        for name, sub in self.others.items():
            if isinstance(sub, TextTokens):
                texts[name] = TextEncoder(sub)
                width += texts[name].out_features
            elif isinstance(sub, gymnasium.spaces.Discrete):
                self.discrete[name] = int(sub.n)
                width += int(sub.n)
            else:
                width += int(np.prod(sub.shape))
        # indices into a list: a module's children cannot have every name
        self._texts = {name: i for i, name in enumerate(texts)}
        self.texts = nn.ModuleList(texts.values())
        self.head = nn.Sequential(nn.Linear(width, out_features), nn.ReLU())
        self.out_features = int(out_features)

    def forward(self, obs: Any) -> Tensor:
        image = obs[self.image_key] if self.is_dict else obs
        n, c, h, w = image.shape
        codes = image.long() + self.offsets  # [N, C, H, W], each channel its own table
        x = self.embed(codes)  # [N, C, H, W, E]
        x = x.permute(0, 1, 4, 2, 3).reshape(n, -1, h, w)
        parts = [self.cnn(x)]
        for name in self.others:
            value = obs[name]
            if name in self.discrete:
                parts.append(nn.functional.one_hot(value.long(), self.discrete[name]).float())
            elif name in self._texts:
                parts.append(self.texts[self._texts[name]](value).float())
            else:
                parts.append(value.float().reshape(n, -1))
        return self.head(torch.cat(parts, dim=-1))
