"""The demo domain's seven tools: schemas (OpenAI function format) and their execution.

Every response follows a rule stated in the tool's description or readable from the records
table in the system turn, so a policy can learn to rehearse it:

* lookups (`find_customer`, `list_orders`, `get_order`, `get_balance`) return rows of the
  current world, statuses included (the hidden state a task's next call depends on);
* `cancel_order` (open orders) and `refund` (shipped orders) add the order's price to its
  owner's balance and return the new balance;
* `transfer` moves an amount between two accounts and returns the payer's new balance
  (old balance - amount);
* an unknown id gives ``not_found``, a wrong order status ``bad_status``, a frozen payer
  ``frozen``, an amount over the balance ``no_funds``, an amount below 1 ``bad_amount``, equal
  accounts ``same_account``.

A change the world refuses is a *refusal* (`is_refusal`); the environment records it, and a
task whose episode made one fails (`envs.demo.env`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envace_jax.envs.base import (
    BAD_ARGS,
    CALL_ERROR_CODES,
    UNKNOWN_TOOL,
    ToolResult,
    error_code,
    tool_error,
)
from envace_jax.envs.demo.world import CANCELLED, FROZEN, OPEN, REFUNDED, SHIPPED, World, find


def _schema(tool: str, description: str, /, **params: str) -> dict[str, Any]:
    # Parameters carry no descriptions: their names say enough, and prompts stay short.
    return {
        "type": "function",
        "function": {
            "name": tool,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t} for p, t in params.items()},
                "required": list(params),
            },
        },
    }


TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    s["function"]["name"]: s
    for s in (
        _schema("find_customer", "Customer by member number: id, account.", member="string"),
        _schema("list_orders", "A customer's orders: id, item, status.", customer_id="string"),
        _schema("get_order", "An order: id, customer, item, price, status.", order_id="string"),
        _schema("get_balance", "An account's balance and status.", account_id="string"),
        _schema(
            "cancel_order",
            "Cancel an open order; its price goes to the owner's balance. Gives it.",
            order_id="string",
        ),
        _schema(
            "refund",
            "Refund a shipped order; its price goes to the owner's balance. Gives it.",
            order_id="string",
        ),
        _schema(
            "transfer",
            "Move amount (at least 1) from an active account. Gives from_id's balance.",
            from_id="string",
            to_id="string",
            amount="integer",
        ),
    )
}
TOOL_NAMES = tuple(TOOL_SCHEMAS)
STATE_CHANGING = frozenset({"cancel_order", "refund", "transfer"})
DOMAIN_ERROR_CODES = ("not_found", "bad_status", "frozen", "no_funds", "bad_amount", "same_account")


def is_refusal(name: str, result: Any) -> bool:
    """Whether `result` is the world refusing the state-changing call `name` (a domain error:
    a call error is not a refusal, the call never reached the world)."""
    code = error_code(result)
    return name in STATE_CHANGING and code is not None and code not in CALL_ERROR_CODES


def check_arguments(name: str, arguments: Any) -> ToolResult | None:
    """A ``bad_args``/``unknown_tool`` error for a call that does not fit the schema, else None."""
    if name not in TOOL_SCHEMAS:
        return tool_error(UNKNOWN_TOOL, f"no tool {name!r}")
    if not isinstance(arguments, dict):
        return tool_error(BAD_ARGS, f"{name}: arguments must be an object")
    props = TOOL_SCHEMAS[name]["function"]["parameters"]["properties"]
    for key in props:
        if key not in arguments:
            return tool_error(BAD_ARGS, f"{name}: missing {key}")
    for key, value in arguments.items():
        if key not in props:
            return tool_error(BAD_ARGS, f"{name}: unexpected {key}")
        want = props[key]["type"]
        ok = isinstance(value, str) if want == "string" else as_int(value) is not None
        if not ok:
            return tool_error(BAD_ARGS, f"{name}: {key} must be {want}")
    return None


def as_int(value: Any) -> int | None:
    """`value` as a JSON-schema integer (``5`` or ``5.0``, never a bool), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _balance_of_owner(world: World, order: dict[str, Any]) -> dict[str, Any]:
    customer = find(world, "customers", id=order["customer"])
    return find(world, "accounts", id=customer["account"])


def _find_customer(world: World, member: str) -> ToolResult:
    c = find(world, "customers", member=member)
    if c is None:
        return tool_error("not_found", f"no member {member}")
    return {"id": c["id"], "account": c["account"]}


def _list_orders(world: World, customer_id: str) -> ToolResult:
    if find(world, "customers", id=customer_id) is None:
        return tool_error("not_found", f"no customer {customer_id}")
    orders = [o for o in world["orders"] if o["customer"] == customer_id]
    return {"orders": [{"id": o["id"], "item": o["item"], "status": o["status"]} for o in orders]}


def _get_order(world: World, order_id: str) -> ToolResult:
    o = find(world, "orders", id=order_id)
    if o is None:
        return tool_error("not_found", f"no order {order_id}")
    return dict(o)


def _get_balance(world: World, account_id: str) -> ToolResult:
    a = find(world, "accounts", id=account_id)
    if a is None:
        return tool_error("not_found", f"no account {account_id}")
    return {"account": a["id"], "balance": a["balance"], "status": a["status"]}


def _settle(world: World, order_id: str, need: str, new: str, strict: bool) -> ToolResult:
    o = find(world, "orders", id=order_id)
    if o is None:
        return tool_error("not_found", f"no order {order_id}")
    if strict and o["status"] != need:
        return tool_error("bad_status", f"order {order_id} is {o['status']}")
    o["status"] = new
    account = _balance_of_owner(world, o)
    account["balance"] += o["price"]
    return {"id": order_id, "status": new, "balance": account["balance"]}


def _cancel_order(world: World, order_id: str, strict: bool) -> ToolResult:
    return _settle(world, order_id, OPEN, CANCELLED, strict)


def _refund(world: World, order_id: str, strict: bool) -> ToolResult:
    return _settle(world, order_id, SHIPPED, REFUNDED, strict)


def _transfer(world: World, from_id: str, to_id: str, amount: int, strict: bool) -> ToolResult:
    src = find(world, "accounts", id=from_id)
    dst = find(world, "accounts", id=to_id)
    if src is None:
        return tool_error("not_found", f"no account {from_id}")
    if dst is None:
        return tool_error("not_found", f"no account {to_id}")
    if from_id == to_id:
        return tool_error("same_account", "from_id equals to_id")
    if amount < 1:
        return tool_error("bad_amount", f"amount {amount} is below 1")
    if strict and src["status"] == FROZEN:
        return tool_error("frozen", f"account {from_id} is frozen")
    if strict and amount > src["balance"]:
        return tool_error("no_funds", f"balance of {from_id} is below {amount}")
    src["balance"] -= amount
    dst["balance"] += amount
    return {"from": from_id, "balance": src["balance"]}


_IMPL: dict[str, Callable[..., ToolResult]] = {
    "find_customer": _find_customer,
    "list_orders": _list_orders,
    "get_order": _get_order,
    "get_balance": _get_balance,
    "cancel_order": _cancel_order,
    "refund": _refund,
    "transfer": _transfer,
}


def execute(world: World, name: str, arguments: Any, strict: bool = True) -> ToolResult:
    """Run one call on `world` (mutated in place); a tool error response when it fails.
    `strict=False` makes every change the world has the entities for, whatever their status
    or balance (a world that never refuses: the 'optimist' corruption, `envs.demo.corrupt`)."""
    err = check_arguments(name, arguments)
    if err is not None:
        return err
    if "amount" in arguments:
        arguments = {**arguments, "amount": as_int(arguments["amount"])}
    if name in STATE_CHANGING:
        return _IMPL[name](world, **arguments, strict=strict)
    return _IMPL[name](world, **arguments)
