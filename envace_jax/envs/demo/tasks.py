"""Demo task generation: task families, strata, ground truth, rule checklists.

A task is one world (from its own seed) plus one templated instruction from a family
(`envs.demo.families`): the family is drawn uniformly, then the branch, then the stratum.

| family | lookups | branches (the status the last lookup shows) |
|---|---|---|
| close | get_order | open: cancel_order; shipped: refund; cancelled or refunded: reply |
| close_item | list_orders | the same, for the customer's order of an item |
| close_member | find_customer, list_orders | the same, for a member's order of an item |
| sweep | get_balance | active: transfer all of it; frozen: reply |
| sweep_member | find_customer, get_balance | the same, for a member's account |

**Strata.** In a *visible* task the system turn's records table shows every status, so the
branch can be read (and a tool response rehearsed) from the context. In a *hidden* task the
table leaves the statuses out (`render_records(hidden=True)`): only the lookup's response shows
the branch, so a rehearser that has not seen it can only guess. `metadata['stratum']` records
which, and `HIDDEN_SHARE` of the tasks are hidden.

Every call of the right branch succeeds, the wrong branch's change is refused, and a refusal
fails the task, as does the wrong reply. The final reply states a value only an observation
gives (a new balance, the amount moved, or the status that stopped the change). Each task
offers the union of its family's branch tools plus `EXTRA_TOOLS` distractors, so the offered
tools do not give the branch away.

World seeds: task ``i`` of ``generate_tasks(seed, n, split)`` uses world seed
``(seed * 1_000_003 + i) * 3 + SPLITS.index(split)``, so different splits never share a world
seed (the seed's residue mod 3 is the split).
"""

from __future__ import annotations

import json
import random

from envace_jax.data.tasks import Task
from envace_jax.envs.base import error_code, observed_values
from envace_jax.envs.demo.families import FAMILIES, Plan
from envace_jax.envs.demo.oracle import conversation
from envace_jax.envs.demo.tools import STATE_CHANGING, TOOL_SCHEMAS, execute
from envace_jax.envs.demo.world import (
    World,
    copy_world,
    generate_world,
    render_records,
)

SPLITS = ("train", "validation", "test")
STRATA = ("hidden", "visible")
HIDDEN_SHARE = 0.5  # share of tasks whose records table leaves the statuses out
MAX_TASKS_PER_SEED = 1_000_003
EXTRA_TOOLS = 0  # distractor tools offered next to the family's branch tools (the union of
# the branches already holds tools a task does not use; each more costs ~35 prompt tokens)
# The tools each family may need on some branch (offered whatever the task's branch is).
FAMILY_TOOLS = {
    "close": ("get_order", "cancel_order", "refund"),
    "close_item": ("list_orders", "cancel_order", "refund"),
    "close_member": ("find_customer", "list_orders", "cancel_order", "refund"),
    "sweep": ("get_balance", "transfer"),
    "sweep_member": ("find_customer", "get_balance", "transfer"),
}
SYSTEM_PROMPT = (
    "Shop assistant: use the tools, take ids from tool results, reply with the result.\n"
    "Look the status up. Close: cancel if open, refund if shipped, else it is already closed. "
    "A frozen account cannot send.\n"
    "Errors: unknown id not_found, wrong status bad_status, frozen account frozen.\n"
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


def _draw_plan(rng: random.Random, ws: int) -> tuple[str, World, Plan]:
    """(family, world, plan): a family, then worlds until one fits it (the family sets the
    status its branch needs; the world is the task's initial state)."""
    family = rng.choice(sorted(FAMILIES))
    for _ in range(1000):
        world = generate_world(rng, n_customers=3)
        plan = FAMILIES[family](rng, world)
        if plan is not None:
            return family, world, plan
    # pragma: no cover - every family fits most worlds
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


def _call_of(c: dict) -> dict:
    return {"name": c["name"], "arguments": c["arguments"]}


def _final_reply(plan: Plan, observations: list[dict]):
    """(final reply, the facts it states, reply source): the source is (tool, key) of the
    observation the stated value comes from, None when it is the branch's status."""
    if plan.reply_source is None:  # the status inside a listing
        value, reply_source = plan.branch, None
    else:
        i, key = plan.reply_source
        value, reply_source = observations[i][key], (plan.solution[i]["name"], key)
    return plan.reply.format(v=value), [str(value), *plan.extra_facts], reply_source


def _offered_tools(rng: random.Random, family: str, extra_tools: int) -> list[str]:
    """The names of the tools a task offers, in `TOOL_SCHEMAS` order: every branch's of its
    family plus `extra_tools` distractors. Drawn last from the task's rng, so the world and
    the solution do not depend on `extra_tools`."""
    used = set(FAMILY_TOOLS[family])
    others = [name for name in TOOL_SCHEMAS if name not in used]
    offered = used | set(rng.sample(others, min(extra_tools, len(others))))
    return [name for name in TOOL_SCHEMAS if name in offered]


def make_task(
    seed: int,
    index: int,
    split: str,
    extra_tools: int = EXTRA_TOOLS,
    tools_in_system: bool = True,
) -> Task:
    """Task `index` of (`seed`, `split`): draw a family, then worlds until one fits it, then the
    stratum; run the solution on a copy of the world to get observations, final state and
    reply.

    tools_in_system: describe the offered tools in the system turn (`tool_lines`) and mark the
    task `render_tools: false`, so prompts skip the chat template's JSON-schema tools block;
    the schemas stay in `tools` for call validation."""
    if extra_tools < 0:
        raise ValueError(f"extra_tools must be >= 0, got {extra_tools}")
    ws = world_seed(seed, index, split)
    rng = random.Random(ws)
    family, world, plan = _draw_plan(rng, ws)
    stratum = "hidden" if rng.random() < HIDDEN_SHARE else "visible"
    solution = plan.solution
    state = copy_world(world)
    observations = _run_solution(state, solution, ws)
    final_reply, facts, reply_source = _final_reply(plan, observations)
    offered_names = _offered_tools(rng, family, extra_tools)

    task_id = f"demo-{split}-{seed}-{index}"
    tool_text = tool_lines(offered_names) if tools_in_system else ""
    records = render_records(world, hidden=stratum == "hidden")
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT + tool_text + records},
        {"role": "user", "content": plan.instruction},
    ]
    calls = [_call_of(c) for c in solution]
    ground_truth = {
        "family": family,
        "stratum": stratum,
        "branch": plan.branch,
        "n_calls": len(calls),
        "world_seed": ws,
        "initial_state": world,
        "solution": calls,
        "observations": observations,
        "final_state": state,
        "reply_facts": facts,
        "final_reply": final_reply,
        "default_call": _call_of(plan.default),
        "refused_reply": plan.refused_reply,
    }
    reference = conversation(messages, calls, observations, final_reply)
    items = _checklist(solution, calls, reply_source, facts, reference)
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
                "stratum": stratum,
                "branch": plan.branch,
                "n_calls": len(calls),
                "render_tools": not tools_in_system,
            },
        }
    )


# A raw checklist item: (weight, question, focus_on, pass_condition, rule).
_RawItem = tuple[float, str, str, str, dict]


def _checklist(solution, calls, reply_source, facts, reference) -> list[dict]:
    """Rule items: progress (each solution call, and the trajectory's consistency with its own
    observations: ids and values taken from results), then the outcome (exactly the solution's
    changes with none refused, and the final reply's facts), weighted so that the outcome ranks
    first."""
    raw = _progress_items(solution, calls, reply_source)
    raw += _outcome_items(calls, facts, outcome=sum(r[0] for r in raw) + 1.0)
    total = sum(r[0] for r in raw)
    final_reply = reference[-1]["content"]
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


def _progress_items(solution, calls, reply_source) -> list[_RawItem]:
    """Each solution call, each argument it takes from an earlier result, and (with a reply
    source) the final reply's value taken from that result."""
    raw: list[_RawItem] = []
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
    if reply_source is not None:
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
    return raw


def _outcome_items(calls, facts, outcome: float) -> list[_RawItem]:
    """The two outcome items, each of weight `outcome`: exactly the solution's changes with
    none refused, and the final reply's facts."""
    changes = [c for c in calls if c["name"] in STATE_CHANGING]
    text = ", ".join(f"{c['name']}({json.dumps(c['arguments'])})" for c in changes) or "none"
    stated = " and ".join(facts)
    return [
        (
            outcome,
            f"Are the changes made exactly {text}, with no change refused?",
            "assistant.tool_calls",
            f"By the final reply, the state-changing calls that succeeded are exactly {text}, "
            "and none was refused.",
            {
                "kind": "effects",
                "tools": sorted(STATE_CHANGING),
                "calls": changes,
                "no_refusals": True,
            },
        ),
        (
            outcome,
            f"Does the final reply state {stated}?",
            "assistant.content.user_visible_reply",
            f"The final reply states {stated}.",
            {"kind": "reply_states", "values": list(facts)},
        ),
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
