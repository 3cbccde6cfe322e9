"""Plain YAML data -> the config's dataclasses: strict coercion (unknown keys and wrong types refused), dotted
overrides, and the bounds each section checks in its `__post_init__` (so a config built in code, or changed with
`dataclasses.replace`, is checked too). eagle3ft/config.py holds the sections and `load_config`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
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
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # e.g. float | Literal["auto"]: the first that fits
        errors = []
        for member in typing.get_args(tp):
            try:
                return coerce(member, value, where)
            except ConfigError as e:
                errors.append(str(e).removeprefix(f"{where}: "))
        raise ConfigError(f"{where}: {value!r} is none of: {'; '.join(errors)}")
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


def _groups(tp: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A GROUPED section's (group -> its dataclass, flat field name -> its group)."""
    hints = typing.get_type_hints(tp)
    groups = {f.name: _strip_optional(hints[f.name]) for f in dataclasses.fields(tp)}
    return groups, {f.name: g for g, gt in groups.items() for f in dataclasses.fields(gt)}


def flat_notice(written: list[str], meant: list[str]) -> None:
    """One line on stderr for keys written the old, flat way (still read as the grouped key they stand for)."""
    pairs = ", ".join(f"{a} as {b}" for a, b in zip(written, meant))
    print(f"config: read {pairs} (the flat spelling still works; the grouped one is the code's path)", file=sys.stderr)


def read_as(data: dict, overrides: list[str], merged: dict, old: str, new: str) -> None:
    """Where the file `data` or an `overrides` assignment writes the dotted key `old` and neither writes `new`, `new`
    takes `old`'s value in `merged` (the plain data about to be built), with a one-line notice: a key that a stage once
    read from another section's place."""

    given: dict = {}
    for o in overrides:
        apply_override(given, o)

    def written(key: str) -> bool:
        def holds(node: Any) -> bool:
            for p in key.split("."):
                if not isinstance(node, dict) or p not in node:
                    return False
                node = node[p]
            return True

        return holds(data) or holds(given)

    if written(old) and not written(new):
        *path, last = old.split(".")
        value = merged
        for p in [*path, last]:
            value = value[p]
        node = merged
        *path, last = new.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
        print(f"config: read {old} as {new} too ({new} is its own key; set it to silence this)", file=sys.stderr)


def _coerce_grouped(tp: Any, value: dict, where: str) -> Any:
    """A GROUPED section (eagle3ft/config_train.py): each field a group written as a mapping (`train.optimizer.lr`),
    as the code reads it; a group's field written flat at the section's level (`train.lr`) is an alias for it, read
    with a one-line notice."""
    groups, owner = _groups(tp)
    prefix = where + "." if where else ""
    unknown = sorted(set(value) - set(groups) - set(owner))
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known: {', '.join(groups)})")
    parts: dict[str, dict] = {}
    for g in groups:
        v = value.get(g)
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"{prefix}{g}: expected a mapping, got {v!r}")
        parts[g] = dict(v or {})
    flat = [k for k in value if k in owner and k not in groups]
    for key in flat:
        g = owner[key]
        if key in parts[g]:
            raise ConfigError(f"{prefix}{key} and {prefix}{g}.{key} are both set: keep {prefix}{g}.{key}")
        parts[g][key] = value[key]
    if flat:
        flat_notice([prefix + k for k in flat], [f"{prefix}{owner[k]}.{k}" for k in flat])
    return tp(**{g: coerce(gt, parts[g], prefix + g) for g, gt in groups.items()})


def canonical_key(tp: Any, parts: list[str]) -> list[str]:
    """The dotted path `parts` under the dataclass `tp` as the code reads it: a GROUPED section's flat field name
    gets its group in front (`train.lr` -> `train.optimizer.lr`). Parts past the dataclasses are kept as given."""
    out: list[str] = []
    for i, p in enumerate(parts):
        tp = _strip_optional(tp)
        if not dataclasses.is_dataclass(tp):
            return out + parts[i:]
        if getattr(tp, "GROUPED", False):
            groups, owner = _groups(tp)
            if p not in groups and p in owner:
                out.append(owner[p])
                tp = groups[owner[p]]
        hints = typing.get_type_hints(tp)
        out.append(p)
        if p not in hints:
            return out + parts[i + 1 :]
        tp = hints[p]
    return out


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
