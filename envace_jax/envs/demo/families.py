"""The demo task families: each draws one instruction and its solution from a world.

A family is a function (rng, world) -> (instruction, solution calls, reply template, reply
source) or None when the world has no fitting entities; `FAMILIES` groups them by the number of
calls their solution makes (the table in `envs.demo.tasks`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from envace_jax.envs.demo.world import OPEN, SHIPPED, World, find

# Amounts a user asks to move are one digit, copied like an id's digit: a policy of about a
# million parameters copies two-digit numbers from the user's message rarely (balances and
# prices in tool results stay two-digit: those it reads and states).
MAX_AMOUNT = 9


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
    return _by_item(rng, world, OPEN, "cancel_order", "cancel", "cancelled", member=False)


def _payer(rng: random.Random, world: World) -> dict | None:
    """A customer whose account holds at least 10 (a payment of 1 to 9 fits), or None."""
    return _choice(rng, [c for c in world["customers"] if _balance(world, c["account"]) >= 10])


def _pay_by_member(rng, world):
    c = _payer(rng, world)
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


def _by_item(rng, world, status, tool, verb, done, *, member):
    """A customer's order named by its item. The user gives their customer id, or their member
    number (`member`), which a find_customer call first turns into the id."""
    rows = [c for c in world["customers"] if _unique_item_orders(world, c["id"], status)]
    c = _choice(rng, rows)
    if c is None:
        return None
    o = rng.choice(_unique_item_orders(world, c["id"], status))
    lookup = [_call("find_customer", member=c["member"])] if member else []
    listing = len(lookup)  # the index of the list_orders call
    user = f"member {c['member']}" if member else f"customer {c['id']}"
    return (
        f"I am {user}. Please {verb} my {o['item']} order.",
        [
            *lookup,
            _call("list_orders", {"customer_id": 0} if member else None, customer_id=c["id"]),
            _call(tool, {"order_id": listing}, order_id=o["id"]),
        ],
        f"Order {o['id']} is {done}. Your balance is {{v}}.",
        (listing + 1, "balance"),
    )


def _cancel_by_member(rng, world):
    return _by_item(rng, world, OPEN, "cancel_order", "cancel", "cancelled", member=True)


def _refund_by_member(rng, world):
    return _by_item(rng, world, SHIPPED, "refund", "refund", "refunded", member=True)


def _pay_member_to_member(rng, world):
    c = _payer(rng, world)
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
