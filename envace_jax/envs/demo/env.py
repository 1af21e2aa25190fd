"""`DemoEnv`: the executable demo shop world behind the Environment protocol."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.envs.base import (
    BAD_ARGS,
    UNKNOWN_TOOL,
    CallLike,
    ToolResult,
    effects_key,
    error_code,
    tool_error,
)
from envace_jax.envs.demo.tools import STATE_CHANGING, execute, is_refusal
from envace_jax.envs.demo.world import World, copy_world


def _field(task: Any, key: str) -> Any:
    """A task field, from a `Task` record or from its dict form."""
    return task.get(key) if isinstance(task, Mapping) else getattr(task, key, None)


def _ground_truth(task: Any) -> Mapping[str, Any]:
    gt = _field(task, "ground_truth")
    if not isinstance(gt, Mapping):
        raise ValueError(f"task {_task_id(task)!r}: ground_truth must be a dict, got {type(gt)}")
    for key in ("initial_state", "final_state", "reply_facts"):
        if key not in gt:
            raise ValueError(f"task {_task_id(task)!r}: ground_truth lacks {key!r}")
    return gt


def _task_id(task: Any) -> str:
    return str(_field(task, "task_id"))


def _tool_names(task: Any) -> tuple[str, ...]:
    return tuple(t["function"]["name"] for t in _field(task, "tools") or ())


def states_fact(reply: str, fact: str) -> bool:
    """Whether `reply` states `fact` as a whole word (``150`` is not stated by ``1500``)."""
    return re.search(rf"(?<!\w){re.escape(str(fact))}(?!\w)", reply) is not None


class DemoEnv:
    """The demo shop/bank world for one task at a time.

    `reset(task)` loads ``task.ground_truth["initial_state"]``; `step` executes calls against
    that copy only; `success` compares the world with ``ground_truth["final_state"]``, checks
    that the changes that succeeded are the solution's (no extra ones that happen to cancel
    out) and that the world refused none (a refused change is recorded, as a real system logs
    a declined payment: trying the wrong branch costs the task), and looks for every
    ``ground_truth["reply_facts"]`` value in the final reply. Only the task's own tools
    (``task.tools``) can be called.
    """

    strict = True  # the world refuses changes its rules forbid (`envs.demo.corrupt` relaxes it)

    def __init__(self) -> None:
        self._task_id: str | None = None
        self._world: World | None = None
        self._tools: tuple[str, ...] = ()
        self._gt: Mapping[str, Any] = {}
        self._n_calls = 0
        self._changes: list[tuple[str, Any]] = []
        self._refused: list[tuple[str, Any]] = []

    def reset(self, task: Any) -> None:
        self._gt = _ground_truth(task)
        self._task_id = _task_id(task)
        self._tools = _tool_names(task)
        self._world = copy_world(self._gt["initial_state"])
        self._n_calls = 0
        self._changes: list[tuple[str, Any]] = []  # state-changing calls that succeeded
        self._refused: list[tuple[str, Any]] = []  # state-changing calls the world refused

    def _require_reset(self) -> World:
        if self._world is None:
            raise RuntimeError("DemoEnv: call reset(task) before step/state/success")
        return self._world

    def step(self, calls: Sequence[CallLike]) -> list[ToolResult]:
        world = self._require_reset()
        results = []
        for call in calls:
            self._n_calls += 1
            results.append(self._one(world, call))
        return results

    def _one(self, world: World, call: Any) -> ToolResult:
        name = getattr(call, "name", None)
        args = getattr(call, "arguments", None)
        if isinstance(call, Mapping):  # also accept {"name", "arguments"} dicts
            name, args = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or name not in self._tools:
            return tool_error(UNKNOWN_TOOL, f"no tool {name!r}")
        if isinstance(args, str):  # arguments as a JSON string (OpenAI message style)
            try:
                args = json.loads(args)
            except ValueError:
                return tool_error(BAD_ARGS, f"{name}: arguments are not JSON")
        result = execute(world, name, args, strict=self.strict)
        if name in STATE_CHANGING and error_code(result) is None:
            self._changes.append((name, args))
        elif is_refusal(name, result):
            self._refused.append((name, args))
        return result

    def state(self) -> dict[str, Any]:
        world = self._require_reset()
        return {
            "task_id": self._task_id,
            "world": copy_world(world),
            "n_calls": self._n_calls,
            "refused": [{"name": n, "arguments": a} for n, a in self._refused],
        }

    def success(self, final_reply: str, messages=()) -> bool:
        world = self._require_reset()
        if world != self._gt["final_state"] or self._refused:
            return False
        solution = self._gt.get("solution")
        if solution is not None:  # the goal reached by the requested changes only
            wanted = [(c["name"], c["arguments"]) for c in solution if c["name"] in STATE_CHANGING]
            if effects_key(self._changes) != effects_key(wanted):
                return False
        return isinstance(final_reply, str) and all(
            states_fact(final_reply, f) for f in self._gt["reply_facts"]
        )
