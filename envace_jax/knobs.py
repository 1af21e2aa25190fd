"""Config knobs: dataclass fields that carry their default and their value rule.

Every config section is a frozen `Section` dataclass whose fields are declared with
`knob(default, rule)` (a value) or `nested(cls)` (a section inside it). From those declarations
come the tree of defaults that config files edit (`as_dict`), the check a section runs when it is
made, and the reading of a config tree back into sections (`build`), whose errors name the key:
`config.<section>.<key> = <value>: expected <rule>`.

A rule is a pair (predicate, what it allows); the constructors below are the one vocabulary.
This module imports nothing heavy: a config is checked before JAX is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

Rule = tuple[Callable[[Any], bool], str]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int) -> Rule:
    return (lambda v: _is_int(v) and v >= lo), f"an integer >= {lo}"


def number(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Rule:
    """A finite number (bools excluded) within the bounds given; `*_open` excludes that bound.
    NaN and infinities never pass: NaN compares false with every bound, so a range check alone
    lets it through, and no knob means anything at infinity."""

    def ok(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or (v < hi if hi_open else v <= hi)

    if hi is not None:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        return ok, f"a finite number in {left}{lo}, {hi}{right}"
    if lo is not None:
        return ok, f"a finite number {'>' if lo_open else '>='} {lo}"
    return ok, "a finite number"


def one_of(*choices: Any) -> Rule:
    return (lambda v: v in choices), f"one of {choices}"


def text(allowed: str, empty: bool = True) -> Rule:
    """A string (the empty one too unless `empty` is False); `allowed` says what it names."""
    return (lambda v: isinstance(v, str) and (empty or v != "")), allowed


def positive_ints() -> Rule:
    def ok(v: Any) -> bool:
        return isinstance(v, (tuple, list)) and len(v) > 0 and all(_is_int(x) and x > 0 for x in v)

    return ok, "a non-empty tuple of positive integers"


BOOL: Rule = (lambda v: isinstance(v, bool), "a bool")


def knob(default: Any, rule: Rule) -> Any:
    """A field holding a value: its default and the rule every value must meet."""
    return dataclasses.field(default=default, metadata={"rule": rule})


def nested(cls: type, linked: Mapping[str, str] | None = None, **defaults: Any) -> Any:
    """A field holding section `cls`, with `defaults` changed. A `linked` field is no key of the
    section: it takes the value of another key (field name -> dotted path from the top), so one
    value has one key however many sections read it."""
    meta = {"section": cls, "linked": dict(linked or {})}
    return dataclasses.field(default_factory=functools.partial(cls, **defaults), metadata=meta)


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of config sections: made with a value that breaks a field's rule, it raises
    ValueError starting with the field's name."""

    config_key: ClassVar[str] = ""  # The section's key in the job config, named by errors.

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if problems := _value_problems(type(self), values, ""):
            raise ValueError(problems[0])

    @classmethod
    def from_config(cls, cfg: Any, section: str | None = None):
        """The section from mapping `cfg` (a ConfigDict too), keys left out keeping their
        defaults; raises ValueError naming `config.<section>.<key>` (section: config_key)."""
        return build(cls, cfg, f"config.{section or cls.config_key}", partial=True)


def _keys(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of section `cls`, by name."""
    return {f.name: f for f in dataclasses.fields(cls)}


def _linked(field: dataclasses.Field) -> dict[str, str]:
    return field.metadata.get("linked", {})


def _section_keys(field: dataclasses.Field) -> dict[str, dataclasses.Field]:
    cls, linked = field.metadata["section"], _linked(field)
    return {n: f for n, f in _keys(cls).items() if n not in linked}


def _unknown(path: str, name: str, known: Mapping[str, Any], full: str) -> str:
    keys = ", ".join(sorted(known))
    return f"unknown config key {full}: {path} has no key {name!r} (keys: {keys})"


def as_dict(section: Section, linked: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The section's keys and values, nested sections as dicts, in declaration order."""
    out = {}
    for f in dataclasses.fields(section):
        if f.name in (linked or {}):
            continue
        value = getattr(section, f.name)
        out[f.name] = as_dict(value, _linked(f)) if "section" in f.metadata else value
    return out


def key_problem(cls: type, dotted: str) -> str | None:
    """Why `config.<dotted>` is not a value key of top section `cls` (None when it is one)."""
    keys, where = _keys(cls), "config"
    for part in dotted.split("."):
        if keys is None:
            return f"unknown config key config.{dotted}: {where} is a value, not a section"
        if part not in keys:
            return _unknown(where, part, keys, f"config.{dotted}")
        field, where = keys[part], f"{where}.{part}"
        keys = _section_keys(field) if "section" in field.metadata else None
    if keys is not None:
        return f"{where} is a section (keys: {', '.join(sorted(keys))}), not a value"
    return None


def _tree_problems(keys, values: Mapping[str, Any], path: str, partial: bool) -> list[str]:
    """Unknown, missing and rule-breaking keys of a section's `values`, and of its sections'."""
    problems = [_unknown(path, k, keys, f"{path}.{k}") for k in sorted(set(values) - set(keys))]
    missing = [f"{path}.{k}" for k in keys if k not in values]
    if missing and not partial:
        problems.append(f"config is missing key(s): {', '.join(missing)}")
    leaves = {}
    for name, field in keys.items():
        if name not in values:
            continue
        if "section" not in field.metadata:
            leaves[name] = values[name]
        elif not isinstance(values[name], Mapping):
            problems.append(f"{path}.{name} = {values[name]!r}: expected a section")
        else:
            sub = _section_keys(field)
            problems += _tree_problems(sub, values[name], f"{path}.{name}", partial)
    return problems + _value_problems(keys, leaves, f"{path}.")


def _value_problems(keys, values: Mapping[str, Any], prefix: str) -> list[str]:
    """`<prefix><key> = <value>: expected ...` for each value that breaks its field's rule."""
    if isinstance(keys, type):
        keys = _keys(keys)
    out = []
    for name, value in values.items():
        rule = keys[name].metadata.get("rule")
        if rule is not None and not rule[0](value):
            out.append(f"{prefix}{name} = {value!r}: expected {rule[1]}")
    return out


def _lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _with_tuples(tree: Mapping[str, Any]) -> dict[str, Any]:
    """`tree` with its lists as tuples: a ConfigDict keeps tuples, JSON and flags give lists."""
    fix = lambda v: (
        _with_tuples(v) if isinstance(v, Mapping) else tuple(v) if isinstance(v, list) else v
    )
    return {k: fix(v) for k, v in tree.items()}


def _make(cls: type, values: Mapping[str, Any], path: str, top: Mapping[str, Any]) -> Any:
    kwargs = {}
    for name, field in _keys(cls).items():
        if name not in values:
            continue
        value = values[name]
        if "section" in field.metadata:
            sub = dict(value)
            for key, link in _linked(field).items():
                sub[key] = _lookup(top, link)
            value = _make(field.metadata["section"], sub, f"{path}.{name}", top)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a section's messages start with the key's name
        raise ValueError(f"{path}.{e}") from None


def build(cls: type, cfg: Any, path: str = "config", partial: bool = False) -> Any:
    """Section `cls` read from mapping `cfg` (a ConfigDict too). Unknown keys, missing keys
    (unless `partial`: then they keep their defaults) and values that break their rules raise
    one ValueError naming each of them; a check across keys raises naming its first key."""
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {type(cfg).__name__}")
    cfg = _with_tuples(cfg)
    if problems := _tree_problems(_keys(cls), cfg, path, partial):
        raise ValueError("; ".join(problems))
    return _make(cls, cfg, path, cfg)
