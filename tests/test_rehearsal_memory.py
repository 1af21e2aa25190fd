"""The structured rehearsal memory and the memories built from reference solutions: the format
(plan call lines, avoid lines, notes), refused alternatives and the exact memory checked by
replays in a real environment, warm-start memory variants and demonstrations, memory-carrying
RL tasks, and the rehearsal table's paired differences."""

import collections
import dataclasses
import json
import math
import random
import re
import statistics

import numpy as np
import pytest

from envace_jax.configuration import ConfigError, validate
from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks
from envace_jax.testtime import demonstrations as demos
from envace_jax.testtime import memory as mem
from envace_jax.text import memory_slot as ms
from envace_jax.text.codes import Role, Status
from tests import test_testtime
from tests.conftest import demo_config, executed

tok, tasks = test_testtime.tok, test_testtime.tasks  # the fixtures both files use
HEADER = "Rehearsal memory (from private rehearsals, not real):"  # the documented header


def code_of(response: str):
    """The error code of a response text read as JSON, or None."""
    body = json.loads(response)
    return body["error"]["code"] if isinstance(body, dict) and "error" in body else None


def refusals_of(calls, responses):
    """(name, arguments, code) of every call whose response is an error, in order."""
    pairs = zip(calls, responses, strict=True)
    return [(n, a, code_of(r)) for (n, a), r in pairs if code_of(r) is not None]


def reference(task):
    return [(c["name"], c["arguments"]) for c in task.ground_truth["solution"]]


def oracle_attempt(task):
    calls, responses = executed(task, reference(task))
    return mem.Attempt(calls, responses, task.ground_truth["final_reply"], Status.FINISHED)


def parse_memory(text):
    """(plan head, plan calls, avoid (name, args, code), notes) of a structured memory; fails
    on any line out of the format."""
    lines = text.splitlines()
    assert lines[0] == HEADER, text
    plan, avoid, notes = [], [], []
    section = plan
    for line in lines[2:]:
        if line in ("avoid:", "notes:"):
            section = avoid if line == "avoid:" else notes
            continue
        if section is plan:
            m = re.fullmatch(rf"{len(plan) + 1}\. (\w+) (\{{.*\}})", line)
        elif section is avoid:
            m = re.fullmatch(r"- (\w+) (\{.*\}) -> (\w+)", line)
        else:
            m = re.fullmatch(r"- (.+)", line)
        assert m, (line, text)
        if section is notes:
            notes.append(m.group(1))
            continue
        args = json.loads(m.group(2))
        assert m.group(2) == json.dumps(args, ensure_ascii=False)  # the JSON of a tool call
        section.append((m.group(1), args, *m.groups()[2:]))
    return lines[1], plan, avoid, notes


def _key(name, args):
    return name, json.dumps(args, sort_keys=True)


# ------------------------------------------------------------------------- the format


def test_structured_memory_lists_the_selected_plan_and_the_refusals(tasks):
    task = next(t for t in tasks if t.ground_truth["n_calls"] >= 2)
    good = oracle_attempt(task)
    assert not any(code_of(r) for r in good.responses)
    wrong_calls = [(n, dict(a)) for n, a in good.calls]
    key = next(iter(wrong_calls[0][1]))
    wrong_calls[0][1][key] = "Zed"
    wrong = mem.Attempt(*executed(task, wrong_calls), None, Status.TRUNCATED)
    refused = refusals_of(wrong.calls, wrong.responses)
    assert refused and refused[0][1][key] == "Zed"  # the real world refuses the made-up value
    attempts = [wrong, good, good]
    assessments = [mem.assess(task, a) for a in attempts]
    assert assessments[0].problems and assessments[1].ok
    text = mem.render_memory(attempts, assessments)
    head, plan, avoid, notes = parse_memory(text)
    assert head == "plan (2 of 3 rehearsals):"
    assert plan == [(n, a) for n, a in good.calls]
    assert avoid == refused  # the refusals, each with its code; not the rule problems
    assert notes == []
    assert not any(r in text for r in good.responses)  # rehearsed response bodies are left out
    # A policy-written assessment goes under notes (distinct, in order).
    written = [dataclasses.replace(s, text=f"check {i % 2}") for i, s in enumerate(assessments)]
    assert parse_memory(mem.render_memory(attempts, written))[3] == ["check 0", "check 1"]
    # At most three distinct avoid lines; extra ones come after the attempts' own.
    many = [
        mem.Attempt(*executed(task, [("get_order", {"order_id": f"X{i}"})]), "ok", Status.FINISHED)
        for i in (1, 2, 1, 3, 4)
    ]
    _, _, avoid, _ = parse_memory(mem.render_memory(many, [mem.Assessment()] * 5))
    assert [a["order_id"] for _, a, _ in avoid] == ["X1", "X2", "X3"]
    assert all(code is not None for *_, code in avoid)
    extra = ['refund {"order_id": "O9"} -> bad_status']
    _, _, avoid, _ = parse_memory(mem.render_memory([wrong], [mem.Assessment()], None, extra * 2))
    assert avoid == [*refused, ("refund", {"order_id": "O9"}, "bad_status")][:3]
    # No call: a plan to reply; no usable attempt: no plan.
    reply = mem.Attempt((), (), "Done.", Status.FINISHED)
    assert parse_memory(mem.render_memory([reply], [mem.Assessment()]))[:2] == (
        "plan (1 of 1 rehearsals): reply without tool calls",
        [],
    )
    assert mem.render_memory([], []) == f"{HEADER}\nplan: none"


def test_with_memory_puts_the_memory_in_the_prompt_and_the_reference_opening(tasks):
    task = tasks[0]
    n = len(task.messages)
    for place in ms.PLACES:
        slotted = ms.slotted_task(task, place)
        out = mem.with_memory(slotted, "MEMORY")
        index = 0 if place == "system" else n - 1
        expected = [dict(m) for m in task.messages]
        expected[index]["content"] += "\n\nMEMORY"
        assert list(out.messages) == list(out.reference_messages[:n]) == expected
        assert out.reference_messages[n:] == task.reference_messages[n:]
        assert out.ground_truth == task.ground_truth
    assert mem.with_memory(task, "").messages == task.messages


# ------------------------------------------------------- memories from reference plans


def refused_swaps(task):
    """{(index, tool): code} of every reference call whose tool, swapped for another offered
    tool that takes the same parameters, is refused by a fresh environment after the prefix."""
    ref = reference(task)
    params = {
        t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in task.tools
    }
    out = {}
    for i, (name, args) in enumerate(ref):
        for other, p in params.items():
            if other != name and p == set(args):
                code = code_of(executed(task, [*ref[:i], (other, args)])[1][-1])
                if code is not None:
                    out[(i, other)] = code
    return out


def test_refused_alternatives_are_refused_by_a_real_environment(tasks):
    with_alternatives = 0
    for task in tasks[:40]:
        ref = reference(task)
        assert not any(code_of(r) for r in executed(task, ref)[1]), task.task_id
        found = {}
        for a in demos.refused_alternatives(task, DemoEnv):
            *prefix, (name, args) = a.calls
            i = len(prefix)
            assert prefix == ref[:i] and args == ref[i][1] and name != ref[i][0]
            calls, responses = executed(task, a.calls)
            assert a.responses == responses  # what the real world answered
            assert not any(code_of(r) for r in responses[:-1])
            assert code_of(responses[-1]) is not None
            found[(i, name)] = code_of(responses[-1])
        assert found == refused_swaps(task), task.task_id
        with_alternatives += bool(found)
    assert 10 <= with_alternatives <= 30, with_alternatives


def test_exact_memory_lists_the_reference_plan_and_only_refused_calls(tasks):
    for task in tasks[:40]:
        ref = reference(task)
        swaps = refused_swaps(task)
        refused = {(*_key(name, ref[i][1]), code) for (i, name), code in swaps.items()}
        for budget in (1, 4):
            head, plan, avoid, notes = parse_memory(demos.exact_memory(task, DemoEnv, budget))
            assert head == f"plan ({budget} of {budget} rehearsals):"
            assert plan == ref and notes == []
            got = [(*_key(n, a), code) for n, a, code in avoid]
            assert len(got) == len(set(got)) == min(len(refused), mem.MAX_NOTES)
            assert set(got) <= refused
            assert not {_key(n, a) for n, a in plan} & {g[:2] for g in got}


def test_warm_start_memory_variants_against_a_real_replay():
    """Exact memories are the reference plan, most of those with refused alternatives to avoid;
    wrong plans are a refused alternative shown without its avoid line, or a plan with one
    look-alike argument and the refusals a real environment gives it; empty ones no plan."""
    kinds = collections.Counter()
    for i, task in enumerate(generate_tasks(7, 400, "train")):
        ref = reference(task)
        head, plan, avoid, notes = parse_memory(
            demos.warm_start_memory(random.Random(i), task, DemoEnv)
        )
        assert notes == []
        if head == "plan: none":
            assert plan == avoid == []
            kinds["empty"] += 1
            continue
        support, total = map(
            int, re.fullmatch(r"plan \((\d+) of (\d+) rehearsals\):", head).groups()
        )
        assert total in demos.BUDGETS and 1 <= support <= total
        swaps = refused_swaps(task)
        if plan == ref:
            assert support >= math.ceil(total / 2)
            refused = {(*_key(n, ref[k][1]), code) for (k, n), code in swaps.items()}
            assert {(*_key(n, a), code) for n, a, code in avoid} <= refused
            kinds["exact, avoid" if avoid else "exact"] += 1
            if swaps:
                kinds["exact, could avoid"] += 1
        elif [n for n, _ in plan] == [n for n, _ in ref]:
            changed = [
                (k, a[k])
                for (_, a), (_, b) in zip(plan, ref, strict=True)
                for k in a
                if a[k] != b[k]
            ]
            assert len(changed) == 1, (plan, ref)
            _, responses = executed(task, plan)
            assert avoid == refusals_of(plan, responses)[: mem.MAX_NOTES]
            kinds["look-alike"] += 1
        else:
            k = len(plan) - 1
            assert plan[:k] == ref[:k] and plan[k][1] == ref[k][1]
            assert swaps.get((k, plan[k][0])) is not None  # the world refuses the swapped call
            assert avoid == []  # the rehearsal expected it to work
            kinds["swapped"] += 1
    assert kinds["exact"] + kinds["exact, avoid"] >= 200, kinds
    assert min(kinds[k] for k in ("exact, avoid", "look-alike", "swapped", "empty")) >= 8, kinds
    # Most exact memories of tasks that have refused alternatives carry avoid lines.
    assert kinds["exact, avoid"] >= 0.5 * kinds["exact, could avoid"], kinds


def _segment_texts(tok, enc):
    out = []
    for s in range(1, enc.num_segments + 1):
        idx = enc.segments == s
        out.append((int(enc.roles[idx][0]), tok.decode(enc.ids[idx].tolist())))
    return out


def test_memory_demonstrations_keep_the_targets_and_put_the_memory_in_the_prompt(tok, tasks):
    some = tasks[:40]
    plain = demonstrations(some, tok)
    with_memory = demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert 10 <= len(with_memory) <= 30  # about half
    again = demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert again.keys() == with_memory.keys()  # deterministic in the seed
    assert all(np.array_equal(again[i].ids, with_memory[i].ids) for i in again)
    for i, enc in with_memory.items():
        # Same trained segments (ACT and REHEARSE texts), so the memory is context only.
        assert _segment_texts(tok, enc) == _segment_texts(tok, plain[i])
        context = tok.decode(enc.ids[enc.roles == Role.CONTEXT].tolist())
        assert HEADER in context
        first_act = np.flatnonzero(enc.roles == Role.ACT)[0]
        assert HEADER in tok.decode(enc.ids[:first_act].tolist())
    assert demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.0, seed=3) == {}
    with pytest.raises(ValueError, match="fraction"):
        demos.memory_demonstrations(some, tok, DemoEnv, fraction=1.5, seed=3)


def test_memory_rows_show_their_tasks_demonstrator_with_a_plan_of_its_calls(tok, tasks):
    """With the demonstrations' conversations given, a memory row trains the same targets as
    its task's plain demonstration (the imperfect demonstrator's included), and its plan is
    that demonstration's calls, or none, or a wrong plan only where the demonstration is the
    reference solution (whose target is then the right action)."""
    from envace_jax.envs.demo import demonstration_messages

    some = tasks[:60]
    drawn = (0.25, 5, 0.0, 0.5)  # failure, seed, unfinished, default-action shares
    plain = demonstrations(some, tok, *drawn)
    shown = demonstration_messages(some, *drawn)
    rows = demos.memory_demonstrations(some, tok, DemoEnv, fraction=1.0, seed=5, shown=shown)
    kinds = collections.Counter()
    for i, enc in rows.items():
        assert _segment_texts(tok, enc) == _segment_texts(tok, plain[i])
        context = tok.decode(enc.ids[: np.flatnonzero(enc.roles == Role.ACT)[0]].tolist())
        memory = context[context.index(HEADER) :].split("<|im_end|>")[0]
        plan = [json.loads(x) for x in re.findall(r"^\d+\. \w+ (\{.*\})$", memory, re.M)]
        names = re.findall(r"^\d+\. (\w+) ", memory, re.M)
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for m in shown[i]
            if m.get("role") == "assistant"
            for c in m.get("tool_calls") or []
        ]
        reference = mem.reference_plan(some[i])[0]
        if "plan: none" in memory:
            kinds["empty"] += 1
        elif list(zip(names, plan, strict=True)) == calls:
            kinds["demonstrated" if calls == reference else "demonstrated, not reference"] += 1
        else:
            assert calls == reference, (i, memory, calls)
            kinds["wrong plan"] += 1
    assert set(kinds) == {"empty", "demonstrated", "demonstrated, not reference", "wrong plan"}


def test_memory_tasks_carry_a_stable_memory_in_a_share_of_the_tasks():
    pool = generate_tasks(5, 400, "train")
    a = demos.MemoryTasks(pool, DemoEnv, fraction=0.3, seed=11)
    b = demos.MemoryTasks(pool, DemoEnv, fraction=0.3, seed=11)
    assert len(a) == len(pool)
    carried = [i for i in range(len(pool)) if a.carries_memory(i)]
    assert abs(len(carried) / len(pool) - 0.3) < 0.07  # three binomial standard deviations
    for i, task in enumerate(pool):
        got = a[i]
        if i not in carried:
            assert got is task
            continue
        assert got is not task and a[i] is got  # built once
        assert b[i].messages == got.messages  # the same seed: the same memory
        instruction = got.messages[-1]["content"]
        prefix = f"{task.messages[-1]['content']}\n\n{HEADER}\n"
        assert instruction.startswith(prefix)
        n = len(task.messages)
        assert got.messages[:-1] == task.messages[:-1]
        assert got.reference_messages[:n] == got.messages
        assert got.reference_messages[n:] == task.reference_messages[n:]
    other = demos.MemoryTasks(pool, DemoEnv, fraction=0.3, seed=12)
    assert [i for i in range(len(pool)) if other.carries_memory(i)] != carried
    assert all(
        demos.MemoryTasks(pool, DemoEnv, fraction=0.0, seed=1)[i] is pool[i] for i in range(20)
    )
    # In a slotted task the memory takes the slot's place.
    slotted = [ms.slotted_task(t, "system") for t in pool[:10]]
    for t in demos.MemoryTasks(slotted, DemoEnv, fraction=1.0, seed=1):
        assert ms.EMPTY not in str(t.messages) and f"\n\n{HEADER}\n" in t.messages[0]["content"]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"fraction must be in \\[0, 1\\], got {bad}"):
            demos.MemoryTasks(pool, DemoEnv, fraction=bad, seed=1)


def _files_config():
    c = demo_config("smoke")
    c.data.failure_demos = 0.0
    c.rehearsal.sft_memory_fraction = 0.0
    c.eval.kind = "checklist"
    c.data.env = "files"
    c.data.train_files, c.data.eval_files = "train.jsonl", "eval.jsonl"
    return c


@pytest.mark.parametrize("key", ["rl_memory_fraction", "sft_memory_fraction"])
def test_memory_fractions_need_an_environment(key):
    config = demo_config("smoke")
    config.rehearsal[key] = 0.5
    validate(config)  # the demo domain has one
    config = _files_config()
    validate(config)
    config.rehearsal[key] = 0.5
    with pytest.raises(
        ConfigError, match=rf"config\.rehearsal\.{key} = 0\.5: .*data\.env = 'files'"
    ):
        validate(config)


# ------------------------------------------------------------------ the rehearsal table


def test_table_differences_are_paired_by_seed_and_gate_rows_stand_alone():
    from envace_jax.testtime.rehearsal_eval import _aggregate, paired, tables

    seeds = [(0.25, 0.5, 0.75), (0.5, 0.5, 1.0), (0.5, 0.75, 0.75)]  # none, empty, exact
    per_seed = [
        {
            row: {0: {"success": s, "reward": s}}
            for row, s in zip(("none", "empty memory", "exact memory"), seed, strict=True)
        }
        | {"none, warm-start policy": {0: {"success": 0.0, "reward": 0.0}}}
        for seed in seeds
    ]
    agg = _aggregate(per_seed)
    diffs = [x[2] - x[0] for x in seeds]  # exact minus none, seed by seed
    mean, se = paired(agg["exact memory"][0], agg["none"][0])
    assert mean == pytest.approx(statistics.mean(diffs))
    assert se == pytest.approx(statistics.stdev(diffs) / math.sqrt(len(diffs)))
    text = tables(agg, (1, 2), 2, n_seeds=3, n_tasks=4)
    assert "minus none (± s.e.)" in text and "rehearser" not in text
    assert (
        f"| exact memory | 0 | 0.833 ± 0.118 | 0.750 1.000 0.750 | +{mean:.3f} ± {se:.3f} |" in text
    )
    # The claims table: the same paired difference, with its verdict (beyond 2 s.e.: supported).
    assert mean > 2 * se
    assert f"| exact memory - none | +0.05 | +{mean:.3f} ± {se:.3f}, supported |" in text


def test_a_plan_fewer_attempts_agree_on_than_min_support_leaves_plan_none():
    """Below `min_support` agreeing attempts the memory is `plan: none` with no avoid lines;
    at or above it, the same memory as without the gate."""
    plan = mem.Attempt(
        (("get_order", {"order_id": "O1"}),), ('{"id": "O1"}',), "ok", Status.FINISHED
    )
    refused = mem.Attempt(
        (("refund", {"order_id": "O1"}),),
        ('{"error": {"code": "bad_status"}}',),
        "ok",
        Status.FINISHED,
    )
    attempts = [plan, plan, refused]
    assessments = [mem.Assessment()] * 3
    ungated = mem.render_memory(attempts, assessments)
    assert "plan (2 of 3 rehearsals)" in ungated and "avoid:" in ungated
    assert mem.render_memory(attempts, assessments, min_support=2) == ungated
    assert mem.render_memory(attempts, assessments, min_support=3) == f"{HEADER}\nplan: none"


def test_swapped_rows_take_the_targets_id_from_the_plan_alone(tok, tasks):
    """A swapped memory row ends at a call naming another id that the lookup listed (checked
    against the real environment's listing), its plan names that same call, and its other
    targets are the demonstration's; tasks whose lookups list no other id keep their row."""
    some = tasks[:80]
    plain = demos.memory_demonstrations(some, tok, DemoEnv, fraction=1.0, seed=2)
    rows = demos.memory_demonstrations(some, tok, DemoEnv, fraction=1.0, seed=2, swaps=1.0)
    swapped = 0
    for i, enc in rows.items():
        reference = [(c["name"], c["arguments"]) for c in some[i].ground_truth["solution"]]
        segments = _segment_texts(tok, enc)
        if np.array_equal(enc.ids, plain[i].ids):
            continue
        swapped += 1
        acts = [
            json.loads(t[t.index("{") : t.rindex("}") + 1]) for r, t in segments if r == Role.ACT
        ]
        name, args = acts[-1]["name"], acts[-1]["arguments"]
        assert name == reference[-1][0] and args != reference[-1][1]
        # the real environment's listing after the lookups holds the swapped id
        env = DemoEnv()
        env.reset(some[i])
        listing = [env.step([{"name": n, "arguments": a}])[0] for n, a in reference[:-1]]
        assert any(v in str(r) for r in listing for v in args.values())
        context = tok.decode(enc.ids[: np.flatnonzero(enc.roles == Role.ACT)[0]].tolist())
        memory = context[context.index(HEADER) :].split("<|im_end|>")[0]
        plan = re.findall(r"^\d+\. (\w+) (\{.*\})$", memory, re.M)
        assert plan[-1] == (name, json.dumps(args))
        k = 2 * (len(reference) - 1)  # each lookup: its call (ACT), its response (REHEARSE)
        assert segments[:k] == _segment_texts(tok, plain[i])[:k]
        assert [r for r, _ in segments[k:]] == [Role.ACT]  # cut after the swapped call
    assert 3 <= swapped <= 40, swapped
