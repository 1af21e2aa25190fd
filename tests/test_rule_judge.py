"""Rule judge on hand-written trajectories with hand-computed scores.

The task is written out here by hand (world, checklist, weights), not generated, so the
expected scores follow from the checklist semantics alone: an item passes if any assistant
step of its turn satisfies it; turn score = sum of weights of passed items; a call error
zeroes the turn and ends the episode; episode score = sum of turn scores / number of turns.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.data.tasks import Task
from envace_jax.envs.demo import TOOL_SCHEMAS, DemoEnv, generate_tasks
from envace_jax.rewards.rule_judge import judge

SYSTEM = {"role": "system", "content": "Shop assistant."}
USER = {"role": "user", "content": "I am member M5. Please cancel my lamp order."}
USER2 = {"role": "user", "content": "Now send 20 to account A2."}
WORLD = {
    "customers": [
        {"id": "C3", "member": "M5", "account": "A7"},
        {"id": "C5", "member": "M2", "account": "A2"},
    ],
    "accounts": [
        {"id": "A7", "balance": 120, "status": "active"},
        {"id": "A2", "balance": 40, "status": "active"},
    ],
    "orders": [
        {"id": "O23", "customer": "C3", "item": "lamp", "price": 30, "status": "open"},
        {"id": "O41", "customer": "C3", "item": "mug", "price": 12, "status": "shipped"},
        {"id": "O57", "customer": "C5", "item": "lamp", "price": 9, "status": "open"},
    ],
}
# The real environment's responses, written out by hand from the world above.
FIND = {"id": "C3", "account": "A7"}
LIST = {
    "orders": [
        {"id": "O23", "item": "lamp", "status": "open"},
        {"id": "O41", "item": "mug", "status": "shipped"},
    ]
}
CANCEL = {"id": "O23", "status": "cancelled", "balance": 150}
TRANSFER = {"from": "A7", "balance": 130}


def _item(rule, weight, required=False):
    return {
        "question": f"rule {rule['kind']}",
        "focus_on": "assistant.tool_calls",
        "pass_condition": "the rule holds",
        "weight": weight,
        "required_for_next_turn": required,
        "rule": rule,
    }


TURN1 = [
    _item({"kind": "call", "tool": "find_customer", "args": {"member": "M5"}}, 0.1),
    _item({"kind": "call", "tool": "list_orders", "args": {"customer_id": "C3"}}, 0.1),
    _item(
        {
            "kind": "arg_from",
            "tool": "list_orders",
            "arg": "customer_id",
            "source": "find_customer",
        },
        0.1,
    ),
    _item({"kind": "call", "tool": "cancel_order", "args": {"order_id": "O23"}}, 0.2),
    _item(
        {"kind": "arg_from", "tool": "cancel_order", "arg": "order_id", "source": "list_orders"},
        0.1,
    ),
    _item({"kind": "reply_states", "values": ["150"]}, 0.3),
    _item({"kind": "reply_from", "source": "cancel_order", "key": "balance"}, 0.1),
]
TURN2 = [
    _item(
        {
            "kind": "call",
            "tool": "transfer",
            "args": {"from_id": "A7", "to_id": "A2", "amount": 20},
        },
        0.5,
    ),
    _item({"kind": "reply_states", "values": ["130"]}, 0.3),
    _item({"kind": "reply_from", "source": "transfer", "key": "balance"}, 0.2),
]


def _call(tool, /, **args):
    fn = {"name": tool, "arguments": args}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": fn}],
    }


def _tool(name, result):
    text = result if isinstance(result, str) else json.dumps(result)
    return {"role": "tool", "name": name, "content": text}


def _reply(text):
    return {"role": "assistant", "content": text}


def _task(two_turns=False, required=False):
    turn1 = [dict(it) for it in TURN1]
    turn1[3] = _item(turn1[3]["rule"], 0.2, required=required)
    ref = [SYSTEM, USER] + CORRECT[2:] + ([USER2] + TURN2_OK if two_turns else [])
    return Task.from_dict(
        {
            "task_id": "hand",
            "messages": [SYSTEM, USER],
            "tools": list(TOOL_SCHEMAS.values()),
            "reference_messages": ref,
            "checklist": [turn1, TURN2] if two_turns else [turn1],
            "ground_truth": {"initial_state": WORLD, "final_state": WORLD, "reply_facts": []},
        }
    )


CORRECT = [
    SYSTEM,
    USER,
    _call("find_customer", member="M5"),
    _tool("find_customer", FIND),
    _call("list_orders", customer_id="C3"),
    _tool("list_orders", LIST),
    _call("cancel_order", order_id="O23"),
    _tool("cancel_order", CANCEL),
    _reply("Order O23 is cancelled. Your balance is 150."),
]
TURN2_OK = [
    _call("transfer", from_id="A7", to_id="A2", amount=20),
    _tool("transfer", TRANSFER),
    _reply("Sent 20. Your balance is 130."),
]


def _replace(msgs, index, new):
    out = list(msgs)
    out[index] = new
    return out


def test_hand_written_responses_are_the_real_environment():
    env = DemoEnv()
    env.reset(_task())
    calls = [m["tool_calls"][0]["function"] for m in CORRECT if m.get("tool_calls")]
    results = env.step(calls)
    assert results == [FIND, LIST, CANCEL]
    assert env.step([TURN2_OK[0]["tool_calls"][0]["function"]]) == [TRANSFER]


CASES = {
    "correct": (CORRECT, 1.0),
    # Cancels the mug order (an id list_orders did return), with a rehearsed confirmation:
    # call O23 (0.2) and reply 150 (0.3) fail; consistency items pass.
    "wrong_id": (
        CORRECT[:6]
        + [
            _call("cancel_order", order_id="O41"),
            _tool("cancel_order", {"id": "O41", "status": "cancelled", "balance": 132}),
            _reply("Order O41 is cancelled. Your balance is 132."),
        ],
        0.5,
    ),
    # Same wrong id against the real environment: bad_status (a domain error, not a call
    # error), so nothing returns a balance: reply_from (0.1) fails as well.
    "wrong_id_real_env": (
        CORRECT[:6]
        + [
            _call("cancel_order", order_id="O41"),
            _tool(
                "cancel_order",
                {"error": {"code": "bad_status", "message": "order O41 is shipped"}},
            ),
            _reply("Sorry, order O41 cannot be cancelled."),
        ],
        0.4,
    ),
    # Correct calls, wrong number in the reply: reply_states (0.3) and reply_from (0.1) fail.
    "wrong_final_value": (
        _replace(CORRECT, 8, _reply("Order O23 is cancelled. Your balance is 140.")),
        0.6,
    ),
    "tool_error_midway": (
        CORRECT[:4]
        + [
            _call("list_orders", customer="C3"),
            _tool("list_orders", {"error": {"code": "bad_args", "message": "missing"}}),
        ]
        + CORRECT[6:],
        0.0,
    ),
    "unparseable_rehearsal": (_replace(CORRECT, 7, _tool("cancel_order", "cancelled, ok")), 0.0),
    # No find_customer: its call (0.1) and the customer_id consistency (0.1) fail.
    "missing_call": (CORRECT[:2] + CORRECT[4:], 0.8),
    # The rehearsal invents order O77 for the lamp and the actor uses it consistently: the
    # ground-truth cancel call fails (0.2), everything else passes.
    "rehearsed_other_id": (
        CORRECT[:4]
        + [
            _call("list_orders", customer_id="C3"),
            _tool("list_orders", {"orders": [{"id": "O77", "item": "lamp", "status": "open"}]}),
            _call("cancel_order", order_id="O77"),
            _tool("cancel_order", {"id": "O77", "status": "cancelled", "balance": 150}),
            _reply("Order O77 is cancelled. Your balance is 150."),
        ],
        0.8,
    ),
    # The rehearsal gets the arithmetic wrong (160, not 150) and the actor reports it:
    # consistency passes, the ground-truth value (0.3) fails.
    "rehearsed_other_balance": (
        CORRECT[:7]
        + [
            _tool("cancel_order", {"id": "O23", "status": "cancelled", "balance": 160}),
            _reply("Order O23 is cancelled. Your balance is 160."),
        ],
        0.7,
    ),
    # A domain error is an observation to recover from, not a call error.
    "recovers_from_not_found": (
        CORRECT[:6]
        + [
            _call("cancel_order", order_id="O99"),
            _tool("cancel_order", {"error": {"code": "not_found", "message": "no order O99"}}),
        ]
        + CORRECT[6:],
        1.0,
    ),
    # Stops before replying (turn limit): both reply items (0.3 + 0.1) fail.
    "no_final_reply": (CORRECT[:8], 0.6),
    # Both lookups in one message: find_customer's result is not visible to list_orders yet,
    # so the customer_id consistency item (0.1) fails.
    "parallel_lookup": (
        CORRECT[:2]
        + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": CORRECT[2]["tool_calls"] + CORRECT[4]["tool_calls"],
            },
            CORRECT[3],
            CORRECT[5],
        ]
        + CORRECT[6:],
        0.9,
    ),
    # Arguments as JSON strings (OpenAI message style) and thinking before the reply.
    "string_arguments_and_thinking": (
        [
            {
                **m,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": tc["function"]["name"],
                            "arguments": json.dumps(tc["function"]["arguments"]),
                        },
                    }
                    for tc in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in CORRECT[:8]
        ]
        + [_reply("<think>balance 120 + 30</think>Order O23 is cancelled. Balance: 150.")],
        1.0,
    ),
    # 150 inside 1500 is not a statement of 150.
    "number_inside_another": (_replace(CORRECT, 8, _reply("Your balance is 1500.")), 0.6),
    # Nothing after the instruction.
    "empty": (CORRECT[:2], 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_single_turn_scores(name):
    messages, expected = CASES[name]
    result = judge(_task(), messages)
    assert result.score == pytest.approx(expected, abs=1e-12), (name, result)
    assert 0.0 <= result.score <= 1.0
    if expected == 0.0 and name != "empty":
        assert result.call_error and result.ended_early_reason == "tool_error"
        assert result.passed == ((False,) * len(TURN1),)


def test_per_item_verdicts_of_rehearsed_other_id():
    result = judge(_task(), CASES["rehearsed_other_id"][0])
    # find, list, list<-find, cancel O23, cancel<-list, reply 150, reply<-cancel
    assert result.passed == ((True, True, True, False, True, True, True),)
    # Steps: find, list, cancel, reply; the cancel-consistency item holds at the cancel step.
    assert [row[4] for row in result.verdicts[0]] == [False, False, True, False]


def test_two_turns():
    task = _task(two_turns=True)
    ok = CORRECT + [USER2] + TURN2_OK
    assert judge(task, ok).score == pytest.approx(1.0)
    # Turn 2 hits a call error: turn 1 keeps its score, turn 2 scores 0.
    bad = CORRECT + [USER2, TURN2_OK[0], _tool("transfer", "oops")]
    r = judge(task, bad)
    assert r.per_turn == pytest.approx((1.0, 0.0)) and r.score == pytest.approx(0.5)
    # The episode stops after turn 1: turn 2 scores 0 (incomplete).
    r = judge(task, CORRECT)
    assert r.score == pytest.approx(0.5) and r.ended_early_reason == "incomplete"
    # A call error in turn 1 ends the episode: turn 2's messages are not judged.
    r = judge(task, CASES["tool_error_midway"][0] + [USER2] + TURN2_OK)
    assert r.score == 0.0 and r.per_turn == (0.0,) and r.ended_early_reason == "tool_error"


def test_integral_float_amount_is_the_integer():
    task = _task(two_turns=True)
    turn2 = [_call("transfer", from_id="A7", to_id="A2", amount=20.0)] + TURN2_OK[1:]
    assert judge(task, CORRECT + [USER2] + turn2).score == pytest.approx(1.0)
    turn2 = [_call("transfer", from_id="A7", to_id="A2", amount="20")] + TURN2_OK[1:]
    assert judge(task, CORRECT + [USER2] + turn2).score == pytest.approx((1.0 + 0.5) / 2)


def test_required_item_failure_ends_the_episode():
    task = _task(two_turns=True, required=True)
    wrong = CASES["wrong_id"][0] + [USER2] + TURN2_OK
    r = judge(task, wrong)
    assert r.per_turn == pytest.approx((0.5,))
    assert r.score == pytest.approx(0.25) and r.ended_early_reason == "required_item_failed"
    assert judge(_task(two_turns=True), wrong).score == pytest.approx((0.5 + 1.0) / 2)


def test_generated_oracles_score_one_and_perturbed_rehearsals_lose_ground_truth():
    for task in generate_tasks(seed=5, n=200, split="validation"):
        ref = list(task.reference_messages)
        assert judge(task, ref).score == pytest.approx(1.0), task.task_id
        # Rehearse the last result with a different balance and report it consistently.
        last = json.loads(ref[-2]["content"])
        fact = task.ground_truth["reply_facts"][0]
        if "balance" not in last or str(last["balance"]) != fact:
            continue
        last["balance"] += 1
        ref[-2] = {**ref[-2], "content": json.dumps(last)}
        ref[-1] = {"role": "assistant", "content": f"Your balance is {last['balance']}."}
        r = judge(task, ref)
        w = [it.weight for it in task.checklist[0] if it.rule["kind"] == "reply_states"]
        assert r.score == pytest.approx(1.0 - sum(w)), task.task_id


def test_unknown_rule_kind_is_a_clear_error():
    d = _task().to_dict()
    d["checklist"][0][0]["rule"] = {"kind": "vibes"}
    with pytest.raises(ValueError, match="vibes"):
        judge(Task.from_dict(d), CORRECT)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3),
    max_leaves=6,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "observation", None])},
    optional={
        "content": st.none() | st.text(max_size=20) | _json,
        "tool_calls": _json
        | st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": _json, "arguments": _json})}
            ),
            max_size=2,
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_message, max_size=8))
def test_model_produced_messages_never_crash(messages):
    r = judge(_task(two_turns=True), [SYSTEM, USER] + messages)
    assert 0.0 <= r.score <= 1.0
