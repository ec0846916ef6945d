"""The README's reference tables stay true: every config key and every event is documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from impala_rl.config import RunConfig
from impala_rl.events import ActorEvents, ImpalaEvents, RunEvents, event_specs

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            keys += _keys(type(value), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_config_key_is_in_the_readme():
    missing = [k for k in _keys(RunConfig) if f"`{k}`" not in README]
    assert not missing, f"README's config reference lacks {missing}"


def test_every_event_is_in_the_readme():
    missing = [
        f"{iface.__name__}.{name}"
        for iface in (ImpalaEvents, ActorEvents, RunEvents)
        for name in event_specs(iface)
        if f"`{iface.__name__}.{name}(" not in README
    ]
    assert not missing, f"README's event table lacks {missing}"
