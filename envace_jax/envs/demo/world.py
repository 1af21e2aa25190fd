"""The demo shop world: customers with one bank account each, and their orders.

A world is a plain JSON-serialisable dict, so it can sit inside a task record and be compared
for equality:

    {"customers": [{"id": "C3", "member": "M5", "account": "A7"}, ...],
     "accounts":  [{"id": "A7", "balance": 120, "status": "active"}, ...],
     "orders":    [{"id": "O5", "customer": "C3", "item": "lamp", "price": 12,
                    "status": "open"}, ...]}

Order status is one of ``open`` (can be cancelled), ``shipped`` (can be refunded),
``cancelled`` or ``refunded``; account status is ``active`` or ``frozen`` (a frozen account
cannot send money). Statuses are the world's *hidden state*: the records table of a task in the
hidden stratum leaves them out (`render_records(hidden=True)`), so only a lookup shows them.

Strings are short (one-digit ids like ``C3``/``A7``/``O5``, member numbers like ``M5``,
integer amounts below 100) so that prompts stay short and a policy
of about a million parameters copies an id or an amount with one or two digit tokens: copying
longer digit strings exactly is what such a policy fails at first (the demo tokenizer splits
digits).

Customers go by member numbers, not names: a name is one rare token, and a tied-embedding
policy of this size never learns to copy it. With 30 first names, the shipped warm start's
name embeddings had collapsed together (mean cosine 0.89, against 0.50 between digits) and
its find_customer calls named the right customer 1 time in 30 (chance) after 2,500 steps,
while it copied 77% of id digits; every task that starts with a name lookup failed.
"""

from __future__ import annotations

import copy
import random
from typing import Any

World = dict[str, Any]

ITEMS = ("lamp", "mug", "pen", "hat", "book", "cup", "bag", "fan", "sock", "clock", "desk", "kite")
OPEN, SHIPPED, CANCELLED, REFUNDED = "open", "shipped", "cancelled", "refunded"
STATUSES = (OPEN, SHIPPED, CANCELLED, REFUNDED)
ACTIVE, FROZEN = "active", "frozen"
ACCOUNT_STATUSES = (ACTIVE, FROZEN)
# How often an account or order that no task is about has each status (a task's own entity
# gets the status of the branch the task draws, `envs.demo.families`).
BACKGROUND_ORDER_STATUSES = (OPEN, OPEN, SHIPPED, SHIPPED, CANCELLED)
BACKGROUND_ACCOUNT_STATUSES = (ACTIVE, ACTIVE, ACTIVE, FROZEN)


def generate_world(rng: random.Random, n_customers: int = 3, max_orders: int = 2) -> World:
    """A random world: `n_customers` customers, each with a member number, an account and
    1..`max_orders` orders with distinct items."""
    if not 2 <= n_customers <= 9 or not 1 <= max_orders or n_customers * max_orders > 9:
        raise ValueError(
            f"generate_world: ids are one digit, so need 2 <= n_customers <= 9 and "
            f"n_customers * max_orders <= 9 (got {n_customers} and {max_orders})"
        )
    mids = rng.sample(range(1, 10), n_customers)
    cids = rng.sample(range(1, 10), n_customers)
    aids = rng.sample(range(1, 10), n_customers)
    n_orders = [rng.randint(1, max_orders) for _ in range(n_customers)]
    oids = sorted(rng.sample(range(1, 10), sum(n_orders)))
    world: World = {"customers": [], "accounts": [], "orders": []}
    k = 0
    for mid, cid, aid, n in zip(mids, cids, aids, n_orders, strict=True):
        world["customers"].append({"id": f"C{cid}", "member": f"M{mid}", "account": f"A{aid}"})
        world["accounts"].append(
            {
                "id": f"A{aid}",
                "balance": 5 * rng.randint(2, 12),
                "status": rng.choice(BACKGROUND_ACCOUNT_STATUSES),
            }
        )
        for item in rng.sample(ITEMS, n):
            world["orders"].append(
                {
                    "id": f"O{oids[k]}",
                    "customer": f"C{cid}",
                    "item": item,
                    "price": rng.randint(2, 15),
                    "status": rng.choice(BACKGROUND_ORDER_STATUSES),
                }
            )
            k += 1
    rng.shuffle(world["orders"])
    return world


def copy_world(world: World) -> World:
    return copy.deepcopy(world)


def find(world: World, table: str, **match: Any) -> dict[str, Any] | None:
    """The first row of `table` whose fields equal `match`, or None."""
    for row in world[table]:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def render_records(world: World, hidden: bool = False) -> str:
    """The compact table of the world that the system turn carries (both roles read it);
    `hidden` leaves the statuses out (the hidden stratum: only a lookup shows them)."""
    status = lambda row: "" if hidden else f" {row['status']}"
    head = "" if hidden else " status"
    lines = [f"customers (member id account balance{head}):"]
    for c in world["customers"]:
        account = find(world, "accounts", id=c["account"])
        lines.append(
            f"{c['member']} {c['id']} {c['account']} {account['balance']}{status(account)}"
        )
    lines.append(f"orders (id customer item price{head}):")
    for o in world["orders"]:
        lines.append(f"{o['id']} {o['customer']} {o['item']} {o['price']}{status(o)}")
    return "\n".join(lines)
