"""Test-time rehearsal: rule assessor, plan selection, memory format and insertion, warm-start
memory demonstrations, rehearsals that never touch the real environment, both modes with any
loadable model, and the rehearsal_eval job on a smoke checkpoint."""

import json
import random
import re

import numpy as np
import pytest

from envace_jax.envs.base import result_text
from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks
from envace_jax.rl.batch import STATUS_FINISHED, STATUS_INVALID, STATUS_TRUNCATED
from envace_jax.rollout import memory as mem
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.text.trajectory import Role


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(7, 120, "train")


def executed(task, calls):
    """(calls, responses) of `calls` run in a fresh real environment."""
    env = DemoEnv()
    env.reset(task)
    return tuple(calls), tuple(
        result_text(env.step([{"name": n, "arguments": a}])[0]) for n, a in calls
    )


def oracle_attempt(task):
    calls = [(c["name"], c["arguments"]) for c in task.ground_truth["solution"]]
    calls, responses = executed(task, calls)
    return mem.Attempt(calls, responses, task.ground_truth["final_reply"], STATUS_FINISHED)


# ------------------------------------------------------------------------------ assessor


def test_rule_assessor_passes_every_oracle_trajectory(tasks):
    """Executed oracle solutions are correct by construction: no problem may be reported."""
    for task in tasks:
        assert mem.assess(task, oracle_attempt(task)).problems == (), task.task_id


def test_rule_assessor_flags_env_errors_ungrounded_values_and_unfinished(tasks):
    task = next(t for t in tasks if t.ground_truth["family"] == "cancel")
    order = task.ground_truth["solution"][0]["arguments"]["order_id"]
    world = task.ground_truth["initial_state"]
    other = next(o for o in world["orders"] if o["status"] != "open" and o["id"] != order)
    # The real environment refuses to cancel an order that is not open.
    calls, responses = executed(task, [("cancel_order", {"order_id": other["id"]})])
    assert "bad_status" in responses[0]
    got = mem.assess(task, mem.Attempt(calls, responses, "Done.", STATUS_FINISHED))
    assert any("got bad_status" in p for p in got.problems)
    # The id is in no user message and no earlier result: ungrounded.
    assert any(f'order_id="{other["id"]}" is from no result' in p for p in got.problems)
    # A reply number that no result gave.
    good = oracle_attempt(task)
    lie = dataclass_replace(good, final_reply="Your balance is 123456.")
    assert mem.assess(task, lie).problems == ("reply states 123456, which no result gave",)
    unfinished = dataclass_replace(good, final_reply=None, status=STATUS_TRUNCATED)
    assert mem.assess(task, unfinished).problems == ("no final reply",)
    assert mem.assess(task, unfinished, require_finish=False).ok
    invalid = dataclass_replace(good, status=STATUS_INVALID, reason="action: bad_json")
    assert mem.assess(task, invalid).problems[0].startswith("invalid message (action: bad_json")


def dataclass_replace(x, **kw):
    import dataclasses

    return dataclasses.replace(x, **kw)


# ------------------------------------------------------------------- selection and memory


def _attempt(calls, status=STATUS_FINISHED, reply="ok"):
    return mem.Attempt(tuple(calls), tuple("{}" for _ in calls), reply, status)


def test_selection_prefers_fewest_problems_then_majority_then_earliest():
    a = _attempt([("f", {"x": 1})])
    b = _attempt([("f", {"x": 2})])
    bad = mem.Assessment(("p",), "r")
    ok = mem.Assessment()
    # b is the majority, but only a has no problem.
    s = mem.select_plan([b, a, b, b], [bad, ok, bad, bad])
    assert (s.index, s.support, s.total) == (1, 1, 4)
    # All clean: the plan most attempts made, its first occurrence.
    s = mem.select_plan([a, b, b, a, b], [ok] * 5)
    assert (s.index, s.support, s.total) == (1, 3, 5)
    # A tie in votes goes to the earliest.
    s = mem.select_plan([b, a], [ok, ok])
    assert s.index == 0
    # Invalid before any call: not usable.
    dead = _attempt([], status=STATUS_INVALID, reply=None)
    assert mem.select_plan([dead, dead], [bad, bad]).index is None


def test_structured_memory_lists_the_selected_plan_and_the_notes(tasks):
    task = next(t for t in tasks if t.ground_truth["n_calls"] >= 2)
    good = oracle_attempt(task)
    wrong_calls = [(n, dict(a)) for n, a in good.calls]
    key = next(iter(wrong_calls[0][1]))
    wrong_calls[0][1][key] = "Zed"
    wrong = mem.Attempt(*executed(task, wrong_calls), None, STATUS_TRUNCATED)
    attempts = [wrong, good, good]
    assessments = [mem.assess(task, a) for a in attempts]
    text = mem.render_memory(attempts, assessments)
    lines = text.splitlines()
    assert lines[0] == mem.HEADER
    assert lines[1] == "plan (2 of 3 rehearsals):"
    plan = [ln for ln in lines if re.match(r"^\d+\. ", ln)]
    assert len(plan) == len(good.calls)
    for k, (line, (name, args), resp) in enumerate(
        zip(plan, good.calls, good.responses, strict=True), 1
    ):
        m = re.fullmatch(rf"{k}\. (\w+) (\{{.*\}}) -> (.*)", line)
        assert m and m.group(1) == name
        assert json.loads(m.group(2)) == args and json.loads(m.group(3)) == json.loads(resp)
    notes = lines[lines.index("notes:") + 1 :]
    assert len(notes) == 1 and "Zed" in notes[0] and "no final reply" in notes[0]
    assert mem.render_memory([], []) == f"{mem.HEADER}\nplan: none"


def test_insert_memory_appends_to_the_instruction_only(tasks):
    task = tasks[0]
    out = mem.insert_memory(task.messages, "MEMORY")
    assert out[:-1] == list(task.messages[:-1])
    assert out[-1]["content"] == task.messages[-1]["content"] + "\n\nMEMORY"
    assert task.messages[-1]["content"] != out[-1]["content"]  # the task is not mutated
    assert mem.insert_memory(task.messages, "") == list(task.messages)


def test_clean_generated_removes_chat_control_and_thinking():
    text = "<think>x</think>plan: <tool_call>a</tool_call> b<|im_end|>\n<|im_start|>user"
    assert mem.clean_generated(text) == "plan: a b\nuser"


# --------------------------------------------------------------------------- warm start


def _segment_texts(tok, enc):
    out = []
    for s in range(1, enc.num_segments + 1):
        idx = enc.segments == s
        out.append((int(enc.roles[idx][0]), tok.decode(enc.ids[idx].tolist())))
    return out


def test_memory_demonstrations_keep_the_targets_and_put_the_memory_in_the_prompt(tok, tasks):
    some = tasks[:40]
    plain = demonstrations(some, tok)
    with_memory = mem.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert 10 <= len(with_memory) <= 30  # about half
    again = mem.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert again.keys() == with_memory.keys()  # deterministic in the seed
    assert all(np.array_equal(again[i].ids, with_memory[i].ids) for i in again)
    for i, enc in with_memory.items():
        # Same trained segments (ACT and REHEARSE texts), so the memory is context only.
        assert _segment_texts(tok, enc) == _segment_texts(tok, plain[i])
        context = tok.decode(enc.ids[enc.roles == Role.CONTEXT].tolist())
        assert mem.HEADER in context
        first_act = np.flatnonzero(enc.roles == Role.ACT)[0]
        assert mem.HEADER in tok.decode(enc.ids[:first_act].tolist())
    assert mem.memory_demonstrations(some, tok, DemoEnv, fraction=0.0, seed=3) == {}
    with pytest.raises(ValueError, match="fraction"):
        mem.memory_demonstrations(some, tok, DemoEnv, fraction=1.5, seed=3)


def _plan_of(text):
    out = []
    for line in text.splitlines():
        m = re.fullmatch(r"\d+\. (\w+) (\{.*\}) -> (.*)", line)
        if m:
            out.append((m.group(1), json.loads(m.group(2)), json.loads(m.group(3))))
    return out


def test_warm_start_memory_variants_against_a_real_replay(tasks):
    """Exact memories are the executed reference; wrong-expectation ones differ in one number of
    one response; wrong-plan ones differ in one argument, with the responses a real
    environment gives to that plan."""
    kinds = {"exact": 0, "expectation": 0, "plan": 0}
    for i, task in enumerate(tasks):
        text = mem.warm_start_memory(random.Random(i), task, DemoEnv)
        plan = _plan_of(text)
        ref = oracle_attempt(task)
        ref_calls = [(n, a) for n, a in ref.calls]
        ref_resp = [json.loads(r) for r in ref.responses]
        calls = [(n, a) for n, a, _ in plan]
        resp = [r for _, _, r in plan]
        m = re.search(r"plan \((\d+) of (\d+) rehearsals\)", text)
        support, total = int(m.group(1)), int(m.group(2))
        assert 1 <= support <= total and total in mem.BUDGETS
        if calls == ref_calls and resp == ref_resp:
            kinds["exact"] += 1
        elif calls == ref_calls:
            kinds["expectation"] += 1
            diff = [(a, b) for a, b in zip(resp, ref_resp, strict=True) if a != b]
            assert len(diff) == 1
            flat = lambda d: [x for x in re.findall(r"-?\d+", json.dumps(d))]  # noqa: E731
            assert sum(x != y for x, y in zip(flat(diff[0][0]), flat(diff[0][1]), strict=True)) == 1
        else:
            kinds["plan"] += 1
            changed = [
                (k, a[k], b[k])
                for (_, a), (_, b) in zip(calls, ref_calls, strict=True)
                for k in a
                if a[k] != b[k]
            ]
            assert len(changed) == 1, (text, ref_calls)
            assert [json.loads(r) for r in executed(task, calls)[1]] == resp
    assert min(kinds.values()) >= 10, kinds
