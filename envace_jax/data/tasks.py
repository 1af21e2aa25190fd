"""Task records in the checklist format, and their validation.

A `Task` is one instruction: the opening chat (system + first user message), the tool schemas
the agent may call, the full reference conversation (its later user messages are replayed
verbatim, whatever the agent did), and a checklist per user turn (`checklists`).

`Task.ground_truth` (solution calls, expected final state) is ours, not the reference's; it is
kept opaque here, a JSON object whose vocabulary belongs to the judges. Validation
(`validation`) collects every problem of a record and names the field path of each.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE, Checklist, check_checklist
from envace_jax.data.validation import (
    Errors,
    TaskValidationError,
    check_messages,
    check_tools,
    describe,
    join_path,
    json_object,
)


def _freeze_messages(msgs: Sequence[Mapping]) -> tuple[dict, ...]:
    return tuple(dict(m) for m in msgs)


@dataclasses.dataclass(frozen=True)
class Task:
    """One training or evaluation instruction.

    messages: opening chat, ending with the first user message (exactly one user message).
    tools: OpenAI function schemas available to the agent.
    reference_messages: the full reference conversation; user turn t > 0 replays its t-th
      user message. It holds exactly `len(checklist)` user messages.
    checklist: [turn][item] for the checklist the reward uses.
    extra_checklists: further checklists of the same task (reference data may carry several;
      the reference trains with the first only).
    ground_truth: opaque JSON object (solution calls, expected final state) for rule judges.
    metadata: opaque JSON object (data_source, original index, ...).
    """

    task_id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    reference_messages: tuple[dict, ...]
    checklist: Checklist
    extra_checklists: tuple[Checklist, ...] = ()
    ground_truth: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def template_tools(self) -> list[Mapping[str, Any]] | None:
        """The tools to render through the chat template's tools block: `tools`, unless the
        task describes its tools in its own messages (metadata `render_tools: false`)."""
        if not self.tools or self.metadata.get("render_tools", True) is False:
            return None
        return list(self.tools)

    @property
    def num_turns(self) -> int:
        """User turns of the episode (the reference's `max_num_turns`)."""
        return len(self.checklist)

    @property
    def checklists(self) -> tuple[Checklist, ...]:
        return (self.checklist, *self.extra_checklists)

    def user_message(self, turn: int) -> dict:
        """The reference conversation's user message that opens `turn` (0-based)."""
        users = [m for m in self.reference_messages if m.get("role") == "user"]
        return users[turn]

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE
    ) -> Task:
        """Parse our own layout (the keys of `to_dict`); raise TaskValidationError naming every
        bad field."""
        err = Errors()
        task = parse_task(d, err, weight_tolerance=weight_tolerance)
        if err.items:
            raise TaskValidationError(err.items)
        return task

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task_id": self.task_id,
            "messages": [dict(m) for m in self.messages],
            "tools": [dict(t) for t in self.tools],
            "reference_messages": [dict(m) for m in self.reference_messages],
            "checklist": [[it.to_dict() for it in turn] for turn in self.checklist],
        }
        if self.extra_checklists:
            out["extra_checklists"] = [
                [[it.to_dict() for it in turn] for turn in cl] for cl in self.extra_checklists
            ]
        if self.ground_truth is not None:
            out["ground_truth"] = dict(self.ground_truth)
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True)


_TASK_KEYS = (
    "task_id",
    "messages",
    "tools",
    "reference_messages",
    "checklist",
    "extra_checklists",
    "ground_truth",
    "metadata",
)


def parse_task(
    d: Any,
    err: Errors,
    *,
    weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
    paths: Mapping[str, str] | None = None,
) -> Task | None:
    """Validate and build a Task from our layout. `paths` renames fields in error messages
    (readers use it to report the reference layout's own field paths)."""
    paths = dict(paths or {})
    if not isinstance(d, Mapping):
        err.expect("", "a task object", d)
        return None
    n0 = len(err.items)
    fields = _parse_fields(d, err, weight_tolerance, paths)
    if len(err.items) == n0:
        _check_replay(fields, d.get("reference_messages") is not None, err, paths)
    if len(err.items) > n0:
        return None
    return Task(
        task_id=str(fields["task_id"]),
        messages=_freeze_messages(fields["messages"]),
        tools=tuple(fields["tools"]),
        reference_messages=_freeze_messages(fields["reference_messages"]),
        checklist=fields["checklist"],
        extra_checklists=tuple(fields["extra_checklists"]),
        ground_truth=fields["ground_truth"],
        metadata=fields["metadata"],
    )


def _parse_fields(
    d: Mapping, err: Errors, weight_tolerance: float, paths: dict[str, str]
) -> dict[str, Any]:
    """Each field of a task record, checked on its own (problems go to `err`)."""
    P = lambda key: paths.get(key, key)  # noqa: E731
    unknown = sorted(set(d) - set(_TASK_KEYS))
    if unknown:
        err.add("", f"unknown fields {unknown}; expected a subset of {list(_TASK_KEYS)}")
    task_id = d.get("task_id")
    if task_id is None:
        err.add(P("task_id"), "missing required field")
    elif isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
        err.expect(P("task_id"), "a non-empty string", task_id)
    if "messages" not in d:
        err.add(P("messages"), "missing required field")
    messages = check_messages(d.get("messages", []), P("messages"), err)
    if "tools" not in d:
        err.add(P("tools"), "missing required field")
    tools = check_tools(d.get("tools", []), P("tools"), err)
    if "checklist" not in d:
        err.add(P("checklist"), "missing required field")
        checklist: Checklist = ()
    else:
        checklist = check_checklist(d["checklist"], P("checklist"), err, weight_tolerance)
    extra = d.get("extra_checklists") or []
    extra_cls: list[Checklist] = []
    if not isinstance(extra, list):
        err.expect(P("extra_checklists"), "a list of checklists", extra)
    else:
        for c, cl in enumerate(extra):
            cp = paths.get(f"extra_checklists[{c}]", join_path("extra_checklists", c))
            extra_cls.append(check_checklist(cl, cp, err, weight_tolerance))
    ref = d.get("reference_messages")
    if ref is None:  # single-turn tasks may omit it: the opening chat is the whole reference
        ref_msgs = list(messages)
    else:
        ref_msgs = check_messages(ref, P("reference_messages"), err)
    ground_truth = d.get("ground_truth")
    if ground_truth is not None:
        ground_truth = json_object(ground_truth, P("ground_truth"), err)
    metadata = json_object(d.get("metadata") or {}, P("metadata"), err) or {}
    return dict(
        task_id=task_id,
        messages=messages,
        tools=tools,
        checklist=checklist,
        extra_checklists=extra_cls,
        reference_messages=ref_msgs,
        ground_truth=ground_truth,
        metadata=metadata,
    )


def _check_replay(fields: dict, has_ref: bool, err: Errors, paths: dict[str, str]) -> None:
    """Replay needs: one user message in the opening chat, one reference user message per
    checklist turn, and the opening user message to be the reference's first."""
    P = lambda key: paths.get(key, key)  # noqa: E731
    messages, checklist = fields["messages"], fields["checklist"]
    n_open = sum(m.get("role") == "user" for m in messages)
    if n_open != 1 or messages[-1].get("role") != "user":
        err.add(
            P("messages"),
            f"expected an opening chat ending with its only user message, found {n_open} "
            f"user messages and a final {describe(messages[-1].get('role'))} message",
        )
    ref_users = [m for m in fields["reference_messages"] if m.get("role") == "user"]
    turns = [len(checklist)] + [len(c) for c in fields["extra_checklists"]]
    if len(ref_users) != turns[0]:
        err.add(
            P("reference_messages") if has_ref else P("checklist"),
            f"reference conversation has {len(ref_users)} user messages but the checklist "
            f"has {turns[0]} turns",
        )
    if any(n != turns[0] for n in turns[1:]):
        err.add(P("extra_checklists"), f"checklists disagree on the number of turns {turns}")
    first = (messages[-1].get("content") or "").strip()
    if ref_users and n_open == 1 and (ref_users[0].get("content") or "").strip() != first:
        err.add(
            P("reference_messages"),
            "first user message differs from the opening chat's user message",
        )
