"""The memory slot: one fixed place in every prompt for test-time rehearsal's memory.

A policy reads a memory well only where it was trained to read one, so with a slot every
prompt has it, in the warm start, in RL rollouts and in evaluation: a last paragraph that holds
the memory, or `EMPTY` when there is none, so that the no-memory case is in distribution too.

Places (`data.memory_slot`):

* ``off``: no slot; a memory is appended, after a blank line, to the task's last opening
  message (the user instruction);
* ``system``: the last paragraph of the system turn (a system message is added when the task
  has none);
* ``user``: the last paragraph of the last opening message.

`docs/memory.md` records which place the demo uses and the measurement behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PLACES = ("off", "system", "user")
EMPTY = "Rehearsal memory: none"
_SEP = "\n\n"


def with_slot(messages: Sequence[Mapping], place: str) -> list[dict]:
    """Copies of `messages` (a task's opening chat) with the empty slot at `place`."""
    if place not in PLACES:
        raise ValueError(f"memory slot place must be one of {PLACES}, got {place!r}")
    out = [dict(m) for m in messages]
    if place == "off":
        return out
    if place == "system":
        if not out or out[0].get("role") != "system":
            out.insert(0, {"role": "system", "content": EMPTY})
            return out
        target = out[0]
    else:
        target = out[-1]
    target["content"] = f"{target.get('content') or ''}{_SEP}{EMPTY}"
    return out


def fill(messages: Sequence[Mapping], memory: str | None) -> list[dict]:
    """Copies of `messages` with `memory` in their slot; without a slot a memory is appended to
    the last message. An empty memory leaves the messages (and their empty slot) as they are."""
    out = [dict(m) for m in messages]
    if not memory:
        return out
    for m in out:
        content = m.get("content")
        if isinstance(content, str) and (content == EMPTY or content.endswith(_SEP + EMPTY)):
            m["content"] = content[: len(content) - len(EMPTY)] + memory
            return out
    last = out[-1]
    last["content"] = f"{last.get('content') or ''}{_SEP}{memory}"
    return out


def opening_edited(task: Any, edit: Callable[[Sequence[Mapping]], list[dict]]) -> Any:
    """`task` (a dataclass with `messages`, its opening chat, and `reference_messages`, which
    begin with it) with `edit` applied to its opening in both."""
    n = len(task.messages)
    reference = edit(task.reference_messages[:n]) + [dict(m) for m in task.reference_messages[n:]]
    return dataclasses.replace(
        task, messages=tuple(edit(task.messages)), reference_messages=tuple(reference)
    )


def slotted_task(task: Any, place: str) -> Any:
    """`task` (a dataclass with `messages`, its opening chat, and `reference_messages`, which
    begin with it) with the empty slot at `place` in both."""
    if place == "off":
        return task
    return opening_edited(task, lambda messages: with_slot(messages, place))
