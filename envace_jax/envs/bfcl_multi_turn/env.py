"""BFCL multi-turn worlds, executed by bfcl-eval's own backends (`worker.py`, in the package's
virtual environment) and judged by its own multi-turn checker.

One worker process (`envs.worker_process`) serves every world of a Python process: `BfclEnv` is
a handle on one of its worlds. Calls are checked against the task's tools here first (an unknown
name or arguments off the schema get the project's call errors and are never executed); the
rest go to the backends, in order. A backend's answer is its JSON object as is; a bare string
(`None`, a plain message) comes back as `{"result": string}`, and a call the backend raised on
as an `execution_error` (a domain error: the world refused it).

Success is the checker's verdict on the episode written in the package's result-file layout:
per user turn, the text of each assistant step (`<tool_call>` blocks, parsed back by the
package's Qwen function-calling handler, or the reply text). So the domain's success and
`bfcl evaluate` cannot disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envace_jax.envs.base import ToolResult, tool_error
from envace_jax.envs.bfcl_package import default_venv, ensure_venv, venv_environ
from envace_jax.envs.worker_process import RemoteWorld, Worker, package_id, shared
from envace_jax.text.tool_calls import format_tool_calls

EXECUTION_ERROR = "execution_error"  # the backend raised on the call
_RAISED = "Error during execution: "  # how the package reports a call its backend raised on
WORKER = Path(__file__).with_name("worker.py")


def worker() -> Worker:
    """This process's bfcl-eval worker, started on first use (the venv created, once)."""

    def start() -> Worker:
        venv = default_venv()
        python = ensure_venv(venv)
        log = venv.parent / "bfcl-worker.log"
        return Worker("bfcl-eval", python, WORKER, venv.parent, venv_environ(venv.parent), log)

    return shared("bfcl-eval", start)


def response(text: str) -> ToolResult:
    """A backend's response string as a tool response (see the module docstring)."""
    if text.startswith(_RAISED):
        return tool_error(EXECUTION_ERROR, text[len(_RAISED) :])
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"result": text}


def result_turns(messages: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """An episode in the package's result-file layout: per user turn, each assistant step's
    text (its calls as `<tool_call>` blocks, or its reply)."""
    turns: list[list[str]] = []
    for m in messages:
        if m.get("role") == "user":
            turns.append([])
        elif m.get("role") == "assistant" and turns:
            calls = [c.get("function", c) for c in m.get("tool_calls") or []]
            turns[-1].append(format_tool_calls(calls) if calls else str(m.get("content") or ""))
    return turns


class BfclEnv(RemoteWorld):
    """One BFCL multi-turn world (`envs.base.Environment`)."""

    def __init__(self):
        super().__init__(worker())

    def response(self, raw: str) -> ToolResult:
        return response(raw)

    def success(self, final_reply: str, messages: Sequence[Mapping[str, Any]] = ()) -> bool:
        task = self.task
        verdict = self.worker.request("check", id=package_id(task), turns=result_turns(messages))
        return bool(verdict["valid"])
