"""The demo task families: each draws one instruction, the state its answer depends on, and the
solution for that state.

Every family branches on hidden state that a lookup shows: the status of an order (open ->
cancel it, shipped -> refund it, already cancelled or refunded -> tell the user) or of an
account (active -> move the money, frozen -> tell the user). The instruction never names the
branch; the rules are in the system turn. The wrong branch's change is refused by the world,
and a refusal fails the task (`envs.demo.env`), so the next call has to follow what the lookup
said. A family's `default` action is what an agent that ignores the lookup does (the imperfect
demonstrator of the warm start, `envs.demo.oracle`).

| family | lookups | branches |
|---|---|---|
| close | get_order | cancel_order / refund / reply |
| close_item | list_orders | cancel_order / refund / reply |
| close_member | find_customer, list_orders | cancel_order / refund / reply |
| sweep | get_balance | transfer / reply |
| sweep_member | find_customer, get_balance | transfer / reply |
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from envace_jax.envs.demo.world import (
    ACTIVE,
    CANCELLED,
    FROZEN,
    OPEN,
    REFUNDED,
    SHIPPED,
    World,
    find,
)

# The branch a close task draws (uniformly), and the order status that gives it.
CLOSE_BRANCHES = ("open", "shipped", "closed")
SWEEP_BRANCHES = (ACTIVE, FROZEN)


def _call(tool: str, sources: dict[str, int] | None = None, /, **arguments: Any) -> dict[str, Any]:
    """One solution call; `sources` maps an argument to the earlier call whose result holds it."""
    return {"name": tool, "arguments": arguments, "sources": sources or {}}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One task's instruction and its solution in the world the family prepared.

    lookups: the calls before the branch (their last result shows the deciding status).
    branch: the deciding status (`open`, `shipped`, `cancelled`, `refunded`, `active`,
      `frozen`).
    action: the branch's state-changing call, or None when the branch only replies.
    reply: the final reply's template; `{v}` is the reply source's value.
    reply_source: (index into the solution, result key) of the value the reply states, or None
      when that value is the branch's status inside a listing (not a result's own key).
    default: the call an agent that ignores the lookup makes (the family's default action).
    refused_reply: that agent's reply when the world refuses its default.
    extra_facts: words the reply must state besides the source value.
    """

    instruction: str
    lookups: tuple[dict, ...]
    branch: str
    action: dict | None
    reply: str
    reply_source: tuple[int, str] | None
    default: dict
    refused_reply: str
    extra_facts: tuple[str, ...] = ()

    @property
    def solution(self) -> list[dict]:
        return [*self.lookups, *([self.action] if self.action else [])]


# A family: (rng, world) -> Plan, or None when the world has no fitting entities. It may set the
# status of the entity it is about (the branch it draws).
Family = Callable[[random.Random, World], Plan | None]


def _close_plan(rng, order: dict, instruction: str, lookups: list[dict]) -> Plan:
    """The close branch for `order` (its status set to the drawn branch's), after `lookups`;
    the order id comes from the last lookup's result, or the instruction when that is
    get_order."""
    branch = rng.choice(CLOSE_BRANCHES)
    status = {"open": OPEN, "shipped": SHIPPED}.get(branch) or rng.choice((CANCELLED, REFUNDED))
    order["status"] = status
    last = len(lookups) - 1
    id_source = {} if lookups[-1]["name"] == "get_order" else {"order_id": last}
    oid = order["id"]
    default = _call("cancel_order", id_source, order_id=oid)
    refused = f"Order {oid} could not be cancelled."
    if status in (CANCELLED, REFUNDED):
        reply = f"Order {oid} is already {{v}}."
        source = (last, "status") if lookups[-1]["name"] == "get_order" else None
        return Plan(
            instruction,
            tuple(lookups),
            status,
            None,
            reply,
            source,
            default,
            refused,
            extra_facts=("already",),
        )
    tool, done = ("cancel_order", CANCELLED) if status == OPEN else ("refund", REFUNDED)
    action = _call(tool, id_source, order_id=oid)
    reply = f"Order {oid} is {done}. Your balance is {{v}}."
    return Plan(
        instruction, tuple(lookups), status, action, reply, (last + 1, "balance"), default, refused
    )


def _unique_item_orders(world: World, customer: str) -> list[dict]:
    """The customer's orders whose item no other order of theirs has (nameable by item)."""
    mine = [o for o in world["orders"] if o["customer"] == customer]
    items = [o["item"] for o in mine]
    return [o for o in mine if items.count(o["item"]) == 1]


def _close(rng, world):
    order = rng.choice(world["orders"])
    return _close_plan(
        rng,
        order,
        f"Please close order {order['id']}.",
        [_call("get_order", order_id=order["id"])],
    )


def _close_by_item(rng, world, *, member: bool):
    """A customer's order named by its item. The user gives their customer id, or their member
    number (`member`), which a find_customer call first turns into the id."""
    rows = [c for c in world["customers"] if _unique_item_orders(world, c["id"])]
    if not rows:
        return None
    c = rng.choice(rows)
    order = rng.choice(_unique_item_orders(world, c["id"]))
    lookup = [_call("find_customer", member=c["member"])] if member else []
    listing = _call("list_orders", {"customer_id": 0} if member else None, customer_id=c["id"])
    user = f"member {c['member']}" if member else f"customer {c['id']}"
    instruction = f"I am {user}. Please close my {order['item']} order."
    return _close_plan(rng, order, instruction, [*lookup, listing])


def _close_item(rng, world):
    return _close_by_item(rng, world, member=False)


def _close_member(rng, world):
    return _close_by_item(rng, world, member=True)


def _sweep_plan(rng, world, account: dict, to: str, instruction, lookups, yours: bool) -> Plan:
    """Move all of `account`'s money to `to` when it is active (its status set to the drawn
    branch's); get_balance is the last lookup."""
    account["status"] = status = rng.choice(SWEEP_BRANCHES)
    last = len(lookups) - 1
    aid, balance = account["id"], account["balance"]
    sources = {"amount": last} | ({"from_id": 0} if yours else {})
    default = _call("transfer", sources, from_id=aid, to_id=to, amount=balance)
    refused = f"Could not move the money from {aid}."
    if status == FROZEN:
        reply = f"Account {aid} is {{v}}."
        return Plan(
            instruction, tuple(lookups), status, None, reply, (last, "status"), default, refused
        )
    after = "Your balance is 0." if yours else f"The balance of {aid} is 0."
    reply = f"Moved {{v}} to {to}. {after}"
    return Plan(
        instruction, tuple(lookups), status, default, reply, (last, "balance"), default, refused
    )


def _other_account(rng: random.Random, world: World, account: str) -> str:
    return rng.choice([a["id"] for a in world["accounts"] if a["id"] != account])


def _sweep(rng, world):
    account = rng.choice(world["accounts"])
    to = _other_account(rng, world, account["id"])
    instruction = f"Move all money in account {account['id']} to account {to}."
    lookups = [_call("get_balance", account_id=account["id"])]
    return _sweep_plan(rng, world, account, to, instruction, lookups, yours=False)


def _sweep_member(rng, world):
    c = rng.choice(world["customers"])
    account = find(world, "accounts", id=c["account"])
    to = _other_account(rng, world, account["id"])
    instruction = f"I am member {c['member']}. Move all my money to account {to}."
    lookups = [
        _call("find_customer", member=c["member"]),
        _call("get_balance", {"account_id": 0}, account_id=account["id"]),
    ]
    return _sweep_plan(rng, world, account, to, instruction, lookups, yours=True)


FAMILIES: dict[str, Family] = {
    "close": _close,
    "close_item": _close_item,
    "close_member": _close_member,
    "sweep": _sweep,
    "sweep_member": _sweep_member,
}
