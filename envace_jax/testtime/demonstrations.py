"""Memory demonstrations for the warm start.

Warm start. A small policy has to learn to use a memory, and also to check it: a memory comes
from imagined results and may be wrong. `memory_demonstrations` gives, for a fraction of the
training tasks, the task's reference conversation with a structured memory in its prompt
(the targets are unchanged, so the memory is context and never a target). The memory is one
of three variants, drawn per task:

* exact (`P_EXACT`): the reference plan and its real responses, high support;
* wrong expectation (`P_WRONG_EXPECTATION`): the reference plan with one number of one expected
  response changed (a world-model error); the target states the real value;
* wrong plan (the rest): one argument of one call replaced by a look-alike value from the
  context (another id, name or amount), the plan replayed in a fresh environment for the
  responses a faithful rehearser would expect, and the rule assessor's notes on it; the target
  is still the reference, so the policy learns to verify the plan against the task.

Half of the memories also carry the notes of one more wrong-plan attempt (a rejected
alternative, as parallel rehearsal produces).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envace_jax.envs.base import error_code, parse_result_text, result_text
from envace_jax.testtime.memory import (
    Assessment,
    Attempt,
    Selection,
    assess,
    insert_memory,
    reference_plan,
    render_memory,
)
from envace_jax.text.codes import Status

BUDGETS = (1, 2, 4, 8)  # support denominators drawn for warm-start memories
P_EXACT, P_WRONG_EXPECTATION = 0.5, 0.25
P_EXTRA_NOTES = 0.5
_WORD = re.compile(r"[A-Za-z]+\d*")
_ID = re.compile(r"[A-Za-z]+\d+")


def _shape(token: str) -> str | None:
    m = re.fullmatch(r"([A-Za-z]+)(\d+)", token)
    if m:
        return m.group(1) + "#"
    if re.fullmatch(r"[A-Z][a-z]+", token):
        return "Name"
    return None


def _look_alike(rng: random.Random, value: Any, context: str) -> Any:
    """A different value of the same kind: another id / capitalised name from the context, or
    a nearby positive integer. None when the context offers none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return max(1, value + rng.choice((-1, 1)) * rng.randint(1, max(2, abs(value) // 4)))
    if isinstance(value, str) and _shape(value):
        pool = sorted({t for t in _WORD.findall(context) if t != value})
        pool = [t for t in pool if _shape(t) == _shape(value)]
        return rng.choice(pool) if pool else None
    return None


def _context_text(task: Any, responses: Sequence[str]) -> str:
    """Where look-alike values come from: user messages, responses, and the lines of other
    messages that hold an id (records tables), not prose."""
    lines = []
    for m in task.messages:
        text = str(m.get("content") or "")
        if m.get("role") == "user":
            lines.append(text)
        else:
            lines += [ln for ln in text.splitlines() if any(_shape(t) for t in _ID.findall(ln))]
    return "\n".join(lines + list(responses))


def _wrong_plan(
    rng: random.Random, task: Any, make_env: Callable[[], Any]
) -> tuple[Attempt, Assessment] | None:
    """The reference plan with one argument replaced by a look-alike, replayed in a fresh
    environment (its real responses are what a faithful rehearsal expects)."""
    calls, responses = reference_plan(task)
    context = _context_text(task, responses)
    options = [
        (i, key)
        for i, (_, args) in enumerate(calls)
        if isinstance(args, Mapping)
        for key, v in args.items()
        if _look_alike(random.Random(0), v, context) is not None
    ]
    if not options:
        return None
    i, key = rng.choice(options)
    new = [(n, dict(a) if isinstance(a, Mapping) else a) for n, a in calls]
    value = _look_alike(rng, calls[i][1][key], context)
    if value == calls[i][1][key]:  # an integer clamped back to itself
        value = calls[i][1][key] + 1
    new[i][1][key] = value
    env = make_env()
    env.reset(task)
    got = [result_text(env.step([{"name": n, "arguments": a}])[0]) for n, a in new]
    attempt = Attempt(tuple(new), tuple(got), None, Status.FINISHED)
    return attempt, assess(task, attempt, require_finish=False)


def _wrong_expectation(rng: random.Random, responses: list[str]) -> list[str] | None:
    """`responses` with one integer of one response changed."""
    options = []
    for i, text in enumerate(responses):
        value = parse_result_text(text)
        if error_code(value) is None:
            options += [(i, path) for path in _int_paths(value)]
    if not options:
        return None
    i, path = rng.choice(options)
    value = json.loads(responses[i])
    node = value
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = _look_alike(rng, node[path[-1]], "")
    out = list(responses)
    out[i] = result_text(value)
    return out


def _int_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _int_paths(v, prefix + (k,))]
    if isinstance(value, list):
        return [p for k, v in enumerate(value) for p in _int_paths(v, prefix + (k,))]
    if isinstance(value, int) and not isinstance(value, bool):
        return [prefix]
    return []


def warm_start_memory(rng: random.Random, task: Any, make_env: Callable[[], Any]) -> str:
    """A structured memory for `task` built from its reference solution: one of the variants of
    the module docstring, drawn with `rng`."""
    calls, responses = reference_plan(task)
    total = rng.choice(BUDGETS)
    draw = rng.random()
    attempt = assessment = None
    if draw >= P_EXACT + P_WRONG_EXPECTATION:
        wrong = _wrong_plan(rng, task, make_env)
        if wrong is not None:
            attempt, assessment = wrong
    elif draw >= P_EXACT:
        changed = _wrong_expectation(rng, responses)
        if changed is not None:
            attempt, assessment = (
                Attempt(tuple(calls), tuple(changed), None, Status.FINISHED),
                Assessment(),
            )
    if attempt is None:
        attempt, assessment = (
            Attempt(tuple(calls), tuple(responses), None, Status.FINISHED),
            Assessment(),
        )
        support = rng.randint(math.ceil(total / 2), total)
    else:
        support = rng.randint(1, total)
    extra = []
    if rng.random() < P_EXTRA_NOTES:
        other = _wrong_plan(rng, task, make_env)
        if other is not None and not other[1].ok:
            extra.append(other[1].note())
    return render_memory([attempt], [assessment], Selection(0, support, total), extra)


def memory_demonstrations(
    tasks: Sequence[Any],
    tokenizer,
    make_env: Callable[[], Any],
    *,
    fraction: float,
    seed: int,
) -> dict[int, Any]:
    """Memory-conditioned warm-start sequences for a `fraction` of `tasks` (drawn with `seed`):
    task index -> `EncodedConversation` of the reference conversation whose prompt carries a
    `warm_start_memory` (ACT and REHEARSE targets as in the plain demonstrations)."""
    from envace_jax.text.trajectory import encode_conversation

    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"memory fraction must be in [0, 1], got {fraction}")
    out = {}
    pick = random.Random(seed)
    for i, task in enumerate(tasks):
        if pick.random() >= fraction:
            continue
        memory = warm_start_memory(random.Random(f"{seed}/{i}"), task, make_env)
        n = len(task.messages)
        messages = insert_memory(task.reference_messages[:n], memory)
        messages += [dict(m) for m in task.reference_messages[n:]]
        out[i] = encode_conversation(tokenizer, messages, task.template_tools, rehearse=True)
    return out
