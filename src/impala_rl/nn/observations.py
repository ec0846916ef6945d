"""Observations as the model takes them: one tensor (a ``Box``), or a dict of tensors, one per
entry of a ``Dict`` observation (each in its own dtype: an image stays ``uint8``, a
``Discrete`` entry is an ``int64`` index).

Slots and request buffers are flat ``{field: tensor}`` maps (shared memory, one descriptor per
field): a Dict observation of field ``obs`` lives in the fields ``obs.<entry>``. These helpers
read, write, index and convert either form, so the code that moves observations does not ask
which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Obs = Tensor | dict[str, Tensor]
"""A batch of observations: ``[*batch, *o]``, or ``{entry: [*batch, *o_entry]}``."""


def entry_field(field: str, entry: str) -> str:
    """The slot field of a Dict observation's entry: ``obs.image``."""
    return f"{field}.{entry}"


def read_obs(
    fields: Mapping[str, Any], field: str, get: Callable[[str], Tensor] | None = None
) -> Obs:
    """Observation ``field`` of a slot, batch or buffer: ``get(field)`` (default: the item) for
    a Box, ``{entry: get("field.entry")}`` for a Dict."""
    get = fields.__getitem__ if get is None else get
    if field in fields:
        return get(field)
    prefix = f"{field}."
    return {name[len(prefix) :]: get(name) for name in fields if name.startswith(prefix)}


def write_obs(fields: Mapping[str, Tensor], field: str, index: Any, obs: Obs) -> None:
    """``fields[field][index] = obs``, per entry for a Dict observation."""
    if isinstance(obs, dict):
        for entry, value in obs.items():
            fields[entry_field(field, entry)][index] = value
    else:
        fields[field][index] = obs


def as_obs(x: Any, device: Any = None, index: Any = None) -> Obs:
    """Tensors of a numpy observation batch (a dict of arrays for a Dict observation), rows
    ``index`` if given; shares memory with the arrays where it can (CPU, no index)."""
    if isinstance(x, Mapping):
        return {k: as_obs(v, device, index) for k, v in x.items()}
    if index is not None:
        x = x[index]
    return torch.as_tensor(x, device=device)


def map_obs(obs: Obs, fn: Callable[[Tensor], Tensor]) -> Obs:
    """``fn`` applied to the tensor, or to every entry's."""
    return {k: fn(v) for k, v in obs.items()} if isinstance(obs, dict) else fn(obs)


def stack_obs(items: Sequence[Any]) -> Obs:
    """A batch ``[n, ...]`` of ``n`` single numpy observations (dicts for a Dict one)."""
    if isinstance(items[0], Mapping):
        return {k: torch.as_tensor(np.stack([x[k] for x in items])) for k in items[0]}
    return torch.as_tensor(np.stack(items))


def any_tensor(obs: Obs) -> Tensor:
    """One of the observation's tensors (for its device and batch size)."""
    return next(iter(obs.values())) if isinstance(obs, dict) else obs
