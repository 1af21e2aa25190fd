"""The demo domain against an independent reference: a re-implementation of the documented
tool rules that reads the world only from the records table of the system turn."""

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.data.tasks import Task
from envace_jax.envs import CALL_ERROR_CODES, Environment, error_code
from envace_jax.envs.demo import (
    FAMILIES,
    SPLITS,
    STATE_CHANGING,
    TOOL_NAMES,
    DemoEnv,
    generate_tasks,
    oracle_messages,
)

N_TASKS = 1000


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(seed=0, n=N_TASKS, split="train")


# ------------------------------------------------------------------------------------------
# Independent reference: the documented rules applied to the table in the system message.


class RefShop:
    """Reads customers/accounts/orders from the system turn's records table (not from the
    task's ground truth) and answers calls by the rules the tool descriptions state."""

    def __init__(self, system_text: str, tools=None):
        self.tools = None if tools is None else {t["function"]["name"] for t in tools}
        self.customers, self.balance, self.orders = {}, {}, {}
        section = None
        for line in system_text.splitlines():
            if line.startswith("customers ("):
                section = "c"
            elif line.startswith("orders ("):
                section = "o"
            elif section == "c":
                member, cid, aid, bal = line.split()
                self.customers[cid] = {"member": member, "account": aid}
                self.balance[aid] = int(bal)
            elif section == "o":
                oid, cid, item, price, status = line.split()
                self.orders[oid] = [cid, item, int(price), status]

    def call(self, name, args):
        err = lambda code: {"error": {"code": code}}  # noqa: E731
        if self.tools is not None and name not in self.tools:
            return err("unknown_tool")
        if name == "find_customer":
            hits = [c for c, v in self.customers.items() if v["member"] == args["member"]]
            return (
                {"id": hits[0], "account": self.customers[hits[0]]["account"]}
                if hits
                else err("not_found")
            )
        if name == "list_orders":
            if args["customer_id"] not in self.customers:
                return err("not_found")
            rows = [(o, v) for o, v in self.orders.items() if v[0] == args["customer_id"]]
            return {"orders": [{"id": o, "item": v[1], "status": v[3]} for o, v in rows]}
        if name == "get_order":
            v = self.orders.get(args["order_id"])
            if v is None:
                return err("not_found")
            keys = ("customer", "item", "price", "status")
            return {"id": args["order_id"], **dict(zip(keys, v, strict=True))}
        if name == "get_balance":
            a = args["account_id"]
            return (
                {"account": a, "balance": self.balance[a]}
                if a in self.balance
                else err("not_found")
            )
        if name in ("cancel_order", "refund"):
            v = self.orders.get(args["order_id"])
            if v is None:
                return err("not_found")
            need, new = ("open", "cancelled") if name == "cancel_order" else ("shipped", "refunded")
            if v[3] != need:
                return err("bad_status")
            v[3] = new
            acct = self.customers[v[0]]["account"]
            self.balance[acct] += v[2]
            return {"id": args["order_id"], "status": new, "balance": self.balance[acct]}
        if name == "transfer":
            f, t, amt = args["from_id"], args["to_id"], args["amount"]
            if f not in self.balance or t not in self.balance:
                return err("not_found")
            if f == t:
                return err("same_account")
            if amt < 1:
                return err("bad_amount")
            if amt > self.balance[f]:
                return err("no_funds")
            self.balance[f] -= amt
            self.balance[t] += amt
            return {"from": f, "balance": self.balance[f]}
        raise AssertionError(name)


def _same(actual, expected):
    """Real response vs reference: error responses compare by code only."""
    if "error" in expected:
        return error_code(actual) == expected["error"]["code"]
    return actual == expected


def _world_values(task):
    """Ids, member numbers and integers present in the task (system table and instruction)."""
    text = task.messages[0]["content"] + " " + task.messages[1]["content"]
    strings = sorted(set(re.findall(r"\b[CAOM]\d+\b", text)))
    ints = sorted({int(w) for w in re.findall(r"\b\d+\b", text)})
    return strings, ints


def _params(name):
    from envace_jax.envs.demo import TOOL_SCHEMAS

    return TOOL_SCHEMAS[name]["function"]["parameters"]["properties"]


# ------------------------------------------------------------------------------------------


def test_oracle_succeeds_on_every_task_and_matches_reference(tasks):
    env = DemoEnv()
    wins = 0
    for task in tasks:
        ref = RefShop(task.messages[0]["content"])
        msgs = oracle_messages(task, env)
        assert msgs == list(task.reference_messages), task.task_id
        for m, r in zip(msgs[2:-1:2], msgs[3:-1:2], strict=True):
            call = m["tool_calls"][0]["function"]
            expected = ref.call(call["name"], call["arguments"])
            assert "error" not in expected, (task.task_id, call)
            assert json.loads(r["content"]) == expected, (task.task_id, call)
        # The reply must state a value the reference's observations produced.
        assert re.search(rf"\b{task.ground_truth['reply_facts'][0]}\b", msgs[-1]["content"])
        wins += env.success(msgs[-1]["content"])
        # The final world equals the reference's, read back the same way as the table.
        w = env.state()["world"]
        assert {a["id"]: a["balance"] for a in w["accounts"]} == ref.balance
        assert {o["id"]: o["status"] for o in w["orders"]} == {
            o: v[3] for o, v in ref.orders.items()
        }
    rate = wins / len(tasks)
    print(f"oracle success rate: {rate:.3f} over {len(tasks)} tasks")
    assert rate == 1.0


def test_success_needs_state_and_reply(tasks):
    env = DemoEnv()
    for task in tasks[:200]:
        env.reset(task)
        reply = task.ground_truth["final_reply"]
        assert not env.success(reply), "nothing done yet: the state must not match"
        oracle_messages(task, env)
        fact = task.ground_truth["reply_facts"][0]
        assert env.success(reply)
        assert not env.success(reply.replace(fact, str(int(fact) + 1)))
        assert not env.success(reply.replace(fact, fact + "0"))  # 150 is not stated by 1500


def test_random_calls_rarely_succeed(tasks):
    rng = random.Random(1234)
    env = DemoEnv()
    wins = 0
    for task in tasks:
        env.reset(task)
        strings, ints = _world_values(task)
        seen = list(ints)
        for _ in range(rng.randint(1, 4)):
            name = rng.choice([t["function"]["name"] for t in task.tools])
            args = {
                p: rng.choice(strings) if s["type"] == "string" else rng.choice(ints)
                for p, s in _params(name).items()
            }
            (result,) = env.step([{"name": name, "arguments": args}])
            assert error_code(result) not in CALL_ERROR_CODES  # well-formed calls
            if error_code(result) is None:
                seen += [v for v in result.values() if isinstance(v, int)]
        wins += env.success(f"Done. Your balance is {rng.choice(seen)}.")
    rate = wins / len(tasks)
    print(f"random-call success rate: {rate:.3f} over {len(tasks)} tasks")
    assert rate < 0.05


def test_family_spread_and_ground_truth_shape(tasks):
    fams = {f: n for n, group in FAMILIES.items() for f in group}
    counts = {n: 0 for n in FAMILIES}
    for task in tasks:
        gt = task.ground_truth
        assert fams[gt["family"]] == gt["n_calls"] == len(gt["solution"])
        counts[gt["n_calls"]] += 1
        # Every task needs a state change, and its final reply needs an observed value.
        assert any(c["name"] in STATE_CHANGING for c in gt["solution"])
        assert gt["final_state"] != gt["initial_state"]
        # Offered tools: the solution's plus one distractor, in the fixed order.
        offered = [t["function"]["name"] for t in task.tools]
        used = {c["name"] for c in gt["solution"]}
        assert used <= set(offered) and len(offered) == len(used) + 1
        assert offered == [n for n in TOOL_NAMES if n in offered]
    print("tasks by number of calls:", counts)
    assert all(c > 0.15 * len(tasks) for c in counts.values())
    # Member-based tasks name a member of their world, whom find_customer maps to ids.
    for t in tasks:
        text = t.messages[1]["content"]
        if text.startswith("I am member "):
            member = text.split()[3].rstrip(".")
            world = t.ground_truth["initial_state"]
            assert member in [c["member"] for c in world["customers"]], text


def test_tasks_are_valid_records_and_deterministic():
    a = generate_tasks(seed=3, n=50, split="validation")
    b = generate_tasks(seed=3, n=50, split="validation")
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    for t in a:
        assert Task.from_dict(json.loads(t.to_json())) == t
    c = generate_tasks(seed=4, n=50, split="validation")
    assert [t.to_json() for t in a] != [t.to_json() for t in c]


def test_splits_never_share_world_seeds():
    seeds = {
        split: {
            t.ground_truth["world_seed"] for s in (0, 1, 2) for t in generate_tasks(s, 100, split)
        }
        for split in SPLITS
    }
    assert all(len(v) == 300 for v in seeds.values())
    for i, x in enumerate(SPLITS):
        for y in SPLITS[i + 1 :]:
            assert not seeds[x] & seeds[y]
    with pytest.raises(ValueError, match="split"):
        generate_tasks(0, 1, split="dev")


def test_environment_is_deterministic_and_resets(tasks):
    rng = random.Random(7)
    env1, env2 = DemoEnv(), DemoEnv()
    assert isinstance(env1, Environment)
    for task in tasks[:100]:
        env1.reset(task)
        first = env1.state()
        env1.reset(task)
        assert env1.state() == first and first["n_calls"] == 0
        json.dumps(first)
        strings, ints = _world_values(task)
        calls = []
        for _ in range(6):
            name = rng.choice(TOOL_NAMES)
            calls.append(
                {
                    "name": name,
                    "arguments": {
                        p: rng.choice(strings) if s["type"] == "string" else rng.choice(ints)
                        for p, s in _params(name).items()
                    },
                }
            )
        env2.reset(task)
        r1, r2 = env1.step(calls), env2.step(calls)
        assert r1 == r2 and env1.state() == env2.state()
        assert env1.state()["n_calls"] == 6
        # Reference agreement on arbitrary (often failing) call sequences.
        ref = RefShop(task.messages[0]["content"], task.tools)
        assert all(
            _same(r, ref.call(c["name"], c["arguments"])) for r, c in zip(r1, calls, strict=True)
        )
        env1.reset(task)
        assert env1.state() == first


def _task_with(tasks, pred):
    return next(t for t in tasks if pred(t.ground_truth["initial_state"]))


def test_every_error_rule():
    env = DemoEnv()
    task = _task_with(
        generate_tasks(seed=0, n=50, split="train", extra_tools=len(TOOL_NAMES)),
        lambda w: {o["status"] for o in w["orders"]} >= {"open", "shipped"},
    )
    w = task.ground_truth["initial_state"]
    open_o = next(o["id"] for o in w["orders"] if o["status"] == "open")
    shipped_o = next(o["id"] for o in w["orders"] if o["status"] == "shipped")
    a0, a1 = w["accounts"][0], w["accounts"][1]
    cases = [
        ({"name": "fly", "arguments": {}}, "unknown_tool"),
        ({"name": None, "arguments": {}}, "unknown_tool"),
        ({"name": "get_order", "arguments": {}}, "bad_args"),
        ({"name": "get_order", "arguments": {"order_id": open_o, "x": 1}}, "bad_args"),
        ({"name": "get_order", "arguments": {"order_id": 203}}, "bad_args"),
        ({"name": "get_order", "arguments": ["O1"]}, "bad_args"),
        ({"name": "get_order", "arguments": "{not json"}, "bad_args"),
        (
            {
                "name": "transfer",
                "arguments": {"from_id": a0["id"], "to_id": a1["id"], "amount": True},
            },
            "bad_args",
        ),
        (
            {
                "name": "transfer",
                "arguments": {"from_id": a0["id"], "to_id": a1["id"], "amount": 5.5},
            },
            "bad_args",
        ),
        ({"name": "find_customer", "arguments": {"member": "M0"}}, "not_found"),
        ({"name": "list_orders", "arguments": {"customer_id": "C0"}}, "not_found"),
        ({"name": "get_order", "arguments": {"order_id": "O0"}}, "not_found"),
        ({"name": "get_balance", "arguments": {"account_id": "A0"}}, "not_found"),
        ({"name": "cancel_order", "arguments": {"order_id": "O0"}}, "not_found"),
        ({"name": "refund", "arguments": {"order_id": "O0"}}, "not_found"),
        ({"name": "cancel_order", "arguments": {"order_id": shipped_o}}, "bad_status"),
        ({"name": "refund", "arguments": {"order_id": open_o}}, "bad_status"),
        (
            {"name": "transfer", "arguments": {"from_id": "A0", "to_id": a1["id"], "amount": 1}},
            "not_found",
        ),
        (
            {"name": "transfer", "arguments": {"from_id": a0["id"], "to_id": "A0", "amount": 1}},
            "not_found",
        ),
        (
            {
                "name": "transfer",
                "arguments": {"from_id": a0["id"], "to_id": a0["id"], "amount": 1},
            },
            "same_account",
        ),
        (
            {
                "name": "transfer",
                "arguments": {"from_id": a0["id"], "to_id": a1["id"], "amount": 0},
            },
            "bad_amount",
        ),
        (
            {
                "name": "transfer",
                "arguments": {"from_id": a0["id"], "to_id": a1["id"], "amount": a0["balance"] + 1},
            },
            "no_funds",
        ),
    ]
    env.reset(task)
    before = env.state()["world"]
    results = env.step([c for c, _ in cases])
    for (call, code), result in zip(cases, results, strict=True):
        assert error_code(result) == code, (call, result)
        assert set(result) == {"error"} and set(result["error"]) == {"code", "message"}
        json.dumps(result)
    assert env.state()["world"] == before, "errors never change the world"
    # An integral float is a JSON-schema integer.
    call = {"from_id": a0["id"], "to_id": a1["id"], "amount": 5.0}
    (paid,) = env.step([{"name": "transfer", "arguments": call}])
    assert paid == {"from": a0["id"], "balance": a0["balance"] - 5}
    # Arguments given as a JSON string (OpenAI message style) are accepted.
    (ok,) = env.step([{"name": "get_order", "arguments": json.dumps({"order_id": open_o})}])
    assert ok["id"] == open_o


def test_tools_outside_the_task_are_unknown(tasks):
    env = DemoEnv()
    task = tasks[0]
    narrowed = Task.from_dict({**task.to_dict(), "tools": [task.tools[0]]})
    env.reset(narrowed)
    (r,) = env.step([{"name": task.tools[1]["function"]["name"], "arguments": {}}])
    assert error_code(r) == "unknown_tool"


def test_use_before_reset_is_a_clear_error():
    with pytest.raises(RuntimeError, match="reset"):
        DemoEnv().state()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=12), ch, max_size=4),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(TOOL_NAMES + ("nope", "")) | st.text(max_size=10),
    args=_json
    | st.fixed_dictionaries(
        {},
        optional={
            k: st.text(max_size=6) | st.integers(-5, 500) | _json
            for k in ("name", "customer_id", "order_id", "account_id", "from_id", "to_id", "amount")
        },
    ),
)
def test_model_calls_never_raise(name, args):
    task = generate_tasks(0, 1, "test")[0]
    env = DemoEnv()
    env.reset(task)
    (r,) = env.step([{"name": name, "arguments": args}])
    assert isinstance(r, dict)
    json.dumps(r)


def test_tools_are_described_in_the_system_turn_or_the_template():
    """By default a demo task lists its tools compactly in the system turn and asks prompts not
    to render the template's JSON-schema block; either way the schemas stay for validation."""
    compact = generate_tasks(5, 4, "train")
    full = generate_tasks(5, 4, "train", tools_in_system=False)
    for a, b in zip(compact, full, strict=True):
        assert a.tools == b.tools and a.tools
        assert a.template_tools is None and b.template_tools == list(b.tools)
        system = a.messages[0]["content"]
        for tool in a.tools:
            fn = tool["function"]
            args = ", ".join(fn["parameters"]["properties"])
            assert f"{fn['name']}({args}): {fn['description']}" in system
        assert "tools:" not in b.messages[0]["content"]
        # Same world, instruction and ground truth either way.
        assert a.messages[1] == b.messages[1] and a.ground_truth == b.ground_truth
