"""Demo task generation: task families by number of calls, ground truth, rule checklists.

A task is one world (from its own seed) plus one templated instruction from a family:

| calls | families |
|---|---|
| 1 | cancel, refund, transfer |
| 2 | cancel_by_item (list_orders, cancel), pay_by_member (find_customer, transfer),
|   | resolve (get_order, cancel or refund), sweep (get_balance, transfer) |
| 3 | cancel_by_member, refund_by_member (find_customer, list_orders, act),
|   | pay_member_to_member (find_customer x2, transfer) |
| 4 | pay_and_cancel (find_customer, transfer, list_orders, cancel),
|   | settle_two (find_customer, list_orders, cancel, refund) |

The number of calls is drawn uniformly from 1..4, then the family uniformly within it. Every
family changes the world (success is checked on the final state) and its final reply states a
value that only an observation gives (a new balance, or the amount moved). Member-based
families name the customer by member number, which only `find_customer` maps to the customer
and account ids.

Worlds are small (3 customers, 1-2 orders each) and the system turn carries their records
table, so every lookup result is determined by the context and every state change by a rule
the tool descriptions state: rehearsing the world is learnable. The table also means an actor
could skip lookups; the checklist's consistency items (an id passed on must come from an
earlier result) are what reward looking things up, while success and the ground-truth items
reward the outcome. Each task offers the tools its solution uses plus `EXTRA_TOOLS`
distractors (all seven tool schemas would cost ~600 prompt tokens with the demo tokenizer).

World seeds: task ``i`` of ``generate_tasks(seed, n, split)`` uses world seed
``(seed * 1_000_003 + i) * 3 + SPLITS.index(split)``, so different splits never share a world
seed (the seed's residue mod 3 is the split).
"""

from __future__ import annotations

import json
import random

from envace_jax.data.tasks import Task
from envace_jax.envs.base import error_code, observed_values
from envace_jax.envs.demo.families import FAMILIES
from envace_jax.envs.demo.oracle import conversation
from envace_jax.envs.demo.tools import STATE_CHANGING, TOOL_SCHEMAS, execute
from envace_jax.envs.demo.world import (
    World,
    copy_world,
    generate_world,
    render_records,
)

SPLITS = ("train", "validation", "test")
MAX_TASKS_PER_SEED = 1_000_003
EXTRA_TOOLS = 1  # distractor tools offered next to the ones a task's solution uses
SYSTEM_PROMPT = (
    "Shop assistant: use the tools, take ids from tool results, reply with the result.\n"
    "Errors: unknown id not_found, wrong status bad_status, over balance no_funds.\n"
)
# Raw checklist weights of the progress items (normalised with the outcome items to sum to 1
# per turn). Each of the two outcome items (`effects`, `reply_states`) weighs one more than all
# progress items together, so a trajectory that passes both (a success) scores above every
# trajectory that fails one (`_checklist`).
W_ACT_CALL, W_LOOKUP_CALL, W_CONSISTENT, W_REPLY_CONSISTENT = 2.0, 1.0, 1.0, 1.0


def world_seed(seed: int, index: int, split: str) -> int:
    """The world seed of task `index` in `split` (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if seed < 0 or not 0 <= index < MAX_TASKS_PER_SEED:
        raise ValueError(f"need seed >= 0 and 0 <= index < {MAX_TASKS_PER_SEED}")
    return (seed * MAX_TASKS_PER_SEED + index) * len(SPLITS) + SPLITS.index(split)


def generate_tasks(
    seed: int,
    n: int,
    split: str = "train",
    extra_tools: int = EXTRA_TOOLS,
    tools_in_system: bool = True,
) -> list[Task]:
    """`n` demo tasks, deterministic in (`seed`, `split`, `extra_tools`); see the module
    docstring. Each task offers the tools its solution uses plus `extra_tools` others."""
    if n < 0 or n > MAX_TASKS_PER_SEED:
        raise ValueError(f"n must be in [0, {MAX_TASKS_PER_SEED}], got {n}")
    return [make_task(seed, i, split, extra_tools, tools_in_system) for i in range(n)]


def tool_lines(names) -> str:
    """One line per tool, `name(arg, ...): description`: the compact tool list of the system
    turn (the chat template's JSON-schema tools block costs ~100 demo-tokenizer tokens per tool,
    which would triple the length of the prompts a CPU-sized policy trains on)."""
    lines = []
    for name in names:
        fn = TOOL_SCHEMAS[name]["function"]
        args = ", ".join(fn["parameters"]["properties"])
        lines.append(f"{name}({args}): {fn['description']}")
    return "tools:\n" + "\n".join(lines) + "\n"


def _draw_plan(rng: random.Random, ws: int):
    """(n_calls, family, world, plan): a family, then worlds until one fits it."""
    n_calls = rng.randint(1, 4)
    family = rng.choice(sorted(FAMILIES[n_calls]))
    for _ in range(1000):
        world = generate_world(rng, n_customers=3)
        plan = FAMILIES[n_calls][family](rng, world)
        if plan is not None:
            return n_calls, family, world, plan
    # pragma: no cover - every family fits a few percent of worlds at least
    raise RuntimeError(f"no world fits family {family!r} (world seed {ws})")


def _run_solution(state: World, solution: list[dict], ws: int) -> list[dict]:
    """The solution's observations on `state` (changed in place); a failed call, or an argument
    said to come from a result that does not hold it, is a bug in the family."""
    observations = [execute(state, c["name"], c["arguments"]) for c in solution]
    for c, obs in zip(solution, observations, strict=True):
        if error_code(obs) is not None:
            raise AssertionError(f"world seed {ws}: solution call {c} failed: {obs}")
        for arg, j in c["sources"].items():
            if c["arguments"][arg] not in observed_values(observations[j]):
                raise AssertionError(f"world seed {ws}: {c} {arg} is not in result {j}")
    return observations


def make_task(
    seed: int,
    index: int,
    split: str,
    extra_tools: int = EXTRA_TOOLS,
    tools_in_system: bool = True,
) -> Task:
    """Task `index` of (`seed`, `split`): draw a family, then worlds until one fits it, then
    run the solution on a copy of the world to get observations, final state and reply.

    tools_in_system: describe the offered tools in the system turn (`tool_lines`) and mark the
    task `render_tools: false`, so prompts skip the chat template's JSON-schema tools block;
    the schemas stay in `tools` for call validation."""
    if extra_tools < 0:
        raise ValueError(f"extra_tools must be >= 0, got {extra_tools}")
    ws = world_seed(seed, index, split)
    rng = random.Random(ws)
    n_calls, family, world, plan = _draw_plan(rng, ws)
    instruction, solution, reply_template, (src_call, src_key) = plan
    state = copy_world(world)
    observations = _run_solution(state, solution, ws)
    value = observations[src_call][src_key]
    final_reply = reply_template.format(v=value)

    # Offered tools: the solution's plus distractors, in one fixed order (drawn last, so the
    # world and the solution do not depend on `extra_tools`).
    used = {c["name"] for c in solution}
    others = [name for name in TOOL_SCHEMAS if name not in used]
    offered = used | set(rng.sample(others, min(extra_tools, len(others))))

    task_id = f"demo-{split}-{seed}-{index}"
    offered_names = [name for name in TOOL_SCHEMAS if name in offered]
    tool_text = tool_lines(offered_names) if tools_in_system else ""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT + tool_text + render_records(world)},
        {"role": "user", "content": instruction},
    ]
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in solution]
    ground_truth = {
        "family": family,
        "n_calls": n_calls,
        "world_seed": ws,
        "initial_state": world,
        "solution": calls,
        "observations": observations,
        "final_state": state,
        "reply_facts": [str(value)],
        "final_reply": final_reply,
    }
    reference = conversation(messages, calls, observations, final_reply)
    items = _checklist(solution, calls, (calls[src_call]["name"], src_key), str(value), reference)
    # Built through the record's own validation, so a generated task is always a valid record.
    return Task.from_dict(
        {
            "task_id": task_id,
            "messages": messages,
            "tools": [TOOL_SCHEMAS[name] for name in offered_names],
            "reference_messages": reference,
            "checklist": [items],
            "ground_truth": ground_truth,
            "metadata": {
                "data_source": "demo",
                "family": family,
                "n_calls": n_calls,
                "render_tools": not tools_in_system,
            },
        }
    )


def _checklist(solution, calls, reply_source, fact, reference) -> list[dict]:
    """Rule items: progress (each solution call, and the trajectory's consistency with its own
    observations: ids and values taken from results), then the outcome (exactly the solution's
    changes, and the final reply's value), weighted so that the outcome ranks first."""
    raw: list[tuple[float, str, str, str, dict]] = []
    final_reply = reference[-1]["content"]
    for sol, call in zip(solution, calls, strict=True):
        name, args = call["name"], call["arguments"]
        text = f"{name}({json.dumps(args)})"
        weight = W_ACT_CALL if name in STATE_CHANGING else W_LOOKUP_CALL
        raw.append(
            (
                weight,
                f"Did the assistant call {text}?",
                "assistant.tool_calls",
                f"A tool call {text} with exactly these arguments is made.",
                {"kind": "call", "tool": name, "args": args},
            )
        )
        for arg, j in sol["sources"].items():
            src = calls[j]["name"]
            raw.append(
                (
                    W_CONSISTENT,
                    f"Is the {arg} given to {name} a value an earlier {src} result returned?",
                    "assistant.tool_calls",
                    f"{name} is called with a {arg} that appears in an earlier {src} result.",
                    {"kind": "arg_from", "tool": name, "arg": arg, "source": src},
                )
            )
    src, key = reply_source
    raw.append(
        (
            W_REPLY_CONSISTENT,
            f"Does the final reply state the {key} that the last {src} result returned?",
            "assistant.content.user_visible_reply",
            f"The final reply states the {key} of the last {src} result.",
            {"kind": "reply_from", "source": src, "key": key},
        )
    )
    outcome = sum(r[0] for r in raw) + 1.0
    changes = [c for c in calls if c["name"] in STATE_CHANGING]
    text = ", ".join(f"{c['name']}({json.dumps(c['arguments'])})" for c in changes)
    raw.append(
        (
            outcome,
            f"Are the changes made exactly {text}?",
            "assistant.tool_calls",
            f"By the final reply, the state-changing calls that succeeded are exactly {text}.",
            {"kind": "effects", "tools": sorted(STATE_CHANGING), "calls": changes},
        )
    )
    raw.append(
        (
            outcome,
            f"Does the final reply state {fact}?",
            "assistant.content.user_visible_reply",
            f"The final reply states the value {fact}.",
            {"kind": "reply_states", "values": [fact]},
        )
    )
    total = sum(r[0] for r in raw)
    return [
        {
            "question": q,
            "focus_on": focus,
            "pass_condition": cond,
            "failure_examples": [],
            "evidence": [_evidence(rule, final_reply)],
            "weight": w / total,
            "required_for_next_turn": False,
            "rule": rule,
        }
        for w, q, focus, cond, rule in raw
    ]


def _evidence(rule: dict, final_reply: str) -> str:
    """The reference snippet an LLM judge sees next to an item."""
    if rule["kind"] == "call":
        return json.dumps({"name": rule["tool"], "arguments": rule["args"]})
    if rule["kind"] == "arg_from":
        return f"{rule['tool']}.{rule['arg']} comes from a {rule['source']} result"
    if rule["kind"] == "effects":
        return json.dumps(rule["calls"])
    return final_reply
