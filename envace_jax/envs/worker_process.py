"""A world served by a process in another virtual environment: third-party packages (bfcl-eval,
tau2-bench) pin their own dependencies, so their worlds run in a worker process of their venv,
and our side talks to it through pipes, one JSON request and one JSON answer per line.

The venv's python runs `worker_loop.py` on a world module (`answer(request)`); the answers are
`{"ok": value}` or `{"error": "..."}`, and its stderr (the package's own output) goes to a log
file, named in every error. One worker per (world module, Python process) serves every world of
that kind (`shared`); a world is a handle, an integer id, on its side. Worlds
that are garbage-collected are queued and closed before the next request (a finalizer can run
in the middle of a request, so it never talks to the pipe itself).
"""

from __future__ import annotations

import atexit
import itertools
import json
import subprocess
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envace_jax.envs.base import BAD_ARGS, UNKNOWN_TOOL, ToolResult, tool_error
from envace_jax.text.tool_calls import tool_parameter_schemas, validate_schema

LOOP = Path(__file__).with_name("worker_loop.py")


class WorkerError(RuntimeError):
    """A worker failed a request or died (its log is named)."""


class Worker:
    """One worker process: `request(op, **fields)` -> its answer, under a lock."""

    def __init__(self, name: str, python: Path, world: Path, cwd: Path, env: dict, log: Path):
        self.name, self.log_path = name, log
        self._log = open(log, "a")
        self._proc = subprocess.Popen(
            [str(python), str(LOOP), str(world)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=cwd,
            env=env,
        )
        self._lock = threading.Lock()
        self.unused: list[int] = []  # ids of worlds no longer referenced

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def request(self, op: str, **fields) -> Any:
        with self._lock:
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
            raise WorkerError(f"the {self.name} worker died (log: {self.log_path})") from cause
        answer = json.loads(reply)
        if "error" in answer:
            where = f"{self.name} worker, {req['op']}"
            raise WorkerError(f"{where}: {answer['error']} (log: {self.log_path})")
        return answer["ok"]

    def close(self) -> None:
        if self.alive:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()


_WORKERS: dict[str, Worker] = {}
_LOCK = threading.Lock()


def shared(name: str, start: Callable[[], Worker]) -> Worker:
    """This process's worker called `name`, started by `start` on first use (again if it
    died)."""
    with _LOCK:
        found = _WORKERS.get(name)
        if found is None or not found.alive:
            found = _WORKERS[name] = start()
            atexit.register(found.close)
        return found


def package_id(task: Any) -> str:
    """The id the package knows a task by (`metadata["package_id"]`)."""
    return task.metadata["package_id"]


class RemoteWorld:
    """A handle on one world of a worker: the `envs.base.Environment` protocol's reset, step and
    state; a subclass adds `response` (a raw answer -> tool response) and `success`.

    Calls are checked against the task's tools here first: an unknown name or arguments off the
    schema get the project's call errors and never reach the package; the rest go to it, in
    order. State: the task and the calls executed, which fix the world (the packages' worlds
    are deterministic)."""

    _ids = itertools.count()

    def __init__(self, worker: Worker):
        self.worker = worker
        self._id = next(self._ids)
        self._task = None
        self._executed: list[dict] = []
        self._schemas: dict[str, Any] = {}
        weakref.finalize(self, worker.unused.append, self._id)

    @property
    def task(self) -> Any:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}: reset it to a task first")
        return self._task

    def response(self, raw: Any) -> ToolResult:
        raise NotImplementedError

    def reset(self, task: Any) -> None:
        self.worker.request("reset", env=self._id, id=package_id(task))
        self._task, self._executed = task, []
        self._schemas = tool_parameter_schemas(task.tools)

    def _refusal(self, name: str, arguments: Any) -> ToolResult | None:
        if name not in self._schemas:
            return tool_error(UNKNOWN_TOOL, f"no tool named {name!r}")
        if not isinstance(arguments, Mapping):
            return tool_error(BAD_ARGS, "arguments: not an object")
        problem = validate_schema(arguments, self._schemas[name])
        return tool_error(BAD_ARGS, problem) if problem else None

    def step(self, calls: Sequence[Any]) -> list[ToolResult]:
        self.task  # noqa: B018 (raises before a reset)
        out: list[ToolResult] = []
        run: list[dict] = []  # consecutive executable calls, sent together

        def flush():
            if run:
                answers = self.worker.request("step", env=self._id, calls=run)
                out.extend(self.response(a) for a in answers)
                self._executed.extend(run)
                run.clear()

        for call in calls:
            if isinstance(call, Mapping):
                name, arguments = str(call.get("name")), call.get("arguments")
            else:
                name, arguments = call.name, call.arguments
            refusal = self._refusal(name, arguments)
            if refusal is None:
                run.append({"name": name, "arguments": dict(arguments)})
                continue
            flush()
            out.append(refusal)
        flush()
        return out

    def state(self) -> dict[str, Any]:
        task_id = None if self._task is None else self._task.task_id
        return {"task_id": task_id, "n_calls": len(self._executed), "calls": list(self._executed)}
