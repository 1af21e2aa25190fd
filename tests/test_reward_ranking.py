"""The demo checklist reward ranks like success: on every task, each successful trajectory scores
above every failed one. Trajectories are sampled by random edits of the oracle's calls and
reply (drop, repeat, reorder, re-argument, insert, wrong reply, no reply), executed in the real
environment, and judged by the rule judge; success is the environment's own test."""

from __future__ import annotations

import json
import random

import pytest

from envace_jax.envs import error_code
from envace_jax.envs.base import is_call_error, result_text
from envace_jax.envs.demo import STATE_CHANGING, DemoEnv, generate_tasks
from envace_jax.rewards.rule_judge import judge


def _values(world):
    """Every id and number in a world (what a sampled argument may be)."""
    out = []
    for table in world.values():
        for row in table:
            out += [v for v in row.values() if isinstance(v, (str, int))]
    return out


def _branches(task):
    """Every branch's (action calls, reply) of `task`'s family after its lookups: the right
    one and the wrong ones (whose change the world refuses, or whose reply is wrong)."""
    gt = task.ground_truth
    target = gt["default_call"]["arguments"]
    if gt["family"].startswith("close"):
        oid = target["order_id"]
        out = [
            ([{"name": tool, "arguments": {"order_id": oid}}], gt["final_reply"])
            for tool in ("cancel_order", "refund")
        ]
        out += [([], f"Order {oid} is already {status}.") for status in ("cancelled", "refunded")]
    else:
        out = [
            ([gt["default_call"]], gt["final_reply"]),
            ([], f"Account {target['from_id']} is frozen."),
        ]
    out.append(([gt["default_call"]], gt["refused_reply"]))  # the imperfect demonstrator
    return out


def _edit(rng, task, calls, reply):
    """One random edit of (calls, reply)."""
    calls = [dict(c, arguments=dict(c["arguments"])) for c in calls]
    world = task.ground_truth["initial_state"]
    tools = [t["function"]["name"] for t in task.tools]
    kinds = ("drop", "repeat", "swap", "argument", "insert", "reply", "no_reply", "branch")
    kind = rng.choice(kinds)
    if kind == "branch":  # another branch after the lookups (or the same one)
        lookups = [c for c in calls if c["name"] not in STATE_CHANGING]
        action, reply = rng.choice(_branches(task))
        calls = lookups + [dict(c, arguments=dict(c["arguments"])) for c in action]
    elif kind == "drop" and calls:
        calls.pop(rng.randrange(len(calls)))
    elif kind == "repeat" and calls:
        i = rng.randrange(len(calls))
        calls.insert(i, dict(calls[i]))
    elif kind == "swap" and len(calls) > 1:
        i, j = rng.sample(range(len(calls)), 2)
        calls[i], calls[j] = calls[j], calls[i]
    elif kind == "argument" and calls:
        c = rng.choice(calls)
        key = rng.choice(sorted(c["arguments"]))
        c["arguments"][key] = rng.choice(_values(world) + [rng.randint(1, 99)])
    elif kind == "insert":
        name = rng.choice(tools)
        schema = next(t for t in task.tools if t["function"]["name"] == name)
        args = {
            k: rng.choice(_values(world)) for k in schema["function"]["parameters"]["properties"]
        }
        calls.insert(rng.randrange(len(calls) + 1), {"name": name, "arguments": args})
    elif kind == "reply":
        reply = f"Done. Your balance is {rng.randint(0, 150)}."
    elif kind == "no_reply":
        reply = None
    return calls, reply


def _play(task, calls, reply):
    """(messages, success) of playing `calls` then `reply` in a fresh real environment; a call
    error fails the episode, as it does in `rollout.real_env`."""
    env = DemoEnv()
    env.reset(task)
    messages = [dict(m) for m in task.messages]
    call_error = False
    for c in calls:
        result = env.step([c])[0]
        call_error |= is_call_error(result)
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"function": dict(c)}]})
        messages.append({"role": "tool", "name": c["name"], "content": result_text(result)})
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    success = reply is not None and not call_error and env.success(reply)
    return messages, success


@pytest.mark.parametrize("seed", [0, 1])
def test_every_success_scores_above_every_failure_of_its_task(seed):
    rng = random.Random(seed)
    tasks = generate_tasks(seed, 48, "validation")
    pairs = successes = failures = 0
    for task in tasks:
        gt = task.ground_truth
        scored = []
        for _ in range(60):
            calls, reply = list(gt["solution"]), gt["final_reply"]
            for _ in range(rng.choice((0, 1, 1, 2, 3))):
                calls, reply = _edit(rng, task, calls, reply)
            messages, success = _play(task, calls, reply)
            scored.append((judge(task, messages).score, success, json.dumps(calls), reply))
        ok = [s for s in scored if s[1]]
        bad = [s for s in scored if not s[1]]
        assert ok, task.task_id  # the unedited oracle is among the samples
        if bad:
            worst_ok, best_bad = min(ok), max(bad)
            assert worst_ok[0] > best_bad[0], (task.task_id, worst_ok, best_bad)
        pairs += len(ok) * len(bad)
        successes += len(ok)
        failures += len(bad)
    # Both kinds are common, so the property is checked on many pairs.
    assert successes > 300 and failures > 1000 and pairs > 20000


def test_domain_errors_recovered_from_still_succeed_and_score_full():
    """A failing call that gets a domain error, followed by the right call, still succeeds (the
    recovery demonstrations rely on it), and a call error fails the episode."""
    task = next(t for t in generate_tasks(3, 40, "validation") if t.ground_truth["n_calls"] == 1)
    call = task.ground_truth["solution"][0]
    missing = {**call, "arguments": {**call["arguments"]}}
    key = next(k for k, v in sorted(missing["arguments"].items()) if isinstance(v, str))
    missing["arguments"][key] = "X9"
    messages, success = _play(task, [missing, call], task.ground_truth["final_reply"])
    assert error_code(json.loads(messages[-4]["content"])) == "not_found"
    assert success and judge(task, messages).score == pytest.approx(1.0)
    bad_args = {"name": call["name"], "arguments": {"nope": 1}}
    messages, success = _play(task, [bad_args, call], task.ground_truth["final_reply"])
    assert not success and judge(task, messages).score == 0.0


def test_a_refused_change_fails_even_when_the_right_one_follows():
    """Trying the wrong branch's change costs the task: the world refuses it, and the right
    change after it no longer succeeds, nor scores as one."""
    for task in generate_tasks(4, 60, "validation"):
        gt = task.ground_truth
        if gt["branch"] not in ("shipped", "frozen"):
            continue
        *lookups, action = gt["solution"] if gt["branch"] == "shipped" else (*gt["solution"], None)
        wrong = gt["default_call"]  # cancel a shipped order / pay from a frozen account
        calls = [*lookups, wrong] + ([action] if action else [])
        messages, success = _play(task, calls, gt["final_reply"])
        assert error_code(json.loads(messages[-2 - 2 * bool(action)]["content"])) is not None
        assert not success and judge(task, messages).score < 1.0 - 0.3
