"""Plain YAML data -> the config's dataclasses: strict coercion (unknown keys and wrong types refused), dotted
overrides, and the bounds each section checks in its `__post_init__` (so a config built in code, or changed with
`dataclasses.replace`, is checked too). eagle3ft/config.py holds the sections and `load_config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used as written."""


class BoundError(ConfigError):
    """A section's field outside its bound; `key` names the field, `reason` says what it must be."""

    def __init__(self, section: object, key: str, reason: str) -> None:
        self.key, self.reason = key, reason
        super().__init__(f"{type(section).__name__}.{key} {reason}")


def _check(section: object, keys: tuple[str, ...], ok, what: str) -> None:
    nullable = {f.name for f in dataclasses.fields(section) if f.default is None}
    for key in keys:
        value = getattr(section, key)
        for v in value if isinstance(value, list) else [value]:
            if v is None and key in nullable:
                continue
            null = " or null" if key in nullable else ""
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise BoundError(section, key, f"must be {what}{null}, got {value!r}")
            if not math.isfinite(v):  # .inf passes every bound above; .nan fails them
                raise BoundError(section, key, f"must be a finite number{null}, got {value!r}")


def positive(section: object, *keys: str) -> None:
    """Each field is > 0 (a count of at least 1, a rate, a timeout); null passes where null is the default. Every
    check here also refuses NaN and inf."""
    _check(section, keys, lambda v: v > 0, "positive")


def non_negative(section: object, *keys: str) -> None:
    """Each field is >= 0 (0 has a meaning: none, off, keep all)."""
    _check(section, keys, lambda v: v >= 0, ">= 0")


def at_most(section: object, hi: float, *keys: str) -> None:
    _check(section, keys, lambda v: v <= hi, f"<= {hi}")


# --------------------------------------------------------------------------- building


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Build `tp` from plain YAML data, rejecting unknown keys and wrong types."""
    if value is None:
        if dataclasses.is_dataclass(tp):
            value = {}  # a section header with nothing under it: the defaults
        elif tp is Any or _strip_optional(tp) is not tp:
            return None
        else:
            raise ConfigError(f"{where}: a value is required (got nothing/null; only optional keys may be empty)")
    tp = _strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        if getattr(tp, "GROUPED", False):
            return _coerce_grouped(tp, value, where)
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"unknown config key '{where + '.' if where else ''}{unknown[0]}' (known: {', '.join(sorted(names))})"
            )
        kwargs = {k: coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except BoundError as e:  # the section's own check: named by its place in the file
            raise ConfigError(f"{where + '.' if where else ''}{e.key} {e.reason}") from None
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, item = typing.get_args(tp)  # str values as written (env, labels), others coerced as their type
        return {str(k): str(v) if item is str else coerce(item, v, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "2e-3" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is Any:
        return value
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _coerce_grouped(tp: Any, value: dict, where: str) -> Any:
    """A GROUPED section (eagle3ft/config_train.py): its fields are groups, each a dataclass, whose keys are written
    flat at the section's level; each key goes to the group that has it, and is named in errors as written."""
    hints = typing.get_type_hints(tp)
    groups = [f.name for f in dataclasses.fields(tp)]
    owner = {f.name: g for g in groups for f in dataclasses.fields(_strip_optional(hints[g]))}
    unknown = sorted(set(value) - set(owner))
    if unknown:
        raise ConfigError(
            f"unknown config key '{where + '.' if where else ''}{unknown[0]}' (known: {', '.join(sorted(owner))})"
        )
    parts: dict[str, dict] = {g: {} for g in groups}
    for key, v in value.items():
        parts[owner[key]][key] = v
    return tp(**{g: coerce(hints[g], parts[g], where) for g in groups})


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override to plain config data in place."""
    if "=" not in assignment:
        raise ConfigError(f"override '{assignment}' is not of the form section.key=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p, {}), dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
        node = node.setdefault(p, {})
    node[parts[-1]] = parse_yaml(raw, f"--set {assignment!r}") if raw.strip() else None


def parse_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, with a syntax error as a one-line ConfigError naming `where` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = getattr(e, "context", None)
        if context and start is not None:
            context = f"{context} (line {start.line + 1}, column {start.column + 1})"
        what = " ".join(str(x) for x in (context, getattr(e, "problem", None)) if x) or str(e).splitlines()[0]
        raise ConfigError(f"{where}:{at}: YAML syntax error: {what}") from None
