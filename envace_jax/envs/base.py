"""The Environment protocol: what an executable tool-use domain offers to rollouts and judges.

An environment is reset to a task, then executes batches of tool calls. Every call gets exactly
one JSON-serialisable response, in call order. A call the environment cannot execute (unknown
tool, missing or mistyped arguments, unknown id, wrong state) gets a *tool error response*
instead of an exception, because calls come from a model and model outputs never crash a
rollout:

    {"error": {"code": "<code>", "message": "<short text>"}}

Error codes split in two kinds:

* call errors (`CALL_ERROR_CODES`): the call itself is invalid (no such tool, arguments that do
  not match the schema), an action could not be parsed, or a rehearsed response could not be
  parsed. Following the reference's checklist semantics, a call error zeroes the current turn
  and ends the episode.
* domain errors (any other code, e.g. ``not_found``): the call was well formed but the world
  refused it. These are ordinary observations an agent can recover from.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

# A response to one tool call: a JSON-serialisable dict (a result, or a tool error response).
ToolResult = dict[str, Any]

UNKNOWN_TOOL = "unknown_tool"  # the name is not one of the task's tools
BAD_ARGS = "bad_args"  # arguments missing, unexpected, of the wrong type, or not an object
BAD_CALL = "bad_call"  # the action text could not be parsed into tool calls
BAD_OBSERVATION = "bad_observation"  # a rehearsed response is not a JSON object
CALL_ERROR_CODES = frozenset({UNKNOWN_TOOL, BAD_ARGS, BAD_CALL, BAD_OBSERVATION})
# Ways a domain can corrupt a copy of its world for the sensitivity control (mode
# 'corrupted_world'): 'redrawn' redraws the hidden state a task depends on from its
# distribution over tasks; 'optimist' answers every change it would refuse as a success;
# 'guesser' does both, as a simulator that guesses what it cannot know and agrees to anything;
# 'blind' redraws the state of every task, the state the context shows included; 'liar' maps
# every task's state to a fixed wrong one.
CORRUPTIONS = ("redrawn", "optimist", "guesser", "blind", "liar")


def tool_error(code: str, message: str) -> ToolResult:
    """A tool error response in the project's one format."""
    return {"error": {"code": str(code), "message": str(message)}}


def error_code(result: Any) -> str | None:
    """The error code of a tool error response, or None when `result` is not one."""
    if isinstance(result, Mapping):
        err = result.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("code"), str):
            return err["code"]
    return None


def is_call_error(result: Any) -> bool:
    """True for a response that invalidates the call (see the module docstring)."""
    return error_code(result) in CALL_ERROR_CODES


def result_text(result: ToolResult) -> str:
    """The text of a tool message carrying `result` (compact JSON, keys in insertion order)."""
    return json.dumps(result, ensure_ascii=False)


def parse_result_text(text: str) -> ToolResult:
    """Parse a tool message back into a response; text that is not a JSON object (an
    unparseable rehearsal) becomes a ``bad_observation`` call error."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        return tool_error(BAD_OBSERVATION, f"not JSON: {exc}")
    if not isinstance(value, dict):
        return tool_error(BAD_OBSERVATION, f"not a JSON object: {type(value).__name__}")
    return value


def canonical(value: Any) -> str:
    """Comparison key of a value: JSON text with integral floats as integers (JSON schema counts
    ``55.0`` as the integer 55, and so do the environments); ``"55"`` and ``true`` stay
    distinct."""
    return json.dumps(_ints(value), sort_keys=True, ensure_ascii=False, default=repr)


def _ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_ints(v) for v in value]
    return value


def effects_key(calls: Sequence[tuple[str, Any]]) -> list[str]:
    """The multiset of state changes made by (name, arguments) calls that succeeded, as sorted
    comparison keys: two call sequences whose keys are equal leave a world in the same state
    when, as in the demo domain, the changes commute."""
    return sorted(canonical({"name": name, "arguments": args}) for name, args in calls)


def call_items(calls: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Checklist items (rule judge, kind ``call``) asking for each of `calls` ({name,
    arguments}) with exactly its arguments, weighted equally (summing to 1 exactly)."""
    weights = [1.0 / len(calls)] * (len(calls) - 1)
    weights.append(1.0 - sum(weights))
    items = []
    for call, weight in zip(calls, weights, strict=True):
        text = f"{call['name']}({json.dumps(call['arguments'])})"
        items.append(
            {
                "question": f"Did the assistant call {text}?",
                "focus_on": "assistant.tool_calls",
                "pass_condition": f"A tool call {text} with exactly these arguments is made.",
                "weight": weight,
                "rule": {"kind": "call", "tool": call["name"], "args": call["arguments"]},
            }
        )
    return items


class CallLike(Protocol):
    """What `step` reads from a tool call (`envace_jax.text` ToolCall has this shape)."""

    name: str
    arguments: Any


@runtime_checkable
class Environment(Protocol):
    """An executable domain. Deterministic given the task and the sequence of calls."""

    def reset(self, task: Any) -> None:
        """Put the world in the task's initial state (calling it twice gives equal `state()`)."""

    def step(self, calls: Sequence[CallLike]) -> list[ToolResult]:
        """Execute `calls` in order; one response (or tool error response) per call. Never
        raises on model-produced calls."""

    def state(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot of everything the environment holds, including how
        many calls it has executed (so a test can prove that rehearsal never touched it)."""

    def success(self, final_reply: str, messages: Sequence[Mapping[str, Any]] = ()) -> bool:
        """Whether the final state and the final reply meet the task's ground truth. `messages`
        is the whole episode as chat messages, for a world whose check reads the calls turn by
        turn (`bfcl_multi_turn`); worlds that check only the final state ignore it."""


def observed_values(result: Any) -> list[Any]:
    """Every string and integer leaf of a response (what a later call may take from it).
    Booleans and floats are left out: ids and amounts in tool domains are strings and ints."""
    out: list[Any] = []
    stack = [result]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
            out.append(v)
    return out


class CallCounter:
    """An environment factory that counts the tool calls its environments execute: wraps a
    domain's `make_env` wherever calls must be accounted for (RL in world rehearsal makes
    none)."""

    def __init__(self, make_env):
        self.make_env = make_env
        self.calls = 0

    def __call__(self):
        env = self.make_env()
        step = env.step

        def counted(calls):
            self.calls += len(calls)
            return step(calls)

        env.step = counted
        return env


@dataclasses.dataclass(frozen=True)
class Domain:
    """What the jobs need of a task domain.

    generate_tasks(seed, n, split) -> tasks: deterministic in (seed, split).
    make_env() -> a fresh executable environment (`envs.base.Environment`); a domain without
      one (`has_env` False) gives a factory that raises.
    demonstrations(tasks, tokenizer, failure_fraction, seed, unfinished_fraction=,
      default_fraction=) -> the warm start's encoded demonstrations, one per task
      (`text.trajectory.EncodedConversation`).
    response_tools(tasks) -> the tool of each response in each task's demonstration.
    corrupted_envs(kind, rate, seed) -> an environment factory over corrupted copies of the
      world (`envs.base.CORRUPTIONS`), for the sensitivity control; None if the domain has none.
    demonstration_messages(tasks, failure_fraction, seed, unfinished_fraction, default_fraction)
      -> the conversation each of `demonstrations` encodes (memory demonstrations put a memory
      of it in its prompt); None if the domain has none.
    """

    name: str
    generate_tasks: Callable[[int, int, str], list[Any]]
    make_env: Callable[[], Environment]
    demonstrations: Callable[..., list[Any]]
    response_tools: Callable[[Sequence[Any]], list[list[str]]]
    corrupted_envs: Callable[[str, float, int], Callable[[], Environment]] | None = None
    has_env: bool = True
    demonstration_messages: Callable[..., list[list[dict]]] | None = None

    def held_out_tasks(self, config) -> list[Any]:
        """The tasks the train job evaluates on: `data.eval_tasks` of `data.eval_split`."""
        return self.generate_tasks(config.seed, config.data.eval_tasks, config.data.eval_split)
