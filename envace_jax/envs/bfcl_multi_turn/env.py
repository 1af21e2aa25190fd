"""BFCL multi-turn worlds, executed by bfcl-eval's own backends (`worker.py`, in the package's
virtual environment) and judged by its own multi-turn checker.

One worker process per Python process serves every world: `BfclEnv` is a handle on one of its
worlds. Calls are checked against the task's tools here first (an unknown name or arguments off
the schema get the project's call errors and are never executed); the rest go to the backends,
in order. A backend's answer is its JSON object as is; a bare string (`None`, a plain message)
comes back as `{"result": string}`, and a call the backend raised on as an `execution_error`
(a domain error: the world refused it).

Success is the checker's verdict on the episode written in the package's result-file layout:
per user turn, the text of each assistant step (`<tool_call>` blocks, parsed back by the
package's Qwen function-calling handler, or the reply text). So the domain's success and
`bfcl evaluate` cannot disagree.
"""

from __future__ import annotations

import atexit
import itertools
import json
import subprocess
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envace_jax.envs.base import BAD_ARGS, UNKNOWN_TOOL, ToolResult, tool_error
from envace_jax.envs.bfcl_package import default_venv, ensure_venv, venv_environ
from envace_jax.text.tool_calls import format_tool_calls, tool_parameter_schemas, validate_schema

EXECUTION_ERROR = "execution_error"  # the backend raised on the call
_RAISED = "Error during execution: "  # how the package reports a call its backend raised on
WORKER = Path(__file__).with_name("worker.py")


class WorkerError(RuntimeError):
    """The bfcl-eval worker failed a request or died (its log is named)."""


class Worker:
    """The bfcl-eval worker process: one JSON request, one JSON answer, under a lock."""

    def __init__(self, venv: Path | None = None):
        venv = Path(venv) if venv else default_venv()
        python = ensure_venv(venv)
        self.log_path = venv.parent / "bfcl-worker.log"
        self._log = open(self.log_path, "a")
        self._proc = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=venv.parent,
            env=venv_environ(venv.parent),
        )
        self._lock = threading.Lock()
        self.unused: list[int] = []  # ids of worlds no longer referenced

    def request(self, op: str, **fields) -> Any:
        with self._lock:
            # Worlds collected since the last request are forgotten first (a finalizer may run
            # in the middle of a request, so it only queues them).
            while self.unused:
                self._exchange({"op": "close", "env": self.unused.pop()})
            return self._exchange({"op": op, **fields})

    def _exchange(self, req: dict) -> Any:
        cause = None
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        except (BrokenPipeError, ValueError) as exc:
            reply, cause = "", exc
        if not reply:
            raise WorkerError(f"the bfcl-eval worker died (log: {self.log_path})") from cause
        answer = json.loads(reply)
        if "error" in answer:
            op = req["op"]
            raise WorkerError(f"bfcl-eval worker, {op}: {answer['error']} (log: {self.log_path})")
        return answer["ok"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()


_WORKER: list[Worker] = []
_WORKER_LOCK = threading.Lock()


def worker() -> Worker:
    """This process's worker, started on first use (and the venv created, once)."""
    with _WORKER_LOCK:
        if not _WORKER or _WORKER[0]._proc.poll() is not None:
            _WORKER[:] = [Worker()]
            atexit.register(_WORKER[0].close)
        return _WORKER[0]


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


class BfclEnv:
    """One BFCL multi-turn world (`envs.base.Environment`). State: the task and the calls
    executed, which fix the backends' state (they are deterministic)."""

    _ids = itertools.count()

    def __init__(self):
        self._worker = worker()
        self._id = next(self._ids)
        self._task = None
        self._executed: list[dict] = []
        self._schemas: dict[str, Any] = {}
        weakref.finalize(self, self._worker.unused.append, self._id)

    def reset(self, task: Any) -> None:
        self._worker.request("reset", env=self._id, id=task.metadata["bfcl_id"])
        self._task, self._executed = task, []
        self._schemas = tool_parameter_schemas(task.tools)

    def _refusal(self, call) -> ToolResult | None:
        if call.name not in self._schemas:
            return tool_error(UNKNOWN_TOOL, f"no tool named {call.name!r}")
        if not isinstance(call.arguments, Mapping):
            return tool_error(BAD_ARGS, "arguments: not an object")
        problem = validate_schema(call.arguments, self._schemas[call.name])
        return tool_error(BAD_ARGS, problem) if problem else None

    def step(self, calls: Sequence[Any]) -> list[ToolResult]:
        if self._task is None:
            raise RuntimeError("BfclEnv.step before reset")
        out: list[ToolResult] = []
        run: list[dict] = []  # consecutive executable calls, sent together

        def flush():
            if run:
                out.extend(map(response, self._worker.request("step", env=self._id, calls=run)))
                self._executed.extend(run)
                run.clear()

        for call in calls:
            call = _as_call(call)
            refusal = self._refusal(call)
            if refusal is None:
                run.append({"name": call.name, "arguments": dict(call.arguments)})
                continue
            flush()
            out.append(refusal)
        flush()
        return out

    def state(self) -> dict[str, Any]:
        task_id = None if self._task is None else self._task.task_id
        return {"task_id": task_id, "n_calls": len(self._executed), "calls": list(self._executed)}

    def success(self, final_reply: str, messages: Sequence[Mapping[str, Any]] = ()) -> bool:
        if self._task is None:
            raise RuntimeError("BfclEnv.success before reset")
        verdict = self._worker.request(
            "check", id=self._task.metadata["bfcl_id"], turns=result_turns(messages)
        )
        return bool(verdict["valid"])


class _Call:
    def __init__(self, name, arguments):
        self.name, self.arguments = name, arguments


def _as_call(call) -> _Call:
    if isinstance(call, Mapping):
        return _Call(str(call.get("name")), call.get("arguments"))
    return _Call(call.name, call.arguments)
