"""Chat conversations shared by the text-layer tests."""

TOOLS = [
    {"type": "function", "function": {"name": "place_order", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_balance", "description": "Balance é."}},
]


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


MULTI_TURN = [
    {"role": "system", "content": "You run errands."},
    {"role": "user", "content": "Check orders ORD-1 and ORD-2."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            call("get_order", {"order_id": "ORD-1"}),
            call("get_order", {"order_id": "ORD-2"}),
        ],
    },
    {"role": "tool", "content": '{"status": "shipped"}'},
    {"role": "tool", "content": '{"status": "pending"}'},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("cancel_order", {"order_id": "ORD-2"})],
    },
    {"role": "tool", "content": '{"cancelled": true}'},
    {"role": "assistant", "content": "ORD-1 shipped; ORD-2 is cancelled."},
    {"role": "user", "content": "  Thanks!\nAnd my balance?"},
    {"role": "assistant", "content": "\nOne moment.", "tool_calls": [call("get_balance", {})]},
    {"role": "tool", "content": "\n 42.0 \n"},
    {"role": "assistant", "content": "Your balance is 42.0."},
]
# What each role writes, by hand, in order.
ACT1 = (
    'Let me look.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "ORD-1"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "ORD-2"}}\n'
    "</tool_call>"
)
ACT2 = '<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "ORD-2"}}\n</tool_call>'
ACT4 = '\nOne moment.\n<tool_call>\n{"name": "get_balance", "arguments": {}}\n</tool_call>'
