"""Memory demonstrations for the warm start, and memory-carrying tasks for RL rollouts.

A small policy has to learn to use a memory, and also to check it: a memory comes from
imagined results and may be wrong. `memory_demonstrations` gives, for a share of the training
tasks, the task's reference conversation with a structured memory in its prompt's slot (the
targets are unchanged, so the memory is context and never a target). The memory is one of
three variants, drawn per task:

* exact (`P_EXACT`): the reference plan, high support, and for most of them (`P_AVOID`) some of
  the task's refused alternatives as avoid lines: the reference plan with one call's tool
  swapped for another offered tool that takes the same arguments, replayed in a fresh
  environment, where the world refused it (`refused_alternatives`);
* wrong plan (`P_WRONG`): such a refused alternative as the plan (the rehearsal expected it to
  work), or, where the task has none, one argument of one call replaced by a look-alike value
  from the context (another id, name or amount) with the refusals its replay met; the target is
  still the reference, so the policy learns to check a plan against the task;
* empty (the rest): ``plan: none``, what rehearsals that produced no usable attempt leave.

A share of the rows can instead show a swapped demonstration (`swapped_demonstration`): its
last call names another id that a lookup listed, and so does the plan. In every other row the
plan's ids are the lookup's, so only these teach that the plan decides which id to use.

`exact_memory` is the oracle memory of the test-time protocol's gate (the reference plan and
every refused alternative). `MemoryTasks` gives RL rollouts the same memories, so RL does not
unlearn reading them. Every memory is built from the task's reference solution before training,
as the demonstrations are; no rollout touches an environment for it.
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
    MAX_NOTES,
    Assessment,
    Attempt,
    Selection,
    conversation_plan,
    insert_memory,
    reference_plan,
    refusals,
    render_memory,
    with_memory,
)
from envace_jax.text.codes import Status

BUDGETS = (1, 2, 4, 8)  # support denominators drawn for warm-start memories
P_EXACT, P_WRONG = 0.6, 0.1
P_AVOID = 0.75  # exact memories that also carry avoid lines (when the task has any)
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


def _replay(task: Any, calls: Sequence[tuple[str, Any]], make_env) -> tuple[str, ...]:
    """The real responses of `calls`, in order, in a fresh environment reset to `task`."""
    env = make_env()
    env.reset(task)
    return tuple(result_text(env.step([{"name": n, "arguments": a}])[0]) for n, a in calls)


def _parameters(tool: Mapping) -> frozenset:
    fn = tool.get("function", tool)
    return frozenset((fn.get("parameters") or {}).get("properties") or {})


def refused_alternatives(task: Any, make_env: Callable[[], Any]) -> list[Attempt]:
    """The reference plan with one call's tool swapped for another offered tool that takes the
    same arguments, cut after that call, replayed: each one whose last call the world refused."""
    calls, _ = reference_plan(task)
    tools = {t.get("function", t).get("name"): _parameters(t) for t in task.tools}
    out = []
    for i, (name, args) in enumerate(calls):
        if not isinstance(args, Mapping):
            continue
        for other, params in tools.items():
            if other == name or params != frozenset(args):
                continue
            plan = [*calls[:i], (other, dict(args))]
            got = _replay(task, plan, make_env)
            if error_code(parse_result_text(got[-1])) is not None:
                out.append(Attempt(tuple(plan), got, None, Status.FINISHED))
    return out


def _look_alike_plan(rng: random.Random, task: Any, make_env) -> Attempt | None:
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
    return Attempt(tuple(new), _replay(task, new, make_env), None, Status.FINISHED)


def _avoid_lines(attempts: Sequence[Attempt]) -> list[str]:
    return [line for a in attempts for line in refusals(a)]


def exact_memory(task: Any, make_env: Callable[[], Any], budget: int = 4) -> str:
    """The oracle memory: the reference plan (all of `budget` rehearsals) and every refused
    alternative of the task as an avoid line."""
    calls, responses = reference_plan(task)
    attempt = Attempt(tuple(calls), tuple(responses), None, Status.FINISHED)
    avoid = _avoid_lines(refused_alternatives(task, make_env))
    return render_memory([attempt], [Assessment()], Selection(0, budget, budget), avoid)


def warm_start_memory(
    rng: random.Random,
    task: Any,
    make_env: Callable[[], Any],
    shown: tuple[list, list] | None = None,
) -> str:
    """A structured memory for `task`, one of the variants of the module docstring drawn with
    `rng`, for a demonstration that makes the calls `shown` (calls, responses; default: the
    reference solution's). A wrong plan is drawn only where the demonstration is the reference
    (its target is then the right action); an avoid line never names a call of the plan."""
    reference = reference_plan(task)
    calls, responses = shown or reference
    total = rng.choice(BUDGETS)
    draw = rng.random()
    alternatives = refused_alternatives(task, make_env)
    if draw >= P_EXACT + P_WRONG:
        return render_memory([], [], Selection(None, 0, total))
    if draw >= P_EXACT and _signature(calls) == _signature(reference[0]):
        if alternatives:
            chosen = rng.choice(alternatives)
            # the rehearsal expected the refused call to work: its response is not shown
            wrong = Attempt(chosen.calls, (*chosen.responses[:-1], None), None, Status.FINISHED)
            avoid: list[str] = []
        else:
            wrong = _look_alike_plan(rng, task, make_env)
            avoid = [] if wrong is None else refusals(wrong)
        if wrong is not None:
            selection = Selection(0, rng.randint(1, total), total)
            return render_memory([wrong], [Assessment()], selection, avoid)
    return _followed_memory(rng, calls, alternatives, total)


def _followed_memory(rng: random.Random, calls, alternatives: Sequence[Attempt], total: int) -> str:
    """A memory whose plan is `calls` (the demonstration's, so that its target follows the
    plan) with high support, and for most of them refused `alternatives` as avoid lines."""
    attempt = Attempt(tuple(calls), (None,) * len(calls), None, Status.FINISHED)
    options = [a for a in alternatives if _signature(a.calls[-1:])[0] not in _signature(calls)]
    avoid = []
    if options and rng.random() < P_AVOID:
        picked = rng.sample(options, rng.randint(1, min(len(options), MAX_NOTES)))
        avoid = _avoid_lines(picked)
    selection = Selection(0, rng.randint(math.ceil(total / 2), total), total)
    return render_memory([attempt], [Assessment()], selection, avoid)


def swapped_demonstration(
    rng: random.Random, task: Any, messages: Sequence[Mapping], make_env: Callable[[], Any]
) -> tuple[list[dict], str] | None:
    """The demonstration `messages` cut after its last call, that call's id argument replaced
    by another id of the same kind that an earlier response listed (another of the customer's
    orders), and a memory whose plan names the swapped call: a row whose target takes its id
    from the plan alone, since the lookup in its context points elsewhere. None when no
    earlier response lists another such id."""
    calls, responses = conversation_plan(messages)
    if not calls or not isinstance(calls[-1][1], Mapping):
        return None
    name, args = calls[-1]
    listed = sorted({t for r in responses[: len(calls) - 1] for t in _ID.findall(r)})
    options = [
        (key, other)
        for key, value in sorted(args.items())
        if value in listed  # an id the lookups gave, not one the user named
        for other in listed
        if other != value and _shape(other) == _shape(value)
    ]
    if not options:
        return None
    key, other = rng.choice(options)
    call = {"type": "function", "function": {"name": name, "arguments": {**args, key: other}}}
    last = max(i for i, m in enumerate(messages) if m.get("tool_calls"))
    cut = [*(dict(m) for m in messages[:last]), {**messages[last], "tool_calls": [call]}]
    plan = [*calls[:-1], (name, call["function"]["arguments"])]
    memory = _followed_memory(rng, plan, refused_alternatives(task, make_env), rng.choice(BUDGETS))
    return cut, memory


def _signature(calls) -> list[tuple[str, str]]:
    return [(n, json.dumps(a, sort_keys=True)) for n, a in calls]


class MemoryTasks(Sequence):
    """`tasks`, where a `fraction` of them (drawn per index with `seed`) carry a
    `warm_start_memory` in their prompt; each memory is built when its task is first read."""

    def __init__(
        self, tasks: Sequence[Any], make_env: Callable[[], Any], *, fraction: float, seed: int
    ):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"memory fraction must be in [0, 1], got {fraction}")
        self.tasks, self.make_env, self.fraction, self.seed = tasks, make_env, fraction, seed
        self._built: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.tasks)

    def carries_memory(self, i: int) -> bool:
        return random.Random(f"{self.seed}/{i}/memory").random() < self.fraction

    def __getitem__(self, i: int) -> Any:
        i = range(len(self.tasks))[i]  # a negative index names the same task as its positive
        if not self.carries_memory(i):
            return self.tasks[i]
        if i not in self._built:
            rng = random.Random(f"{self.seed}/{i}")
            memory = warm_start_memory(rng, self.tasks[i], self.make_env)
            self._built[i] = with_memory(self.tasks[i], memory)
        return self._built[i]


def memory_demonstrations(
    tasks: Sequence[Any],
    tokenizer,
    make_env: Callable[[], Any],
    *,
    fraction: float,
    seed: int,
    shown: Sequence[Sequence[Mapping]] | None = None,
    swaps: float = 0.0,
) -> dict[int, Any]:
    """Memory-conditioned warm-start sequences for a `fraction` of `tasks` (drawn as in
    `MemoryTasks`): task index -> `EncodedConversation` of the task's demonstration (`shown[i]`,
    the conversation its plain demonstration shows; default: the reference conversation) with
    a `warm_start_memory` of that demonstration's calls in its prompt (ACT and REHEARSE targets
    as in the plain demonstrations); for a share `swaps` of them, the `swapped_demonstration`
    where the task has one."""
    from envace_jax.text.trajectory import encode_conversation

    chosen = MemoryTasks(tasks, make_env, fraction=fraction, seed=seed)
    out = {}
    for i, task in enumerate(tasks):
        if not chosen.carries_memory(i):
            continue
        messages = list(shown[i]) if shown is not None else list(task.reference_messages)
        rng = random.Random(f"{seed}/{i}")
        swap = random.Random(f"{seed}/{i}/swap").random() < swaps
        row = swap and swapped_demonstration(rng, task, messages, make_env)
        if row:
            messages, memory = row
        else:
            plan = conversation_plan(messages)
            memory = warm_start_memory(rng, task, make_env, plan)
        n = len(task.messages)
        messages = insert_memory(messages[:n], memory) + [dict(m) for m in messages[n:]]
        out[i] = encode_conversation(tokenizer, messages, task.template_tools, rehearse=True)
    return out
