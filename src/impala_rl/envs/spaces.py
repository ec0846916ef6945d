"""The bottom of :mod:`impala_rl.envs`: its error type and the model's view of a space.

An observation reaches the model as one ``Box`` (an image stays ``uint8``, anything
else becomes a float32 vector), or, for a ``Dict`` observation, as a ``Dict`` that keeps its
structure (:func:`dict_model_space`): an image entry stays a ``uint8`` image, a ``Discrete``
entry an index, a text entry (``Text``, MiniGrid's mission) its words as hashed ids
(:class:`TextTokens`), every other entry a float32 vector.

Every ``uint8`` image, plain, a Dict entry or a step key's, goes through one conversion to
``[C, H, W]`` (:func:`image_layout`): channels last (``[H, W, C]``, as MiniGrid's and most
pixel envs') is moved channels first, a stack of frames (``[N, H, W, C]`` or ``[N, C, H, W]``,
Gymnasium's ``FrameStackObservation``) becomes ``N * C`` channels, a grayscale frame
``[H, W]`` one channel.

Every env module imports from here and from nothing above it, so the package has no cycle.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class EnvError(RuntimeError):
    """An environment that cannot be built or used; the message says which and why."""


MIN_IMAGE_SIDE = 8
"""A ``uint8 [H, W]`` Box with both sides at least this long is a grayscale frame."""


def image_layout(space: spaces.Space) -> str | None:
    """How a ``uint8`` Box holds an image: ``"chw"`` (channels first, as the model takes
    it), ``"hwc"`` (channels last: at most 4 channels, fewer than either side), ``"nhwc"`` or
    ``"nchw"`` (a stack of frames), ``"hw"`` (one grayscale frame); ``None``: not an image."""
    if not isinstance(space, spaces.Box) or space.dtype != np.uint8:
        return None
    return shape_layout(space.shape)


def shape_layout(shape: tuple[int, ...]) -> str | None:
    """The :func:`image_layout` that an image of ``shape`` would have (whatever its dtype)."""

    def channels_last(c: int, h: int, w: int) -> bool:
        return c <= 4 and c < min(h, w)

    if len(shape) == 2:
        return "hw" if min(shape) >= MIN_IMAGE_SIDE else None
    if len(shape) == 3:
        return "hwc" if channels_last(shape[2], shape[0], shape[1]) else "chw"
    if len(shape) == 4:
        return "nhwc" if channels_last(shape[3], shape[1], shape[2]) else "nchw"
    return None


def _is_image(space: spaces.Space) -> bool:
    return image_layout(space) is not None


def to_chw(x: np.ndarray, layout: str) -> np.ndarray:
    """One image (``[*shape]`` of its ``layout``) as ``[C, H, W]``."""
    if layout == "chw":
        return x
    if layout == "hw":
        return x[None]
    if layout == "hwc":
        return np.ascontiguousarray(np.moveaxis(x, -1, 0))
    if layout == "nhwc":
        x = np.moveaxis(x, -1, 1)
    return np.ascontiguousarray(x).reshape(-1, *x.shape[-2:])


def image_space(space: spaces.Box) -> spaces.Box:
    """The ``uint8 [C, H, W]`` Box of an image space (:func:`image_layout`)."""
    layout = image_layout(space)
    assert layout is not None
    if layout == "chw":
        return space
    low, high = (to_chw(np.asarray(b), layout) for b in (space.low, space.high))
    return spaces.Box(low, high, dtype=np.uint8)


TEXT_WORDS = 32
TEXT_ENTRY = "text"  # the entry a text observation alone becomes
"""The words of a text entry the model reads: the first ones (a longer text is cut)."""

TEXT_BUCKETS = 1024
"""Ids per hash of a word (0 is no word). A word is two ids from two hashes, so two words share
both only by a chance of about one in a million, with no vocabulary to build or share."""


class TextTokens(spaces.MultiDiscrete):
    """The model's view of a text entry: its first :data:`TEXT_WORDS` words (lower case,
    letters and digits), each as two hashed ids ``[TEXT_WORDS, 2]`` (:func:`text_tokens`),
    ``0`` after the last word. The model embeds them by position (a mission's template puts
    the object it names in one place)."""

    def __init__(self) -> None:
        super().__init__(np.full((TEXT_WORDS, 2), TEXT_BUCKETS), dtype=np.int16)

    def __repr__(self) -> str:
        return f"TextTokens({TEXT_WORDS} words)"


def is_text(space: spaces.Space) -> bool:
    """A ``Text`` space, or one that cannot be flattened to numbers whose observations are
    strings (MiniGrid's ``MissionSpace``)."""
    if isinstance(space, spaces.Text):
        return True
    if space.dtype is not None and np.dtype(space.dtype).kind in "US":
        return True  # MissionSpace declares str: no sample needed (Policy.act asks each call)
    if type(space).__module__.startswith("gymnasium."):
        return False  # Gymnasium's own spaces are numbers or containers, Text aside
    try:
        spaces.flatten_space(space)
        return False
    except NotImplementedError:
        pass
    try:
        return isinstance(space.sample(), str)
    except Exception:  # a space that cannot sample says nothing
        return False


_cut_text_warned = False


def _warn_cut_text(n_words: int) -> None:
    """One warning a process: the model reads a text's first words only."""
    global _cut_text_warned
    if _cut_text_warned:
        return
    _cut_text_warned = True
    logging.getLogger(__name__).warning(
        "an observation's text has %d words; the model reads its first %d (the rest is cut)",
        n_words,
        TEXT_WORDS,
    )


@functools.lru_cache(maxsize=4096)
def text_tokens(text: str) -> np.ndarray:
    """``text``'s :class:`TextTokens` (read-only; missions repeat, so they are cached)."""
    ids = np.zeros((TEXT_WORDS, 2), dtype=np.int16)
    words = re.findall(r"[0-9a-z]+", text.lower())
    if len(words) > TEXT_WORDS:
        _warn_cut_text(len(words))
    for i, word in enumerate(words[:TEXT_WORDS]):
        digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
        for j in range(2):
            ids[i, j] = 1 + int.from_bytes(digest[2 * j : 2 * j + 2], "little") % (TEXT_BUCKETS - 1)
    ids.flags.writeable = False
    return ids


def _unflattenable(space: spaces.Space) -> str:
    """Which entries of a Dict or Tuple space cannot be flattened to numbers (e.g. ``Text``)."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        items = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space)
        bad = []
        for key, sub in items:
            try:
                spaces.flatten_space(sub)
            except NotImplementedError:
                bad.append(f"{key!r} ({type(sub).__name__})")
        if bad:
            return f"entries {', '.join(bad)} cannot be flattened to numbers"
    return f"{type(space).__name__} cannot be flattened to numbers"


def model_observation_space(space: spaces.Space) -> spaces.Box:
    """The ``Box`` the model receives for an env's observation space."""
    if _is_image(space):
        return image_space(space)  # type: ignore[arg-type]
    if isinstance(space, spaces.Box) and len(space.shape) == 1 and space.dtype == np.float32:
        return space
    try:
        flat = spaces.flatten_space(space)
    except NotImplementedError as exc:
        raise EnvError(
            f"observation space {space} is not supported: {str(exc) or _unflattenable(space)}"
        ) from None
    if not isinstance(flat, spaces.Box):
        raise EnvError(
            f"observation space {space} is not supported: a {type(space).__name__} has no fixed "
            "size (pad it to a Box in a wrapper); valid: Box, Discrete, MultiDiscrete, "
            "MultiBinary, Text, and Tuple or Dict of them"
        )
    return spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32), dtype=np.float32)


def _entry_space(space: spaces.Space) -> spaces.Space:
    """The model's view of one Dict entry that is not text (see :func:`dict_model_space`)."""
    if isinstance(space, spaces.Discrete):
        return spaces.Discrete(int(space.n))
    return model_observation_space(space)


def dict_model_space(space: spaces.Dict) -> tuple[spaces.Dict, list[str]]:
    """The model's ``Dict`` for a Dict observation space and the entries it leaves out.

    An image entry stays a ``uint8`` image (as ``[C, H, W]``: :func:`image_layout`), a
    ``Discrete`` entry is its index (``Discrete(n)`` from 0), a text entry its words
    (:class:`TextTokens`), any other entry a float32 vector (flattened); an entry of a space
    that neither flattens to numbers nor samples strings (an env's own opaque space) is left
    out.
    """
    kept: dict[str, spaces.Space] = {}
    dropped: list[str] = []
    for name, sub in space.spaces.items():
        if is_text(sub):  # before flattening: Gymnasium flattens Text to character indices
            kept[str(name)] = TextTokens()
            continue
        try:
            flat = spaces.flatten_space(sub)
        except NotImplementedError:
            dropped.append(f"{name!r} ({type(sub).__name__})")
            continue
        if not isinstance(flat, spaces.Box):  # a Sequence or Graph: no fixed size
            dropped.append(f"{name!r} ({type(sub).__name__}, no fixed size)")
            continue
        kept[str(name)] = _entry_space(sub)
    if not kept:
        raise EnvError(
            f"observation space {space} is not supported: no entry can be given to the model "
            f"({', '.join(dropped)} are not numbers)"
        )
    return spaces.Dict(kept), dropped


def is_composite(space: spaces.Space) -> bool:
    """A ``Tuple`` or ``Dict`` space (an action of parts: one tuple or dict per env)."""
    return isinstance(space, (spaces.Tuple, spaces.Dict))


def space_leaves(space: spaces.Space, path: str = "") -> list[tuple[str, spaces.Space]]:
    """The non-container spaces of a (nested) ``Tuple`` or ``Dict`` space, in order, each
    with its path (``[0]['force']``); any other space is its own one leaf."""
    if isinstance(space, spaces.Tuple):
        items: Any = enumerate(space.spaces)
    elif isinstance(space, spaces.Dict):
        items = space.spaces.items()
    else:
        return [(path, space)]
    leaves = [leaf for key, sub in items for leaf in space_leaves(sub, f"{path}[{key!r}]")]
    return leaves or [(path, space)]  # an empty container stands for itself


def assemble_leaves(space: spaces.Space, values: Iterator[Any]) -> Any:
    """One value of a (nested) ``Tuple`` or ``Dict`` space from its leaves' values, in the
    order of :func:`space_leaves`."""
    if isinstance(space, spaces.Tuple):
        return tuple(assemble_leaves(sub, values) for sub in space.spaces)
    if isinstance(space, spaces.Dict):
        return {key: assemble_leaves(sub, values) for key, sub in space.spaces.items()}
    return next(values)


def mask_layout(space: spaces.Space) -> list[tuple[str, int]]:
    """The parts of ``space`` an ``action_mask`` covers, in order, with their widths: one
    entry per action of a ``Discrete``, one per value of each ``MultiDiscrete`` dimension
    (concatenated), two per bit of a ``MultiBinary`` (may it be 0, may it be 1: the bit as a
    dimension of two values, sb3-contrib's layout), and of a ``Tuple`` or ``Dict`` action
    those of its leaves that are any of these (its ``Box`` parts take none)."""
    layout = []
    for path, leaf in space_leaves(space):
        if isinstance(leaf, spaces.Discrete):
            layout.append((path, int(leaf.n)))
        elif isinstance(leaf, spaces.MultiDiscrete):
            layout.append((path, int(np.asarray(leaf.nvec).sum())))
        elif isinstance(leaf, spaces.MultiBinary):
            layout.append((path, 2 * int(np.prod(leaf.shape, dtype=np.int64))))
    return layout


def mask_width(space: spaces.Space) -> int | None:
    """How many entries an ``action_mask`` for ``space`` has (:func:`mask_layout`'s widths
    added up); ``None``: no part of the space takes a mask."""
    layout = mask_layout(space)
    return sum(width for _, width in layout) if layout else None


def flat_mask(space: spaces.Space, mask: Any) -> np.ndarray:
    """An action mask for ``space`` as the one array of :func:`mask_layout`'s entries: ``mask``
    flat already, or for a ``Dict`` action a dict keyed as its masked parts, for a ``Tuple``
    one a tuple of their masks in order (nested as the action is)."""
    if isinstance(space, spaces.Dict) and isinstance(mask, Mapping):
        subs = [(k, sub) for k, sub in space.spaces.items() if mask_width(sub) is not None]
        missing = [k for k, _ in subs if k not in mask]
        if missing:
            raise EnvError(f"an action_mask for {space} has no part {missing[0]!r}")
        parts = [flat_mask(sub, mask[k]) for k, sub in subs]
    elif isinstance(space, spaces.Tuple) and _of_parts(mask):
        subs = [sub for sub in space.spaces if mask_width(sub) is not None]
        if len(mask) != len(subs):
            raise EnvError(
                f"an action_mask of {len(mask)} parts for {space}: it has {len(subs)} to mask"
            )
        parts = [flat_mask(sub, part) for sub, part in zip(subs, mask, strict=True)]
    else:
        return np.asarray(mask).reshape(-1)
    return np.concatenate(parts) if parts else np.zeros(0)


def _of_parts(mask: Any) -> bool:
    """A tuple or list of per-part masks, not one flat list of 0/1 entries."""
    return isinstance(mask, (tuple, list)) and any(
        isinstance(part, Mapping) or np.ndim(part) > 0 for part in mask
    )


ACTION_LEAVES = (spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary, spaces.Box)
"""The action spaces a policy head samples; a ``Tuple`` or ``Dict`` of them is one action of
parts."""


def check_action_space(space: spaces.Space, where: str = "action space") -> None:
    """An :class:`EnvError` naming the first part of ``space`` that no policy head samples (a
    ``OneOf``, a ``Text``, an env's own space), before anything is built."""
    if is_composite(space):
        items = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space)
        for key, sub in items:
            check_action_space(sub, f"{where} entry {key!r}")
        return
    if not isinstance(space, ACTION_LEAVES):
        raise EnvError(
            f"{where} {space} is not supported; valid: Discrete, MultiDiscrete, MultiBinary, "
            "Box, and Tuple or Dict of them"
        )


def _holds_image_or_text(space: spaces.Space) -> bool:
    """An image or a text, or a Tuple or Dict holding one at any depth."""
    if isinstance(space, spaces.Dict):
        return any(_holds_image_or_text(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return any(_holds_image_or_text(s) for s in space.spaces)
    return _is_image(space) or is_text(space)


def entry_paths(
    space: spaces.Space, entries: bool = True
) -> dict[str, tuple[tuple[Any, ...], spaces.Space]] | None:
    """Each entry of an observation space that reaches the model as a ``Dict``: its name, the
    keys that reach it in an observation, and its space; ``None``: one array. A Dict's own
    entries; with ``entries``, also a ``Tuple`` that holds an image or a text, keyed by
    position (``"0"``, ``"1"``...: flattened, an image would lose its layout and a text be
    character indices), a text alone as ``"text"``, and a Tuple or Dict entry holding an image
    or a text as its own entries (``"robot/camera"``)."""
    if isinstance(space, spaces.Dict):
        items = [(str(k), (k,), sub) for k, sub in space.spaces.items()]
    elif entries and isinstance(space, spaces.Tuple) and _holds_image_or_text(space):
        items = [(str(i), (i,), sub) for i, sub in enumerate(space.spaces)]
    elif entries and is_text(space):
        return {TEXT_ENTRY: ((), space)}
    else:
        return None
    found: dict[str, tuple[tuple[Any, ...], spaces.Space]] = collections.OrderedDict()
    for name, path, sub in items:
        inner = entry_paths(sub, entries) if is_composite(sub) else None
        if entries and inner is not None and _holds_image_or_text(sub):
            for inner_name, (inner_path, leaf) in inner.items():
                found[f"{name}/{inner_name}"] = (path + inner_path, leaf)
        else:
            found[name] = (path, sub)
    return found


def observation_entries(
    space: spaces.Space, entries: bool = True
) -> dict[str, spaces.Space] | None:
    """The entries of :func:`entry_paths`, by name: ``{name: space}``, or ``None``."""
    found = entry_paths(space, entries)
    return None if found is None else {name: sub for name, (_, sub) in found.items()}


def keeps_structure(space: spaces.Space, entries: bool = True) -> bool:
    """Whether an observation space reaches the model as a ``Dict``."""
    return observation_entries(space, entries) is not None


class ObservationConverter:
    """One observation space as the model takes it (``space``): the ``Box`` of
    :func:`model_observation_space`, or the ``Dict`` of :func:`dict_model_space` over its
    :func:`entry_paths` (``entries``: whether a Tuple or nested entry holding an image or
    text, and a text alone, are read as entries; ``dropped``: the entries it leaves out).
    Called on an observation, it returns the model's form: an array, or a dict of arrays."""

    def __init__(self, source: spaces.Space, entries: bool = True):
        self.source = source
        self.dropped: list[str] = []
        self._entries: dict[str, spaces.Space] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}
        self.space: spaces.Space
        found = entry_paths(source, entries)
        if found is not None:
            self._entries = {name: sub for name, (_, sub) in found.items()}
            self._paths = {name: path for name, (path, _) in found.items()}
            nested = any(len(path) != 1 for path in self._paths.values())
            plain = isinstance(source, spaces.Dict) and not nested  # its own order, as before
            structure = source if plain else spaces.Dict(self._entries)
            self.space, self.dropped = dict_model_space(structure)  # type: ignore[arg-type]
        else:
            self.space = model_observation_space(source)
        self.identity = self.space is source

    def __call__(self, observation: Any) -> Any:
        if self.identity:
            return observation
        if self._entries:
            return {
                name: self._entry(self._entries[name], sub, self._value(observation, name))
                for name, sub in self.space.spaces.items()  # type: ignore[attr-defined]
            }
        return self._entry(self.source, self.space, observation)

    def _value(self, observation: Any, name: str) -> Any:
        """Entry ``name`` of an observation: its keys followed (a text alone: itself)."""
        for key in self._paths[name]:
            observation = observation[key]
        return observation

    @staticmethod
    def _entry(source: spaces.Space, target: spaces.Space, value: Any) -> np.ndarray:
        """One observation (or Dict entry) of ``source`` in the model's form ``target``."""
        if isinstance(target, TextTokens):
            return text_tokens(str(value)).copy()  # the cached one stays read-only
        if isinstance(target, spaces.Discrete):
            return np.asarray(int(value) - int(source.start), dtype=np.int64)
        layout = image_layout(source)
        if layout is not None:
            return to_chw(np.asarray(value, dtype=np.uint8), layout)
        if target is source:
            return np.asarray(value, dtype=target.dtype)
        if isinstance(source, spaces.Box):
            return np.asarray(value, dtype=np.float32).reshape(-1)
        return spaces.flatten(source, value).astype(np.float32)


class ModelObservation(gym.ObservationWrapper):
    """Presents a plain env's observations as the model takes them
    (:class:`ObservationConverter`)."""

    def __init__(self, env: gym.Env, entries: bool = True):
        super().__init__(env)
        self._convert = ObservationConverter(env.observation_space, entries)
        self.observation_space = self._convert.space
        self.dropped = self._convert.dropped

    def observation(self, observation: Any) -> Any:
        return self._convert(observation)


def log_dropped_entries(env_id: str, dropped: list[str], step_key: int | None = None) -> None:
    """One line naming the Dict entries the model does not read (neither numbers nor text),
    if any (of step key ``step_key`` in a structured env)."""
    if dropped:
        where = env_id if step_key is None else f"{env_id}, step key {step_key}"
        logging.getLogger(__name__).warning(
            "env.id=%s: the observation entries %s are neither numbers of a fixed size nor "
            "text; the model does not read them",
            where,
            ", ".join(dropped),
        )
