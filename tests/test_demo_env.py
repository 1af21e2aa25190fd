"""The demo domain against an independent reference: a re-implementation of the documented
tool rules that reads the world from the records table of the system turn (and, for a task of
the hidden stratum, whose table leaves the statuses out, the statuses from its initial state)."""

import collections
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
    FAMILY_TOOLS,
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
    task's ground truth) and answers calls by the rules the tool descriptions state. A table
    without statuses (the hidden stratum) takes them from `statuses` ({id: status})."""

    def __init__(self, system_text: str, tools=None, statuses=None):
        self.tools = None if tools is None else {t["function"]["name"] for t in tools}
        self.customers, self.balance, self.orders, self.status = {}, {}, {}, {}
        section = None
        for line in system_text.splitlines():
            if line.startswith("customers ("):
                section = "c"
            elif line.startswith("orders ("):
                section = "o"
            elif section == "c":
                member, cid, aid, bal, *status = line.split()
                self.customers[cid] = {"member": member, "account": aid}
                self.balance[aid] = int(bal)
                self.status[aid] = status[0] if status else statuses[aid]
            elif section == "o":
                oid, cid, item, price, *status = line.split()
                self.orders[oid] = [cid, item, int(price), status[0] if status else statuses[oid]]

    @classmethod
    def of(cls, task, tools=None):
        """The reference for `task`: its table, and its initial statuses if the table hides
        them (checked against the task's recorded stratum)."""
        hidden = task.metadata["stratum"] == "hidden"
        table = task.messages[0]["content"]
        assert ("status):" not in table) == hidden, task.task_id
        world = task.ground_truth["initial_state"]
        statuses = {r["id"]: r["status"] for r in world["orders"] + world["accounts"]}
        return cls(table, tools, statuses if hidden else None)

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
                {"account": a, "balance": self.balance[a], "status": self.status[a]}
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
            if self.status[f] == "frozen":
                return err("frozen")
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
        ref = RefShop.of(task)
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


# A reply word and one that states something else.
_OTHER_WORD = {
    "already": "now",
    "cancelled": "refunded",
    "refunded": "cancelled",
    "frozen": "active",
}


def test_success_needs_state_and_reply(tasks):
    env = DemoEnv()
    for task in tasks[:200]:
        env.reset(task)
        gt = task.ground_truth
        reply = gt["final_reply"]
        changes = any(c["name"] in STATE_CHANGING for c in gt["solution"])
        # A branch that only replies needs no change; the others must make theirs.
        assert env.success(reply) == (not changes), task.task_id
        oracle_messages(task, env)
        assert env.success(reply)
        for fact in gt["reply_facts"]:
            wrong = str(int(fact) + 1) if fact.isdigit() else _OTHER_WORD[fact]
            assert not env.success(reply.replace(fact, wrong)), (task.task_id, fact)
            if fact.isdigit():
                assert not env.success(reply.replace(fact, fact + "0"))  # 150 is not 1500


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
    counts = collections.Counter()
    for task in tasks:
        gt, meta = task.ground_truth, task.metadata
        assert gt["family"] == meta["family"] in FAMILIES
        assert gt["n_calls"] == meta["n_calls"] == len(gt["solution"])
        assert gt["branch"] == meta["branch"] and gt["stratum"] == meta["stratum"]
        counts[gt["family"], gt["branch"]] += 1
        # The last lookup's result shows the branch's status (in a listing, the named order's).
        lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
        shown = gt["observations"][len(lookups) - 1]
        statuses = [shown.get("status")] + [o["status"] for o in shown.get("orders", ())]
        assert gt["branch"] in statuses, task.task_id
        # A change exactly when the branch makes one; the reply needs an observed value.
        changed = gt["final_state"] != gt["initial_state"]
        assert changed == any(c["name"] in STATE_CHANGING for c in gt["solution"])
        assert changed == (gt["branch"] in ("open", "shipped", "active"))
        # Offered tools: every branch's, in the fixed order, so they do not tell the branch.
        offered = [t["function"]["name"] for t in task.tools]
        assert set(offered) == set(FAMILY_TOOLS[gt["family"]])
        assert offered == [n for n in TOOL_NAMES if n in offered]
    print("tasks by family and branch:", sorted(counts.items()))
    for family in FAMILIES:
        branches = {b for f, b in counts if f == family}
        want = {"open", "shipped", "cancelled", "refunded"} if family.startswith("close") else None
        assert branches == (want or {"active", "frozen"}), family
    # Member-based tasks name a member of their world, whom find_customer maps to ids.
    for t in tasks:
        text = t.messages[1]["content"]
        if text.startswith("I am member "):
            member = text.split()[3].rstrip(".")
            world = t.ground_truth["initial_state"]
            assert member in [c["member"] for c in world["customers"]], text


def test_strata_show_or_hide_every_status(tasks):
    """A visible task's table shows each account's and order's status on its row; a hidden
    task's table shows none (only a lookup does)."""
    strata = collections.Counter(t.metadata["stratum"] for t in tasks)
    assert set(strata) == {"hidden", "visible"} and min(strata.values()) > 0.4 * len(tasks)
    for task in tasks:
        world = task.ground_truth["initial_state"]
        table = task.messages[0]["content"].split("customers (")[1]
        rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
        hidden = task.metadata["stratum"] == "hidden"
        for c in world["customers"]:
            status = next(a["status"] for a in world["accounts"] if a["id"] == c["account"])
            assert rows[c["member"]][-1] == (str(_balance(world, c)) if hidden else status)
        for o in world["orders"]:
            assert rows[o["id"]][-1] == (str(o["price"]) if hidden else o["status"])
        words = set(table.split())
        assert hidden == words.isdisjoint({"open", "shipped", "cancelled", "refunded", "frozen"})


def _balance(world, customer):
    return next(a["balance"] for a in world["accounts"] if a["id"] == customer["account"])


def _play(task, calls, reply):
    """Success of playing `calls` (one per message), then `reply`, in a fresh environment."""
    env = DemoEnv()
    env.reset(task)
    results = [env.step([c])[0] for c in calls]
    return env.success(reply), results


def test_every_branch_both_ways(tasks):
    """Each family's branches, executed in the real environment after the task's lookups: the
    task's own branch succeeds; every other branch fails, its change refused (and a refusal
    fails the task even when the right change follows) or its reply wrong."""
    seen = collections.Counter()
    for task in tasks[:400]:
        gt = task.ground_truth
        lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
        target = gt["default_call"]["arguments"]
        if gt["family"].startswith("close"):
            oid = target["order_id"]
            branches = {
                "cancel": ([{"name": "cancel_order", "arguments": {"order_id": oid}}], ""),
                "refund": ([{"name": "refund", "arguments": {"order_id": oid}}], ""),
                "reply": ([], f"Order {oid} is already {gt['branch']}."),
            }
            own = {"open": "cancel", "shipped": "refund"}.get(gt["branch"], "reply")
        else:
            branches = {
                "transfer": ([{"name": "transfer", "arguments": target}], ""),
                "reply": ([], f"Account {target['from_id']} is frozen."),
            }
            own = "transfer" if gt["branch"] == "active" else "reply"
        for name, (calls, reply) in branches.items():
            ok, results = _play(task, lookups + calls, reply or gt["final_reply"])
            assert ok == (name == own), (task.task_id, name, results)
            if calls and name != own:  # the wrong change is refused, and costs the task
                assert error_code(results[-1]) in ("bad_status", "frozen"), results[-1]
                fix = branches[own][0]
                assert not _play(task, lookups + calls + fix, gt["final_reply"])[0]
            seen[gt["family"], name == own] += 1
    assert all(seen[f, True] and seen[f, False] for f in FAMILIES), seen


def test_held_out_tasks_never_repeat_training_or_each_other():
    """Validation and test tasks share no task (system turn and instruction) with each other or
    with the training tasks, beyond distinct world seeds."""
    content = lambda ts: {(t.messages[0]["content"], t.messages[1]["content"]) for t in ts}
    train = content(generate_tasks(0, 4096, "train"))
    for seed in (0, 1, 2):
        val = content(generate_tasks(seed, 512, "validation"))
        test = content(generate_tasks(seed, 512, "test"))
        assert not val & test and not val & train and not test & train


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
        ref = RefShop.of(task, task.tools)
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
        lambda w: (
            {o["status"] for o in w["orders"]} >= {"open", "shipped"}
            and [a["status"] for a in w["accounts"]].count("active") == 2
            and "frozen" in [a["status"] for a in w["accounts"]]
        ),
    )
    w = task.ground_truth["initial_state"]
    open_o = next(o["id"] for o in w["orders"] if o["status"] == "open")
    shipped_o = next(o["id"] for o in w["orders"] if o["status"] == "shipped")
    a0, a1 = [a for a in w["accounts"] if a["status"] == "active"]
    frozen = next(a for a in w["accounts"] if a["status"] == "frozen")
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
        (
            {
                "name": "transfer",
                "arguments": {"from_id": frozen["id"], "to_id": a1["id"], "amount": 1},
            },
            "frozen",
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
    # Every change the world refused is recorded, in order; a call error never reached it.
    assert env.state()["refused"] == [
        c for c, code in cases if c["name"] in STATE_CHANGING and code not in CALL_ERROR_CODES
    ]
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
