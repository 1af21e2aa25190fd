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
from collections.abc import Callable
from typing import Any

from envace_jax.data.tasks import Task
from envace_jax.envs.base import error_code, observed_values
from envace_jax.envs.demo.oracle import conversation
from envace_jax.envs.demo.tools import STATE_CHANGING, TOOL_SCHEMAS, execute
from envace_jax.envs.demo.world import (
    OPEN,
    SHIPPED,
    World,
    copy_world,
    find,
    generate_world,
    render_records,
)

SPLITS = ("train", "validation", "test")
MAX_TASKS_PER_SEED = 1_000_003
# Amounts a user asks to move are one digit, copied like an id's digit: a policy of about a
# million parameters copies two-digit numbers from the user's message rarely (balances and
# prices in tool results stay two-digit: those it reads and states).
MAX_AMOUNT = 9
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


def _call(tool: str, sources: dict[str, int] | None = None, /, **arguments: Any) -> dict[str, Any]:
    """One solution call; `sources` maps an argument to the earlier call whose result holds it."""
    return {"name": tool, "arguments": arguments, "sources": sources or {}}


def _choice(rng: random.Random, rows: list[dict]) -> dict | None:
    """A random row of `rows`, or None when there is none (the family does not fit)."""
    return rng.choice(rows) if rows else None


def _balance(world: World, account: str) -> int:
    return find(world, "accounts", id=account)["balance"]


def _orders(world: World, customer: str, status: str | None = None) -> list[dict]:
    return [
        o
        for o in world["orders"]
        if o["customer"] == customer and (status is None or o["status"] == status)
    ]


def _other_account(rng: random.Random, world: World, account: str) -> str:
    return rng.choice([a["id"] for a in world["accounts"] if a["id"] != account])


# A family: (rng, world) -> (instruction, solution calls, reply template, reply source) or None
# when the world has no fitting entities. The reply template is formatted with the reply
# source's observed value as {v} plus the instruction's fields.
Family = Callable[[random.Random, World], tuple | None]


def _cancel(rng, world):
    return _settle_one(rng, world, OPEN, "cancel_order", "cancel", "cancelled")


def _refund(rng, world):
    return _settle_one(rng, world, SHIPPED, "refund", "refund", "refunded")


def _settle_one(rng, world, status, tool, verb, done):
    orders = [o for o in world["orders"] if o["status"] == status]
    if not orders:
        return None
    o = rng.choice(orders)
    return (
        f"Please {verb} order {o['id']}.",
        [_call(tool, order_id=o["id"])],
        f"Order {o['id']} is {done}. Your balance is {{v}}.",
        (0, "balance"),
    )


def _transfer(rng, world):
    a = rng.choice([a for a in world["accounts"] if a["balance"] >= 10])
    to = _other_account(rng, world, a["id"])
    amount = rng.randint(1, min(MAX_AMOUNT, a["balance"]))
    return (
        f"Send {amount} from account {a['id']} to account {to}.",
        [_call("transfer", from_id=a["id"], to_id=to, amount=amount)],
        f"Sent {amount} to {to}. The balance of {a['id']} is {{v}}.",
        (0, "balance"),
    )


def _unique_item_orders(world, customer, status):
    items = [o["item"] for o in _orders(world, customer)]
    return [o for o in _orders(world, customer, status) if items.count(o["item"]) == 1]


def _cancel_by_item(rng, world):
    rows = [c for c in world["customers"] if _unique_item_orders(world, c["id"], OPEN)]
    c = _choice(rng, rows)
    if c is None:
        return None
    o = rng.choice(_unique_item_orders(world, c["id"], OPEN))
    return (
        f"I am customer {c['id']}. Please cancel my {o['item']} order.",
        [
            _call("list_orders", customer_id=c["id"]),
            _call("cancel_order", {"order_id": 0}, order_id=o["id"]),
        ],
        f"Order {o['id']} is cancelled. Your balance is {{v}}.",
        (1, "balance"),
    )


def _pay_by_member(rng, world):
    rows = [c for c in world["customers"] if _balance(world, c["account"]) >= 10]
    c = _choice(rng, rows)
    if c is None:
        return None
    to = _other_account(rng, world, c["account"])
    amount = rng.randint(1, min(MAX_AMOUNT, _balance(world, c["account"])))
    return (
        f"I am member {c['member']}. Send {amount} to account {to}.",
        [
            _call("find_customer", member=c["member"]),
            _call("transfer", {"from_id": 0}, from_id=c["account"], to_id=to, amount=amount),
        ],
        f"Sent {amount} to {to}. Your balance is {{v}}.",
        (1, "balance"),
    )


def _resolve(rng, world):
    orders = [o for o in world["orders"] if o["status"] in (OPEN, SHIPPED)]
    if not orders:
        return None
    o = rng.choice(orders)
    tool, done = ("cancel_order", "cancelled") if o["status"] == OPEN else ("refund", "refunded")
    return (
        f"Please settle order {o['id']}: cancel it if open, refund it if shipped.",
        [_call("get_order", order_id=o["id"]), _call(tool, order_id=o["id"])],
        f"Order {o['id']} is {done}. Your balance is {{v}}.",
        (1, "balance"),
    )


def _sweep(rng, world):
    a = rng.choice(world["accounts"])
    to = _other_account(rng, world, a["id"])
    return (
        f"Move all money in account {a['id']} to account {to}.",
        [
            _call("get_balance", account_id=a["id"]),
            _call("transfer", {"amount": 0}, from_id=a["id"], to_id=to, amount=a["balance"]),
        ],
        f"Moved {{v}} to {to}. The balance of {a['id']} is 0.",
        (0, "balance"),
    )


def _by_member(rng, world, status, tool, verb, done):
    rows = [c for c in world["customers"] if _unique_item_orders(world, c["id"], status)]
    c = _choice(rng, rows)
    if c is None:
        return None
    o = rng.choice(_unique_item_orders(world, c["id"], status))
    return (
        f"I am member {c['member']}. Please {verb} my {o['item']} order.",
        [
            _call("find_customer", member=c["member"]),
            _call("list_orders", {"customer_id": 0}, customer_id=c["id"]),
            _call(tool, {"order_id": 1}, order_id=o["id"]),
        ],
        f"Order {o['id']} is {done}. Your balance is {{v}}.",
        (2, "balance"),
    )


def _cancel_by_member(rng, world):
    return _by_member(rng, world, OPEN, "cancel_order", "cancel", "cancelled")


def _refund_by_member(rng, world):
    return _by_member(rng, world, SHIPPED, "refund", "refund", "refunded")


def _pay_member_to_member(rng, world):
    rows = [c for c in world["customers"] if _balance(world, c["account"]) >= 10]
    c = _choice(rng, rows)
    if c is None:
        return None
    d = rng.choice([x for x in world["customers"] if x is not c])
    amount = rng.randint(1, min(MAX_AMOUNT, _balance(world, c["account"])))
    return (
        f"I am member {c['member']}. Send {amount} to member {d['member']}.",
        [
            _call("find_customer", member=c["member"]),
            _call("find_customer", member=d["member"]),
            _call(
                "transfer",
                {"from_id": 0, "to_id": 1},
                from_id=c["account"],
                to_id=d["account"],
                amount=amount,
            ),
        ],
        f"Sent {amount} to member {d['member']}. Your balance is {{v}}.",
        (2, "balance"),
    )


def _pay_and_cancel(rng, world):
    # The payment comes first, next to the lookup that gives the payer's account: the policy
    # copies the payee and the amount from the user's message while it is still close.
    rows = [
        c
        for c in world["customers"]
        if _unique_item_orders(world, c["id"], OPEN) and _balance(world, c["account"]) >= 10
    ]
    c = _choice(rng, rows)
    if c is None:
        return None
    o = rng.choice(_unique_item_orders(world, c["id"], OPEN))
    to = _other_account(rng, world, c["account"])
    amount = rng.randint(1, MAX_AMOUNT)
    return (
        f"I am member {c['member']}. Send {amount} to account {to}, then cancel my "
        f"{o['item']} order.",
        [
            _call("find_customer", member=c["member"]),
            _call("transfer", {"from_id": 0}, from_id=c["account"], to_id=to, amount=amount),
            _call("list_orders", {"customer_id": 0}, customer_id=c["id"]),
            _call("cancel_order", {"order_id": 2}, order_id=o["id"]),
        ],
        f"Sent {amount} to {to} and order {o['id']} is cancelled. Your balance is {{v}}.",
        (3, "balance"),
    )


def _settle_two(rng, world):
    rows = [
        c
        for c in world["customers"]
        if _unique_item_orders(world, c["id"], OPEN)
        and _unique_item_orders(world, c["id"], SHIPPED)
    ]
    c = _choice(rng, rows)
    if c is None:
        return None
    o = rng.choice(_unique_item_orders(world, c["id"], OPEN))
    s = rng.choice(_unique_item_orders(world, c["id"], SHIPPED))
    return (
        f"I am member {c['member']}. Cancel my {o['item']} order and refund my {s['item']} order.",
        [
            _call("find_customer", member=c["member"]),
            _call("list_orders", {"customer_id": 0}, customer_id=c["id"]),
            _call("cancel_order", {"order_id": 1}, order_id=o["id"]),
            _call("refund", {"order_id": 1}, order_id=s["id"]),
        ],
        f"Order {o['id']} is cancelled and {s['id']} is refunded. Your balance is {{v}}.",
        (3, "balance"),
    )


FAMILIES: dict[int, dict[str, Family]] = {
    1: {"cancel": _cancel, "refund": _refund, "transfer": _transfer},
    2: {
        "cancel_by_item": _cancel_by_item,
        "pay_by_member": _pay_by_member,
        "resolve": _resolve,
        "sweep": _sweep,
    },
    3: {
        "cancel_by_member": _cancel_by_member,
        "refund_by_member": _refund_by_member,
        "pay_member_to_member": _pay_member_to_member,
    },
    4: {"pay_and_cancel": _pay_and_cancel, "settle_two": _settle_two},
}


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
    n_calls = rng.randint(1, 4)
    family = rng.choice(sorted(FAMILIES[n_calls]))
    for _ in range(1000):
        world = generate_world(rng, n_customers=3)
        plan = FAMILIES[n_calls][family](rng, world)
        if plan is not None:
            break
    else:  # pragma: no cover - every family fits a few percent of worlds at least
        raise RuntimeError(f"no world fits family {family!r} (world seed {ws})")
    instruction, solution, reply_template, (src_call, src_key) = plan

    state = copy_world(world)
    observations = [execute(state, c["name"], c["arguments"]) for c in solution]
    for c, obs in zip(solution, observations, strict=True):
        if error_code(obs) is not None:
            raise AssertionError(f"world seed {ws}: solution call {c} failed: {obs}")
        for arg, j in c["sources"].items():
            if c["arguments"][arg] not in observed_values(observations[j]):
                raise AssertionError(f"world seed {ws}: {c} {arg} is not in result {j}")
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
