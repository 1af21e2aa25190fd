"""Checklists: per user turn, the weighted criteria a judge checks the assistant's steps against.

Each item is judged (by an LLM judge, or by a machine-checkable `rule`) on the assistant steps
of its turn. `ChecklistItem.rule` is ours, not the reference's: a small JSON object whose `kind`
is a string (e.g. `{"kind": "call", "tool": ..., "args": {...}}`); its vocabulary belongs to
the judges. Weights of one turn must sum to 1 within `DEFAULT_WEIGHT_TOLERANCE` (the
annotation pipeline behind the reference data enforces the same 1e-6), which keeps an episode
score in [0, 1].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from envace_jax.data.validation import (
    Errors,
    TaskValidationError,
    is_number,
    join_path,
    json_object,
    str_field,
    typed_entries,
)

DEFAULT_WEIGHT_TOLERANCE = 1e-6

# What an item may focus on (the annotation schema of the reference data). The LLM judge uses
# it: items on tool calls or tool output fail outright when a tool response carries an error.
FOCUS_ON_VALUES = (
    "assistant.tool_calls",
    "assistant.content.thinking",
    "assistant.content.user_visible_reply",
    "tool.content",
)

_ITEM_KEYS = (
    "id",
    "question",
    "focus_on",
    "pass_condition",
    "failure_examples",
    "evidence",
    "weight",
    "required_for_next_turn",
    "rule",
)


@dataclasses.dataclass(frozen=True)
class ChecklistItem:
    """One criterion of one user turn.

    `evidence` holds the reference snippets shown to the judge. Reference-data evidence entries
    are objects `{turn, step, from, snippet}`; their snippets land here and the objects without
    the snippet in `extra["evidence_sources"]`, so nothing is lost. Keys we do not model
    (`dependence`, annotation metadata) are kept in `extra` and written back by `to_dict`.
    When absent, `failure_examples` and `evidence` are empty and `required_for_next_turn` is
    false; `question`, `focus_on`, `pass_condition` and `weight` are required.
    """

    question: str
    focus_on: str
    pass_condition: str
    failure_examples: tuple[str, ...]
    evidence: tuple[str, ...]
    weight: float
    required_for_next_turn: bool
    id: str | None = None
    rule: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChecklistItem:
        err = Errors()
        item = _parse_item(d, "", err)
        if err.items:
            raise TaskValidationError(err.items)
        return item

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out.update(
            question=self.question,
            focus_on=self.focus_on,
            pass_condition=self.pass_condition,
            failure_examples=list(self.failure_examples),
            evidence=self._evidence_out(),
            weight=self.weight,
            required_for_next_turn=self.required_for_next_turn,
        )
        if self.rule is not None:
            out["rule"] = dict(self.rule)
        for k, v in self.extra.items():
            if k != "evidence_sources":
                out.setdefault(k, v)
        return out

    def _evidence_out(self) -> list:
        sources = self.extra.get("evidence_sources")
        if isinstance(sources, list) and len(sources) == len(self.evidence):
            return [{**src, "snippet": s} for src, s in zip(sources, self.evidence, strict=True)]
        return list(self.evidence)


def _parse_item(d: Any, path: str, err: Errors) -> ChecklistItem | None:
    if not isinstance(d, Mapping):
        err.expect(path, "a checklist item object", d)
        return None
    n0 = len(err.items)
    question = str_field(d, "question", path, err, nonempty=True)
    focus_on = d.get("focus_on")
    if focus_on is None:
        err.add(join_path(path, "focus_on"), "missing required field")
    elif focus_on not in FOCUS_ON_VALUES:
        err.expect(join_path(path, "focus_on"), f"one of {list(FOCUS_ON_VALUES)}", focus_on)
    pass_condition = str_field(d, "pass_condition", path, err, nonempty=True)
    item_id = str_field(d, "id", path, err, required=False)

    fails = d.get("failure_examples", [])
    fp = join_path(path, "failure_examples")
    if not isinstance(fails, list) or not all(isinstance(x, str) for x in fails):
        err.expect(fp, "a list of strings", fails)
        fails = []

    extra = {k: v for k, v in d.items() if k not in _ITEM_KEYS}
    evidence = d.get("evidence", [])
    snippets: list[str] = []
    sources: list[dict] = []
    if not isinstance(evidence, list):
        err.expect(join_path(path, "evidence"), "a list of strings or {snippet} objects", evidence)
    else:
        for i, ev in enumerate(evidence):
            ep = join_path(join_path(path, "evidence"), i)
            if isinstance(ev, str):
                snippets.append(ev)
            elif isinstance(ev, Mapping) and isinstance(ev.get("snippet"), str):
                snippets.append(ev["snippet"])
                sources.append({k: v for k, v in ev.items() if k != "snippet"})
            else:
                err.expect(ep, "a string or an object with a string snippet", ev)
    if sources:
        if len(sources) != len(snippets):
            err.add(join_path(path, "evidence"), "mixes plain strings and {snippet} objects")
        extra["evidence_sources"] = sources

    weight = d.get("weight")
    wp = join_path(path, "weight")
    if weight is None:
        err.add(wp, "missing required field")
    elif not is_number(weight) or weight < 0:
        err.expect(wp, "a number >= 0", weight)
    required = d.get("required_for_next_turn", False)
    if not isinstance(required, bool):
        err.expect(join_path(path, "required_for_next_turn"), "true or false", required)

    rule = d.get("rule")
    if rule is not None:
        rp = join_path(path, "rule")
        rule = json_object(rule, rp, err)
        if rule is not None and not (isinstance(rule.get("kind"), str) and rule["kind"]):
            err.expect(join_path(rp, "kind"), "a non-empty string", rule.get("kind"))
    if len(err.items) > n0:
        return None
    return ChecklistItem(
        question=question,
        focus_on=focus_on,
        pass_condition=pass_condition,
        failure_examples=tuple(fails),
        evidence=tuple(snippets),
        weight=float(weight),
        required_for_next_turn=required,
        id=item_id,
        rule=rule,
        extra=extra,
    )


Checklist = tuple[tuple[ChecklistItem, ...], ...]  # [turn][item]


def check_checklist(
    value: Any, path: str, err: Errors, weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE
) -> Checklist:
    """[turn][item]; every turn has at least one item and its weights sum to 1."""
    if not isinstance(value, list):
        err.expect(path, "a list (one list of items per user turn)", value)
        return ()
    if not value:
        err.add(path, "expected at least one user turn, got []")
    turns = []
    for _, tp, turn in typed_entries(value, path, err, list, "a list of checklist items"):
        if not turn:
            err.add(tp, "expected at least one checklist item, got []")
            continue
        items = [_parse_item(it, join_path(tp, k), err) for k, it in enumerate(turn)]
        if all(it is not None for it in items):
            total = math.fsum(it.weight for it in items)
            if abs(total - 1.0) > weight_tolerance:
                err.add(tp, f"item weights sum to {total:.8g}, expected 1 (±{weight_tolerance:g})")
            turns.append(tuple(items))
    return tuple(turns)
