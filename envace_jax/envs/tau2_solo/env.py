"""tau2-bench worlds in solo mode, executed by tau2's own environments (`worker.py`, in the
venv of `make tau2`) and scored by its own evaluator.

`Tau2Env` is a handle on one world of the worker (`envs.worker_process.RemoteWorld`). A tool
message tau2 marks as an error comes back as a `tool_error` response (a domain error: the world
refused the call); otherwise a JSON object is the response as is, and any other answer (text,
a JSON list or number) is `{"result": value}`. Success is tau2's verdict: the evaluator's
reward for the world's recorded episode, ended by the solo agent's stop, is 1.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envace_jax.envs.base import ToolResult, tool_error
from envace_jax.envs.tau2_package import MISSING, find_tau2, tau2_venv, venv_environ
from envace_jax.envs.worker_process import RemoteWorld, Worker, shared

TOOL_ERROR = "tool_error"  # tau2 marked the tool message as an error
_RAISED = "Error: "  # how tau2 writes an exception a tool raised
WORKER = Path(__file__).with_name("worker.py")


def worker() -> Worker:
    """This process's tau2 worker, started on first use."""

    def start() -> Worker:
        venv = tau2_venv()
        python = find_tau2(venv)
        if python is None:
            raise RuntimeError(f"data.env = 'tau2_*': {MISSING}")
        log = venv / "envace-worker.log"  # inside the venv, which git ignores
        return Worker("tau2", python, WORKER, venv.parent, venv_environ(), log)

    return shared("tau2", start)


def response(answer: Mapping[str, Any]) -> ToolResult:
    """A tau2 tool message ({content, error}) as a tool response (see the module docstring)."""
    text = answer.get("content") or ""
    if answer.get("error"):
        return tool_error(TOOL_ERROR, text.removeprefix(_RAISED))
    try:
        value = json.loads(text)
    except ValueError:
        return {"result": text}
    return value if isinstance(value, dict) else {"result": value}


class Tau2Env(RemoteWorld):
    """One tau2 world in solo mode (`envs.base.Environment`)."""

    def __init__(self):
        super().__init__(worker())

    def response(self, raw: Mapping[str, Any]) -> ToolResult:
        return response(raw)

    def success(self, final_reply: str, messages: Sequence[Mapping[str, Any]] = ()) -> bool:
        del final_reply, messages  # the world recorded the episode's calls itself
        self.task  # noqa: B018 (raises before a reset)
        return self.worker.request("check", env=self._id)["reward"] == 1.0
