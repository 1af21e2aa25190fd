"""Test-time rehearsal: rule assessor, plan selection, memory format and insertion, warm-start
memory demonstrations, rehearsals that never touch the real environment, both modes with any
loadable model, and the rehearsal_eval job on a smoke checkpoint."""

import dataclasses
import json
import random
import re

import jax
import numpy as np
import pytest

from envace_jax.envs.base import result_text
from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks
from envace_jax.testtime import demonstrations as demos
from envace_jax.testtime import memory as mem
from envace_jax.text.codes import Role, Status
from envace_jax.text.tokenizer import load_tokenizer
from tests.conftest import demo_config


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
    return mem.Attempt(calls, responses, task.ground_truth["final_reply"], Status.FINISHED)


# ------------------------------------------------------------------------------ assessor


def test_rule_assessor_passes_every_oracle_trajectory(tasks):
    """Executed oracle solutions are correct by construction: no problem may be reported."""
    for task in tasks:
        assert mem.assess(task, oracle_attempt(task)).problems == (), task.task_id


def test_rule_assessor_flags_env_errors_ungrounded_values_and_unfinished(tasks):
    task = next(
        t for t in tasks if (t.metadata["family"], t.metadata["branch"]) == ("close", "open")
    )
    order = task.ground_truth["solution"][0]["arguments"]["order_id"]
    world = task.ground_truth["initial_state"]
    other = next(o for o in world["orders"] if o["status"] != "open" and o["id"] != order)
    # The real environment refuses to cancel an order that is not open.
    calls, responses = executed(task, [("cancel_order", {"order_id": other["id"]})])
    assert "bad_status" in responses[0]
    got = mem.assess(task, mem.Attempt(calls, responses, "Done.", Status.FINISHED))
    assert any("got bad_status" in p for p in got.problems)
    # The id is in no user message and no earlier result: ungrounded.
    assert any(f'order_id="{other["id"]}" is from no result' in p for p in got.problems)
    # A reply number that no result gave.
    good = oracle_attempt(task)
    lie = dataclass_replace(good, final_reply="Your balance is 123456.")
    assert mem.assess(task, lie).problems == ("reply states 123456, which no result gave",)
    unfinished = dataclass_replace(good, final_reply=None, status=Status.TRUNCATED)
    assert mem.assess(task, unfinished).problems == ("no final reply",)
    assert mem.assess(task, unfinished, require_finish=False).ok
    invalid = dataclass_replace(good, status=Status.INVALID, reason="action: bad_json")
    assert mem.assess(task, invalid).problems[0].startswith("invalid message (action: bad_json")


def dataclass_replace(x, **kw):
    return dataclasses.replace(x, **kw)


# ------------------------------------------------------------------- selection and memory


def _attempt(calls, status=Status.FINISHED, reply="ok"):
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
    dead = _attempt([], status=Status.INVALID, reply=None)
    assert mem.select_plan([dead, dead], [bad, bad]).index is None


def test_structured_memory_lists_the_selected_plan_and_the_notes(tasks):
    task = next(t for t in tasks if t.ground_truth["n_calls"] >= 2)
    good = oracle_attempt(task)
    wrong_calls = [(n, dict(a)) for n, a in good.calls]
    key = next(iter(wrong_calls[0][1]))
    wrong_calls[0][1][key] = "Zed"
    wrong = mem.Attempt(*executed(task, wrong_calls), None, Status.TRUNCATED)
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
    text = "<think>x</think>plan: <tool_call>a</tool_call> b<|im_end|>\n<|im_start|>user\x0c\ufffd"
    assert mem.clean_generated(text) == "plan: a b\nuser"
    assert mem.clean_generated("<think>unfinished thought") == ""
    assert mem.clean_generated("x" * 50, max_chars=10) == "x" * 10


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
    with_memory = demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert 10 <= len(with_memory) <= 30  # about half
    again = demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.5, seed=3)
    assert again.keys() == with_memory.keys()  # deterministic in the seed
    assert all(np.array_equal(again[i].ids, with_memory[i].ids) for i in again)
    for i, enc in with_memory.items():
        # Same trained segments (ACT and REHEARSE texts), so the memory is context only.
        assert _segment_texts(tok, enc) == _segment_texts(tok, plain[i])
        context = tok.decode(enc.ids[enc.roles == Role.CONTEXT].tolist())
        assert mem.HEADER in context
        first_act = np.flatnonzero(enc.roles == Role.ACT)[0]
        assert mem.HEADER in tok.decode(enc.ids[:first_act].tolist())
    assert demos.memory_demonstrations(some, tok, DemoEnv, fraction=0.0, seed=3) == {}
    with pytest.raises(ValueError, match="fraction"):
        demos.memory_demonstrations(some, tok, DemoEnv, fraction=1.5, seed=3)


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
        text = demos.warm_start_memory(random.Random(i), task, DemoEnv)
        plan = _plan_of(text)
        ref = oracle_attempt(task)
        ref_calls = [(n, a) for n, a in ref.calls]
        ref_resp = [json.loads(r) for r in ref.responses]
        calls = [(n, a) for n, a, _ in plan]
        resp = [r for _, _, r in plan]
        m = re.search(r"plan \((\d+) of (\d+) rehearsals\)", text)
        support, total = int(m.group(1)), int(m.group(2))
        assert 1 <= support <= total and total in demos.BUDGETS
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


# ------------------------------------------------------------------- rehearsal with models


def _short(task):
    """`task` with a one-line system turn: short sequences keep the memorising policy cheap."""
    system = {"role": "system", "content": "Shop assistant. Use the tools."}
    return dataclasses.replace(
        task,
        messages=(system, *task.messages[1:]),
        reference_messages=(system, *task.reference_messages[1:]),
    )


@pytest.fixture(scope="module")
def memorised(tok):
    """A tiny Qwen3 trained to reproduce two tasks' oracle conversations, with and without an
    exact memory of 1 or 2 rehearsals in the prompt: its rehearsals make the state-changing
    calls, and its committed runs solve the tasks."""
    import optax
    from flax import nnx

    from envace_jax.models.config import get_preset
    from envace_jax.models.decoder import Decoder
    from envace_jax.rl.batch import from_numpy
    from envace_jax.rl.config import SFTConfig
    from envace_jax.rl.steps import init_train_state, make_sft_step
    from envace_jax.text.trajectory import encode_conversation

    pool = generate_tasks(0, 40, "test")
    chosen = [
        t
        for t in pool
        if t.metadata["family"] == "close" and t.metadata["branch"] in ("open", "shipped")
    ][:2]
    tasks = [_short(t) for t in chosen]
    seqs = []
    for t in tasks:
        oracle = oracle_attempt(t)
        for n in (0, 1, 2):
            memory = mem.render_memory([oracle] * n, [mem.Assessment()] * n) if n else ""
            k = len(t.messages)
            messages = mem.insert_memory(t.reference_messages[:k], memory)
            messages += [dict(m) for m in t.reference_messages[k:]]
            seqs.append(encode_conversation(tok, messages, t.template_tools, rehearse=True))
    T = max(len(s.ids) for s in seqs)
    tokens = np.zeros((len(seqs), T), np.int32)
    roles, segments = np.zeros((len(seqs), T), np.int8), np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.ids)], roles[i, : len(s.ids)], segments[i, : len(s.ids)] = (
            s.ids,
            s.roles,
            s.segments,
        )
    batch = from_numpy(
        tokens=tokens,
        roles=roles,
        segments=segments,
        lengths=[len(s.ids) for s in seqs],
        group=np.arange(len(seqs)),
        reward=np.zeros(len(seqs)),
    )
    cfg = get_preset("tiny-qwen3", vocab_size=len(tok), max_position_embeddings=2048)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tx = optax.adam(3e-3)
    state = init_train_state(nnx.state(model, nnx.Param), tx)
    step = make_sft_step(model, tx, SFTConfig())
    for _ in range(120):
        state, metrics = step(state, batch)
    assert float(metrics["nll"]) < 0.1
    return model, state.params, tasks


def _greedy_rehearsal(model, tok, **kwargs):
    """Greedy test-time rehearsal with budgets that fit the memorising policy's tasks."""
    from envace_jax.sampling.distributions import SamplingParams
    from envace_jax.testtime.rehearsal import TestTimeRehearsal

    return TestTimeRehearsal(
        model,
        tok,
        max_turns=3,
        max_message_tokens=64,
        sampling=SamplingParams(greedy=True),
        max_new_tokens=160,
        **kwargs,
    )


@pytest.mark.slow  # trains the memorising policy (about a minute on two CPU cores)
def test_rehearsals_leave_the_real_environment_untouched(memorised, tok, monkeypatch):
    from envace_jax.envs.demo import STATE_CHANGING
    from envace_jax.testtime.rehearsal import REHEARSAL_STRATEGIES

    model, params, tasks = memorised
    executed_calls = []
    step = DemoEnv.step

    def spy(self, calls):  # every call any environment executes, anywhere
        executed_calls.extend(calls)
        return step(self, calls)

    monkeypatch.setattr(DemoEnv, "step", spy)
    live = [DemoEnv() for _ in tasks]  # the real environments the committed runs will use
    for env, task in zip(live, tasks, strict=True):
        env.reset(task)
    before = [env.state() for env in live]
    ttr = _greedy_rehearsal(model, tok)
    memories = {}
    for mode in REHEARSAL_STRATEGIES:
        rehearsals = ttr.rehearse(params, tasks, mode=mode, n=2, key=jax.random.key(0))
        for r, task in zip(rehearsals, tasks, strict=True):
            # The rehearsals did make the task's state-changing calls ...
            names = {name for a in r.attempts for name, _ in a.calls}
            assert names & STATE_CHANGING, (mode, task.task_id, r.attempts)
        memories[mode] = ttr.memories(params, tasks, rehearsals, budget=2, key=jax.random.key(1))
    # ... yet no environment executed anything, and the real ones are as they were.
    assert executed_calls == []
    assert [env.state() for env in live] == before
    for mode in REHEARSAL_STRATEGIES:
        for env, task in zip(live, tasks, strict=True):
            env.reset(task)
        make_env = iter(live).__next__  # hands out the live environments in task order
        out = ttr.commit(params, tasks, memories[mode], make_env, key=jax.random.key(2))
        # Only the committed run changes the world: it reaches the task's ground-truth state.
        assert executed_calls
        for env, task, result, memory, prompt in zip(
            live, tasks, out.results, memories[mode], out.prompts, strict=True
        ):
            assert memory.startswith(mem.HEADER) and "plan (2 of 2 rehearsals)" in memory
            assert memory in tok.decode(prompt)  # the memory is in the committed context
            assert env.state()["world"] == task.ground_truth["final_state"]
            assert env.state()["world"] != task.ground_truth["initial_state"]
            assert result.success
        executed_calls.clear()


@pytest.mark.slow  # uses the memorising policy
def test_committed_runs_decoded_in_row_chunks_match_one_batch(memorised, tok):

    model, params, tasks = memorised
    rows = list(tasks) * 2  # distinct rows: the second copy carries a memory
    runs = {}
    for commit_rows in (len(rows), 1):
        ttr = _greedy_rehearsal(model, tok, commit_rows=commit_rows)
        rehearsals = ttr.rehearse(params, tasks, mode="parallel", n=1, key=jax.random.key(0))
        memories = [""] * len(tasks) + ttr.memories(
            params, tasks, rehearsals, budget=1, key=jax.random.key(1)
        )
        batch_rows = []
        prefill = ttr.host_sampler.prefill

        def recording(prompts, _rows=batch_rows, _prefill=prefill, **kw):
            _rows.append(len(prompts))
            return _prefill(prompts, **kw)

        ttr.host_sampler.prefill = recording
        out = ttr.commit(params, rows, memories, DemoEnv, key=jax.random.key(2))
        assert max(batch_rows) == commit_rows and sum(batch_rows) == len(rows)
        runs[commit_rows] = out
    one, chunked = runs[len(rows)], runs[1]
    assert [list(p) for p in one.prompts] == [list(p) for p in chunked.prompts]
    for a, b in zip(one.results, chunked.results, strict=True):
        assert a.episode.messages == b.episode.messages
        assert (a.success, a.reward, a.env_state) == (b.success, b.reward, b.env_state)


@pytest.fixture(scope="module")
def loaded_random_qwen3(tmp_path_factory, tok):
    """A tiny random Qwen3 written as an HF checkpoint and read back by the package's loader."""
    from flax import nnx

    from envace_jax.models.config import get_preset
    from envace_jax.models.decoder import Decoder
    from envace_jax.models.hf_io import load_hf_model, save_hf_model

    path = str(tmp_path_factory.mktemp("random-qwen3"))
    cfg = get_preset("tiny-qwen3", vocab_size=len(tok), max_position_embeddings=4096)
    save_hf_model(Decoder(cfg, rngs=nnx.Rngs(5)), cfg, path, tokenizer=tok)
    model, _ = load_hf_model(path)
    return model, nnx.state(model, nnx.Param)


@pytest.mark.slow  # rehearsal, memory and committed run of a loaded model, three times
@pytest.mark.parametrize(
    "memory,assessor", [("structured", "rules"), ("summary", "policy"), ("structured", "policy")]
)
def test_both_modes_form_and_insert_the_memory_with_a_loaded_random_qwen3(
    loaded_random_qwen3, tok, memory, assessor
):
    from envace_jax.testtime.rehearsal import REHEARSAL_STRATEGIES, TestTimeRehearsal

    model, params = loaded_random_qwen3
    tasks = generate_tasks(1, 2, "test")
    ttr = TestTimeRehearsal(
        model,
        tok,
        max_turns=2,
        max_message_tokens=16,
        memory=memory,
        assessor=assessor,
        max_new_tokens=32,
        max_memory_tokens=16,
    )
    seen_prompts = []
    generate = ttr.rehearse_sampler.generate

    def recording(prompts, **kw):
        seen_prompts.append([tok.decode(p) for p in prompts])
        return generate(prompts, **kw)

    ttr.rehearse_sampler.generate = recording
    for mode in REHEARSAL_STRATEGIES:
        seen_prompts.clear()
        rehearsals = ttr.rehearse(params, tasks, mode=mode, n=2, key=jax.random.key(3))
        assert [len(r.attempts) for r in rehearsals] == [2, 2]
        if mode == "parallel":  # one sampler call, N rows per task, all from the plain prompt
            assert len(seen_prompts) == 1 and len(seen_prompts[0]) == 4
            assert all(c == "" for r in rehearsals for c in r.contexts)
        else:  # attempt 2 sees attempt 1 and its assessment
            assert len(seen_prompts) == 2
            for b, r in enumerate(rehearsals):
                assert r.contexts[0] == "" and r.contexts[1]
                assert r.contexts[1] in seen_prompts[1][b]
                assert r.contexts[1] not in seen_prompts[0][b]
                if assessor == "policy" and memory == "summary":
                    assert r.assessments[0].text in r.contexts[1]
        for b in (1, 2):
            memories = ttr.memories(params, tasks, rehearsals, budget=b, key=jax.random.key(4))
            header = mem.HEADER if memory == "structured" else mem.SUMMARY_HEADER
            assert all(m.startswith(header) for m in memories)
            if memory == "structured":
                assert all(f"of {b} rehearsals" in m or "plan: none" in m for m in memories)
            out = ttr.commit(params, tasks, memories, DemoEnv, key=jax.random.key(5))
            assert len(out.results) == len(tasks)
            for task, m, prompt in zip(tasks, memories, out.prompts, strict=True):
                text = tok.decode(prompt)
                # Inserted after the instruction, inside the user turn, before the assistant's.
                assert f"{task.messages[-1]['content']}\n\n{m}<|im_end|>" in text
        assert ttr.memories(params, tasks, rehearsals, budget=0, key=jax.random.key(4)) == ["", ""]


# ------------------------------------------------------------------------ the eval job


def test_rehearsal_config_errors_name_the_key(tmp_path):
    from envace_jax.configuration import ConfigError, load, validate
    from envace_jax.testtime.rehearsal_eval import (
        RehearsalEvalError,
        check_architecture,
        train_dirs,
    )

    config = demo_config("rehearsal_eval")
    assert config.job == "rehearsal_eval"
    config.rehearsal.table_budget = 3
    with pytest.raises(ConfigError, match=r"config\.rehearsal\.table_budget = 3"):
        validate(config)
    config = demo_config("rehearsal_eval")
    config.job = "evaluate"
    with pytest.raises(ConfigError, match=r"config\.job = 'evaluate'"):
        validate(config)
    config = demo_config("rehearsal_eval")
    with pytest.raises(
        RehearsalEvalError, match="config.rehearsal.checkpoint_dir=''.*checkpoints/"
    ):
        train_dirs(config, str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    assert train_dirs(config, str(tmp_path)) == (str(tmp_path / "checkpoints"), str(tmp_path))
    config.rehearsal.checkpoint_dir = str(tmp_path / "checkpoints")
    assert train_dirs(config, "elsewhere") == (str(tmp_path / "checkpoints"), str(tmp_path))
    saved = json.loads(json.dumps(demo_config("smoke").to_dict()))
    with pytest.raises(RehearsalEvalError, match=r"--config\.model\.preset='tiny-qwen3'"):
        check_architecture(load(config), saved, "checkpoint x")
    check_architecture(load(demo_config("rehearsal_eval_smoke")), saved, "checkpoint x")


@pytest.mark.slow  # a smoke train job, then the eval job on its workdir (a few minutes)
def test_rehearsal_eval_job_prints_the_table_and_plots_from_a_train_workdir(tmp_path):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = os.path.join(repo, "configs", "demo.py")

    def main(variant):
        cmd = [sys.executable, "-m", "envace_jax.main", f"--config={cfg}:{variant}"]
        r = subprocess.run(
            cmd + [f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=1800
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    main("smoke")
    assert (tmp_path / "checkpoints" / "warm_start").is_dir()  # kept for the eval
    out = main("rehearsal_eval_smoke")
    assert "Test-time rehearsal on held-out test tasks" in out
    for row in (
        "| none | 0 |",
        "| parallel, EnvACE rehearser | 2 |",
        "| sequential, EnvACE rehearser | 2 |",
        "| parallel, warm-start rehearser | 2 |",
        "| sequential, warm-start rehearser | 2 |",
    ):
        assert row in out
    assert "warm-start policy: step 4" in out
    assert (tmp_path / "rehearsal_vs_budget.png").stat().st_size > 1000
    result = json.loads((tmp_path / "rehearsal_eval.json").read_text())
    assert len(result["per_seed"]) == 2
    assert set(result["aggregate"]["parallel, EnvACE rehearser"]) == {"1", "2"}
    assert (tmp_path / "rehearsal_eval.md").read_text().startswith("| test-time rehearsal |")
    # The train job's config record is left as it was.
    assert json.loads((tmp_path / "config.json").read_text())["job"] == "train"
    assert json.loads((tmp_path / "rehearsal_eval_config.json").read_text())["job"] == (
        "rehearsal_eval"
    )
