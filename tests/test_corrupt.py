"""Corrupted copies of the demo world (the sensitivity control), against the real environment:
with corruption off they answer call for call as it does; 'redrawn' changes the statuses and
nothing else; 'optimist' makes the changes the real world refuses, by the same rules;
'guesser' shows the redrawn statuses and refuses nothing; 'blind' redraws every task's."""

import collections
import random

from envace_jax.envs import error_code
from envace_jax.envs.base import CORRUPTIONS
from envace_jax.envs.demo import STATE_CHANGING, TOOL_NAMES, DemoEnv, generate_tasks
from envace_jax.envs.demo.corrupt import CorruptedEnv, corrupted_envs, lie, redraw
from envace_jax.envs.registry import domain

TASKS = generate_tasks(2, 300, "train")


def _random_calls(rng, task, n=8):
    world = task.ground_truth["initial_state"]
    ids = [r["id"] for t in ("customers", "accounts", "orders") for r in world[t]]
    ids += [c["member"] for c in world["customers"]]
    calls = []
    for _ in range(n):
        name = rng.choice(TOOL_NAMES)
        args = {
            "find_customer": lambda: {"member": rng.choice(ids)},
            "list_orders": lambda: {"customer_id": rng.choice(ids)},
            "get_order": lambda: {"order_id": rng.choice(ids)},
            "get_balance": lambda: {"account_id": rng.choice(ids)},
            "cancel_order": lambda: {"order_id": rng.choice(ids)},
            "refund": lambda: {"order_id": rng.choice(ids)},
            "transfer": lambda: {
                "from_id": rng.choice(ids),
                "to_id": rng.choice(ids),
                "amount": rng.randint(1, 60),
            },
        }[name]()
        calls.append({"name": name, "arguments": args})
    return calls


def _all_tools(task):
    from envace_jax.data.tasks import Task
    from envace_jax.envs.demo import TOOL_SCHEMAS

    return Task.from_dict({**task.to_dict(), "tools": list(TOOL_SCHEMAS.values())})


def test_the_domain_offers_every_corruption():
    make = domain("demo").corrupted_envs
    for kind in CORRUPTIONS:
        assert isinstance(make(kind, 1.0, 0)(), CorruptedEnv)


def test_corruption_off_is_the_real_world_call_for_call():
    rng = random.Random(0)
    for kind in CORRUPTIONS:
        make = corrupted_envs(kind, 0.0, seed=3)
        for task in TASKS[:100]:
            task = _all_tools(task)
            real, sim = DemoEnv(), make()
            real.reset(task)
            sim.reset(task)
            calls = _random_calls(rng, task)
            assert sim.step(calls) == real.step(calls)
            assert sim.state() == real.state()


def test_redrawn_changes_statuses_only_from_the_branch_distribution():
    rng = random.Random(1)
    orders, accounts = collections.Counter(), collections.Counter()
    differs = 0
    for task in TASKS:
        world = task.ground_truth["initial_state"]
        new = redraw(world, rng)
        strip = lambda w: [
            {k: v for k, v in r.items() if k != "status"} for t in sorted(w) for r in w[t]
        ]
        assert strip(new) == strip(world) and world == task.ground_truth["initial_state"]
        orders.update(o["status"] for o in new["orders"])
        accounts.update(a["status"] for a in new["accounts"])
        differs += new != world
    n = sum(orders.values())
    # open : shipped : cancelled : refunded = 2 : 2 : 1 : 1, active : frozen = 1 : 1.
    for status, share in (("open", 1 / 3), ("shipped", 1 / 3), ("cancelled", 1 / 6)):
        assert abs(orders[status] / n - share) < 0.04, orders
    assert abs(accounts["frozen"] / sum(accounts.values()) - 0.5) < 0.05, accounts
    assert differs > 0.9 * len(TASKS)


def test_redrawn_world_answers_its_own_lookups_consistently():
    """In a hidden task, a redrawn episode's lookup shows the redrawn status, and its changes
    follow the rules from that status (a self-consistent wrong world, as a rehearser that
    guessed writes); a visible task's world, whose statuses its context shows, stays."""
    make = corrupted_envs("redrawn", 1.0, seed=5)
    wrong = hidden = 0
    for task in TASKS[:400]:
        gt = task.ground_truth
        if task.metadata["stratum"] == "visible":
            real, sim = DemoEnv(), make()
            real.reset(task)
            sim.reset(task)
            assert sim.state() == real.state()
            continue
        hidden += 1
        env = make()
        env.reset(task)
        lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
        shown = env.step(lookups)[-1]
        status = shown.get("status") or next(
            o["status"]
            for o in shown["orders"]
            if o["id"] == gt["default_call"]["arguments"].get("order_id")
        )
        wrong += status != gt["branch"]
        (result,) = env.step([gt["default_call"]])
        accepts = {"cancel_order": ("open",), "transfer": ("active",)}[gt["default_call"]["name"]]
        assert (error_code(result) is None) == (status in accepts), (task.task_id, status, result)
    assert 0.4 * hidden < wrong < 0.8 * hidden  # redrawn independently of the task's branch


def test_optimist_never_refuses_a_change_and_keeps_the_rules_of_its_effects():
    make = corrupted_envs("optimist", 1.0, seed=0)
    refused_by_real = 0
    for task in TASKS[:200]:
        gt = task.ground_truth
        real, sim = DemoEnv(), make()
        real.reset(task)
        sim.reset(task)
        (r,), (s,) = real.step([gt["default_call"]]), sim.step([gt["default_call"]])
        assert error_code(s) is None and sim.state()["refused"] == []
        if error_code(r) is not None:
            refused_by_real += 1
            assert set(s) == set(_success_of(gt["default_call"]["name"]))
        else:
            assert s == r
    assert refused_by_real > 50


def _success_of(name):
    return {"cancel_order": ("id", "status", "balance"), "transfer": ("from", "balance")}[name]


def test_guesser_shows_the_redrawn_statuses_and_refuses_nothing():
    """A guesser's hidden-task lookups show what the redrawn world (same draws) shows, a
    visible task's lookups show the real world, and no change is refused in either."""
    guess, redrawn = corrupted_envs("guesser", 1.0, seed=4), corrupted_envs("redrawn", 1.0, seed=4)
    refused_by_redrawn = 0
    for task in TASKS[:200]:
        gt = task.ground_truth
        g, r, real = guess(), redrawn(), DemoEnv()
        for env in (g, r, real):
            env.reset(task)
        lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
        same_as = r if task.metadata["stratum"] == "hidden" else real
        assert g.step(lookups) == same_as.step(lookups), task.task_id
        (result,), (theirs,) = g.step([gt["default_call"]]), r.step([gt["default_call"]])
        assert error_code(result) is None and g.state()["refused"] == [], task.task_id
        refused_by_redrawn += error_code(theirs) is not None
    assert refused_by_redrawn > 50


def test_blind_redraws_visible_tasks_too():
    """A blind world redraws the statuses of every task, including those the prompt shows,
    by the same draws as a redrawn world makes for a hidden task."""
    blind = corrupted_envs("blind", 1.0, seed=6)
    changed = visible = 0
    for task in TASKS[:200]:
        env, real = blind(), DemoEnv()
        env.reset(task)
        real.reset(task)
        if task.metadata["stratum"] == "visible":
            visible += 1
            changed += env.state() != real.state()
    assert changed > 0.8 * visible


def test_liar_shows_a_wrong_status_in_every_task_and_keeps_its_own_rules():
    """A liar's lookups show, in every task, a status whose branch is not the task's (a fixed
    map, so no episode lands on the truth by chance), and it refuses the task's own change
    exactly when that status rules it out: the reward can pay only for telling the user."""
    make = corrupted_envs("liar", 1.0, seed=7)
    refused = told = 0
    for task in TASKS[:300]:
        gt = task.ground_truth
        env, real = make(), DemoEnv()
        env.reset(task)
        real.reset(task)
        strip = lambda w: [
            {k: v for k, v in r.items() if k != "status"} for t in sorted(w) for r in w[t]
        ]
        world = task.ground_truth["initial_state"]
        assert strip(lie(world)) == strip(world)
        for kind in ("orders", "accounts"):
            for ours, theirs in zip(lie(world)[kind], world[kind], strict=True):
                closed = ("cancelled", "refunded")
                same = ours["status"] == theirs["status"] or {
                    ours["status"],
                    theirs["status"],
                } <= set(closed)
                assert not same, (task.task_id, ours, theirs)
        change = [c for c in gt["solution"] if c["name"] in STATE_CHANGING]
        if change:
            (result,) = env.step(change[:1])
            refused += error_code(result) is not None
        else:
            told += 1
    assert refused == 300 - told and told > 50
