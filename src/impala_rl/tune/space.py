"""A search space: config keys with a distribution each, checked before anything starts.

A parameter is ``key=distribution``, on the command line (``--space
algorithm.lr='loguniform(1e-5, 1e-2)'``) or in a study file's ``tune.space`` mapping:

- ``loguniform(low, high)``: a float, uniform in log space (``low > 0``);
- ``uniform(low, high)``: a float;
- ``int(low, high)``: an integer in ``[low, high]`` (``intlog(low, high)``: in log space);
- ``choice(a, b, ...)``: one of the values (each read as YAML: ``choice(tanh, relu)``,
  ``choice(true, false)``, ``choice([64, 64], [256, 256])``).

Refused, naming the parameter and what is valid: a key the config does not have, an empty or
inverted range, a distribution of another type than the key's (``loguniform`` for an integer
key, ``int`` for a list), and bounds or choices the key's own range refuses (the config's
rules, checked on each).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from impala_rl.config import ConfigError, RunConfig, did_you_mean, load_config, to_dict

KINDS = ("loguniform", "uniform", "int", "intlog", "choice")
PARAM = re.compile(r"^\s*(?P<kind>\w+)\s*\((?P<args>.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Param:
    """One dimension of the space: the config ``key`` and its distribution."""

    key: str
    kind: str  # one of KINDS
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple[Any, ...] = ()

    @property
    def log(self) -> bool:
        return self.kind in ("loguniform", "intlog")

    def __str__(self) -> str:
        if self.kind == "choice":
            return f"{self.key}=choice({', '.join(map(_show, self.choices))})"
        return f"{self.key}={self.kind}({_show(self.low)}, {_show(self.high)})"


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def _schema_types(cls: type = RunConfig, prefix: str = "") -> dict[str, str]:
    """Every leaf key of the config and its declared type (as written in the schema)."""
    types: dict[str, str] = {}
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            types.update(_schema_types(type(value), f"{prefix}{f.name}."))
        else:
            types[f"{prefix}{f.name}"] = str(f.type)
    return types


SCHEMA = _schema_types()


def _error(key: str, text: str) -> ConfigError:
    return ConfigError(f"tune.space: {key}: {text}")


def parse_param(key: str, text: Any) -> Param:
    """One ``key=distribution``; refused with a message naming the key when it is not one."""
    key = key.strip()
    if key not in SCHEMA:
        raise _error(key, f"not a config key{did_you_mean(key, list(SCHEMA))}")
    match = PARAM.match(str(text))
    kinds = "loguniform(low, high), uniform(low, high), int(low, high), intlog(low, high), "
    kinds += "choice(a, b, ...)"
    if match is None or match.group("kind") not in KINDS:
        raise _error(key, f"{text!r} is not a distribution; valid: {kinds}")
    kind = match.group("kind")
    try:
        args = [_number_or_as_is(a) for a in yaml.safe_load(f"[{match.group('args')}]")]
    except yaml.YAMLError as exc:
        raise _error(key, f"cannot read the arguments of {text!r}: {exc}") from None
    declared = SCHEMA[key]
    if kind == "choice":
        if len(args) < 2:
            raise _error(key, f"choice needs two values or more, got {args}")
        return Param(key, kind, choices=tuple(args))
    if len(args) != 2 or not all(_is_number(a) for a in args):
        raise _error(key, f"{kind} takes two numbers (low, high), got {args}")
    low, high = args
    numeric = declared.startswith(("int", "float"))
    if not numeric:
        raise _error(key, f"{kind} draws numbers; the key holds {declared}: use choice(...)")
    if kind in ("int", "intlog") and not declared.startswith("int"):
        raise _error(key, f"{kind} draws integers; the key holds {declared}: use uniform")
    if kind in ("uniform", "loguniform") and declared.startswith("int"):
        raise _error(key, f"{kind} draws floats; the key holds {declared}: use int or intlog")
    if kind in ("int", "intlog") and not (float(low).is_integer() and float(high).is_integer()):
        raise _error(key, f"{kind} takes integer bounds, got {low}, {high}")
    if not low < high:
        raise _error(key, f"an empty range: low {low} must be below high {high}")
    if kind in ("loguniform", "intlog") and low <= 0:
        raise _error(key, f"{kind} needs low > 0, got {low}")
    if kind in ("int", "intlog"):
        low, high = int(low), int(high)
    return Param(key, kind, float(low) if kind.endswith("uniform") else low, high, ())


def _number_or_as_is(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; a number is meant."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_space(
    items: dict[str, Any] | list[str], preset: Any, overrides: list[str]
) -> list[Param]:
    """The parameters of ``items`` (``{key: distribution}`` or ``["key=distribution", ...]``),
    each bound and choice checked by the config's rules on the config ``impala train`` would
    run for ``preset`` and ``overrides`` (an env's defaults included)."""
    from impala_rl.env_defaults import resolve_config

    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            if "=" not in item:
                raise ConfigError(f"tune.space: {item!r} is not key=distribution")
            pairs.append(tuple(item.split("=", 1)))
    params = [parse_param(k, v) for k, v in pairs]
    seen = [p.key for p in params]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ConfigError(f"tune.space: {', '.join(twice)} given more than once")
    if not params:
        raise ConfigError("tune.space: no parameter to search; give --space key=distribution")
    base = to_dict(resolve_config(preset, overrides))
    for param in params:
        values = param.choices if param.kind == "choice" else (param.low, param.high)
        for value in values:
            try:
                load_config(base=base, overrides=[f"{param.key}={_show(value)}"])
            except ConfigError as exc:
                raise _error(param.key, f"{_show(value)} does not fit the key: {exc}") from None
    return params


def overrides_of(values: dict[str, Any]) -> list[str]:
    """``key=value`` overrides of a trial's parameter values."""
    return [f"{key}={_show(value)}" for key, value in values.items()]


def config_value(cfg: RunConfig, key: str) -> Any:
    """The value of a dotted ``key`` in a config."""
    value: Any = to_dict(cfg)
    for part in key.split("."):
        value = value[part]
    return value
