"""Test-time rehearsal: rule assessor, plan selection, memory insertion, rehearsals that never
touch the real environment, both modes with any loadable model, and the rehearsal_eval job on a
smoke checkpoint. The memory format and the memories built from reference solutions are in
test_rehearsal_memory.py, the memory slot in test_memory_slot.py."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from envace_jax.envs.demo import DemoEnv, generate_tasks
from envace_jax.testtime import memory as mem
from envace_jax.text.codes import Status
from envace_jax.text.tokenizer import load_tokenizer
from tests.conftest import demo_config, executed


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(7, 120, "train")


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
    seen_prompts, seen_tokens = [], []
    generate = ttr.rehearse_sampler.generate

    def recording(prompts, **kw):
        seen_prompts.append([list(p) for p in prompts])
        out = generate(prompts, **kw)
        seen_tokens.append(np.asarray(out.tokens))
        return out

    def prompt_with(task, context):  # the chat template's own ids of the task's prompt
        messages = mem.insert_memory(task.messages, context)
        out = tok.apply_chat_template(
            messages, tools=task.template_tools, add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def context_of(r, k):  # the memory (structured) or history (summary) of attempts 1..k
        if k == 0:
            return ""
        if memory == "structured":
            return mem.render_memory(r.attempts[:k], r.assessments[:k])
        return f"{mem.HISTORY_HEADER}\n" + mem.render_transcripts(r.attempts[:k], r.assessments[:k])

    ttr.rehearse_sampler.generate = recording
    for mode in REHEARSAL_STRATEGIES:
        seen_prompts.clear()
        seen_tokens.clear()
        n = 2 if mode == "parallel" else 3
        rehearsals = ttr.rehearse(params, tasks, mode=mode, n=n, key=jax.random.key(3))
        assert [len(r.attempts) for r in rehearsals] == [n, n]
        if mode == "parallel":  # one sampler call, N rows per task, all from the plain prompt
            assert len(seen_prompts) == 1
            assert seen_prompts[0] == [prompt_with(t, "") for t in tasks for _ in range(n)]
            assert all(c == "" for r in rehearsals for c in r.contexts)
            # Independent draws: the rows of one task differ; the same key draws them again.
            rows = seen_tokens[0]
            assert all(not np.array_equal(rows[2 * b], rows[2 * b + 1]) for b in range(2))
            again = ttr.rehearse(params, tasks, mode=mode, n=n, key=jax.random.key(3))
            assert np.array_equal(seen_tokens[1], rows)
            assert [r.attempts for r in again] == [r.attempts for r in rehearsals]
        else:  # attempt k sees exactly attempts 1..k-1 (and their assessments)
            assert len(seen_prompts) == n
            for b, (task, r) in enumerate(zip(tasks, rehearsals, strict=True)):
                for k in range(n):
                    assert r.contexts[k] == context_of(r, k)
                    assert seen_prompts[k][b] == prompt_with(task, r.contexts[k])
                if memory == "summary":
                    assert "Rehearsal 2:" in r.contexts[2] and "Rehearsal 3:" not in r.contexts[2]
                if assessor == "policy":
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
    assert "| minus none (± s.e.) |" in out  # differences paired by seed
    for row in (
        "| none | 0 |",
        "| empty memory | 0 |",
        "| exact memory | 0 |",
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
    assert set(result["aggregate"]["exact memory"]) == {"0"}  # committed with no rehearsal
    assert (tmp_path / "rehearsal_eval.md").read_text().startswith("| test-time rehearsal |")
    # The train job's config record is left as it was.
    assert json.loads((tmp_path / "config.json").read_text())["job"] == "train"
    assert json.loads((tmp_path / "rehearsal_eval_config.json").read_text())["job"] == (
        "rehearsal_eval"
    )
