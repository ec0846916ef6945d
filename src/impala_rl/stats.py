"""Recording events and reducing them per epoch.

:class:`EventRecorder` buffers raw event values (cheap appends on the hot path);
:class:`EpochStatsAggregator` reduces them with the reducers declared in
:mod:`impala_rl.events` and keeps the last epoch's statistics for lookup and for writers.
A statistic's flat name is ``event[/output][/group]``, e.g. ``policy_loss/0``,
``episode_return/mean`` or ``time_backprob/percent``.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from impala_rl.events import EventSpec, event_specs, spec_of

EPOCH = "epoch"


def _reduce(reducer: str, values: list[float]) -> float:
    if reducer == "count":
        return float(len(values))
    if reducer == "sum":
        return float(math.fsum(values))
    if reducer == "last":
        return float(values[-1])
    if reducer == "min":
        return float(min(values))
    if reducer == "max":
        return float(max(values))
    mean = math.fsum(values) / len(values)
    if reducer == "mean":
        return float(mean)
    if reducer == "std":
        return float(math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values)))
    raise ValueError(f"unknown reducer {reducer!r}")


def stat_name(event: str, output: str | None, group: Any = None) -> str:
    parts = [event]
    if output:
        parts.append(output)
    if group is not None:
        parts.append(str(group))
    return "/".join(parts)


class _EventProxy:
    """Calls like ``proxy.policy_loss(step_key=0, value=1.0)`` append to the recorder."""

    def __init__(self, recorder: EventRecorder, specs: dict[str, EventSpec]):
        self._recorder = recorder
        self._specs = specs

    def __getattr__(self, name: str) -> Callable[..., None]:
        spec = self._specs.get(name)
        if spec is None:
            raise AttributeError(f"no event named {name!r}; known: {', '.join(self._specs)}")
        recorder = self._recorder

        def record(*args: Any, **kwargs: Any) -> None:
            recorder.record(spec, *args, **kwargs)

        self.__dict__[name] = record  # cache: later lookups skip __getattr__
        return record


class EventRecorder:
    """Buffers event values until an aggregator drains them."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, Any], list[dict[str, float]]] = defaultdict(list)
        self._specs: dict[str, EventSpec] = {}
        self._lock = threading.Lock()  # actors' events may come from a dispatcher thread

    def interface(self, interface: type) -> Any:
        """A proxy whose methods record the interface's events."""
        specs = event_specs(interface)
        self._specs.update(specs)
        return _EventProxy(self, specs)

    def record(self, event: Callable | EventSpec, *args: Any, **kwargs: Any) -> None:
        spec = spec_of(event)
        self._specs.setdefault(spec.name, spec)
        if args:
            kwargs.update(zip(spec.fields, args, strict=False))
        group = kwargs.pop(spec.group_by) if spec.group_by else None
        with self._lock:
            self._values[(spec.name, group)].append(kwargs)

    def record_each(self, event: Callable | EventSpec, values: Iterable[float]) -> None:
        """One event of a single ungrouped field per value, under one lock: what a per-sample
        figure (a minibatch's policy lag per decision) costs, hundreds of times a batch."""
        spec = spec_of(event)
        if spec.group_by or len(spec.fields) != 1:
            raise ValueError(f"{spec.name}: record_each takes events of one ungrouped field")
        self._specs.setdefault(spec.name, spec)
        field = spec.fields[0]
        with self._lock:
            self._values[(spec.name, None)].extend({field: v} for v in values)

    def drain(self) -> tuple[dict[str, EventSpec], dict[tuple[str, Any], list[dict[str, float]]]]:
        with self._lock:
            values, self._values = self._values, defaultdict(list)
            return dict(self._specs), values

    def merge_raw(self, specs: dict[str, EventSpec], values: dict) -> None:
        """Add values drained from another recorder (e.g. from an actor)."""
        self._specs.update(specs)
        for key, items in values.items():
            self._values[key].extend(items)


class EpochStatsAggregator:
    """Reduces recorded events per epoch and answers lookups on the last epoch."""

    def __init__(self, *recorders: EventRecorder) -> None:
        self.recorders = list(recorders)
        self.last_stats: dict[str, float] = {}
        self._by_key: dict[tuple[str, str | None, Any], float] = {}

    def reduce(self) -> dict[str, float]:
        """Drain every recorder and reduce; returns ``{flat_name: value}``."""
        merged: dict[tuple[str, Any], list[dict[str, float]]] = defaultdict(list)
        specs: dict[str, EventSpec] = {}
        for recorder in self.recorders:
            rec_specs, values = recorder.drain()
            specs.update(rec_specs)
            for key, items in values.items():
                merged[key].extend(items)
        by_key: dict[tuple[str, str | None, Any], float] = {}
        for (name, group), items in merged.items():
            spec = specs[name]
            for out in spec.outputs:
                vals = [float(item[out.field]) for item in items if out.field in item]
                if vals:
                    by_key[(name, out.name, group)] = _reduce(out.reducer, vals)
        self._by_key = by_key
        self.last_stats = {
            stat_name(n, o, g): v
            for (n, o, g), v in sorted(by_key.items(), key=lambda kv: str(kv[0]))
        }
        return self.last_stats

    def get_stats_value(
        self,
        event: Callable | EventSpec | str,
        level: str = EPOCH,
        name: str | None = None,
        group: Any = None,
    ) -> float | None:
        """The last epoch's value of ``event``'s output ``name`` (``None``: its only output)."""
        if level != EPOCH:
            raise ValueError(f"unknown stats level {level!r}; valid: {EPOCH!r}")
        event_name = event if isinstance(event, str) else spec_of(event).name
        return self._by_key.get((event_name, name, group))
