"""Grounded world rehearsal (the reference's Tool Simulator view).

References are independent of the code under test: the task record's reference conversation
(the logged calls and responses), a cache-less forward of the shipped demo base policy, the
NumPy re-implementation of the reference's per-message rows (`test_advantages`), and the
trainer's own metrics and summary for the environment-call count.
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from envace_jax.configuration import base_config, load, validate
from envace_jax.envs.demo import demonstrations, generate_tasks
from envace_jax.rl.advantages import compute_advantages
from envace_jax.rl.batch import pad_to_bucket
from envace_jax.rl.config import GRPOConfig
from envace_jax.rl.steps import token_logprobs
from envace_jax.rollout.grounded import (
    call_line,
    grounded_rollouts,
    logged_pairs,
    simulated_responses,
    simulator_demonstrations,
    simulator_messages,
)
from envace_jax.rollout.world_rehearsal import GroupSampling
from envace_jax.runtime.build import build_model
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.chat import render_text
from envace_jax.text.codes import Role
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.text.trajectory import encode_conversation
from envace_jax.train.warm_start_data import rows_batch
from tests.test_advantages import reference_advantages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import demo as demo_config  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def base(tok):
    config = base_config()
    config.model.hf_path = "demo-base"
    return build_model(config, tok)


def _reference_pairs(task):
    """(call line, response) pairs read straight off the reference conversation."""
    pairs, msgs = [], task.reference_messages
    for i, m in enumerate(msgs):
        for j, c in enumerate(m.get("tool_calls") or []):
            fn = c["function"]
            pairs.append(
                (
                    f"{fn['name']} {json.dumps(fn['arguments'], sort_keys=True)}",
                    msgs[i + 1 + j]["content"],
                )
            )
    return pairs


def test_the_simulator_prompt_holds_the_logged_pairs_and_the_call(tok):
    task = generate_tasks(0, 1, "train")[0]
    pairs = _reference_pairs(task)
    assert logged_pairs(task) == pairs and len(pairs) >= 2
    history = pairs[:1]
    call = pairs[1][0]
    text = render_text(tok, simulator_messages(task, history, [call]), None, True)
    for c, r in pairs:
        assert f"{c} -> {r}" in text
    assert f"history:\n{history[0][0]} -> {history[0][1]}\ncall:" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert text.split("call:\n")[-1].startswith(call)
    # The agent's own prompt holds none of the logged responses.
    agent = render_text(tok, task.messages, task.template_tools, True)
    assert not any(r in agent for _, r in pairs)
    # Arguments given as JSON text read the same as parsed ones.
    assert call_line("f", '{"b": 1, "a": "x"}') == call_line("f", {"a": "x", "b": 1})


@pytest.mark.parametrize(
    "text,calls,ok",
    [
        ('f {} -> {"id": "C1"}', 1, True),
        ('f {} -> {"id": "C1"}\ng {} -> {"error": {"code": "not_found", "message": "x"}}', 2, True),
        ('f {} -> {"id": "C1"}', 2, False),
        ('f {} -> {"id": "C1"', 1, False),
        ('{"id": "C1"}', 1, False),
        ("f {} -> [1, 2]", 1, False),
        ("", 1, False),
    ],
)
def test_simulated_responses_parse_one_call_and_json_object_per_line(text, calls, ok):
    responses, problem = simulated_responses(text, calls)
    assert (problem is None) == ok
    assert responses == ([line.split(" -> ", 1)[1] for line in text.split("\n")] if ok else [])


def _with_other_responses(task):
    """The task with every logged response's digits changed (same token count, new content)."""
    import dataclasses

    table = str.maketrans("0123456789", "5678901234")
    ref = [
        dict(m, content=m["content"].translate(table)) if m.get("role") == "tool" else m
        for m in task.reference_messages
    ]
    return dataclasses.replace(task, reference_messages=tuple(ref))


def test_act_log_probs_do_not_depend_on_the_few_shot_block(tok, base):
    """Teacher-forced: the same ACT sequence (rehearsed responses fixed, as CONTEXT) next to
    simulator rows whose logged pairs differ. Every ACT log-prob is bit-identical, while the
    simulator rows' REHEARSE log-probs change (the block is what they read)."""
    tasks = generate_tasks(3, 3, "train")
    demos = demonstrations(tasks, tok)
    graphdef, params, rest = nnx.split(base, nnx.Param, ...)
    score = jax.jit(lambda t: token_logprobs(graphdef, params, rest, t, 0.6)[0])
    results = []
    for variant in (tasks, [_with_other_responses(t) for t in tasks]):
        act_rows = [
            encode_conversation(tok, t.reference_messages, t.template_tools, rehearse=False)
            for t in tasks  # the ACT sequences never change
        ]
        sim_rows = simulator_demonstrations(tok, variant, demos)
        rows = act_rows + sim_rows
        batch = rows_batch(rows, np.arange(len(rows)), tok.pad_token_id)
        batch = pad_to_bucket(batch, (1024,), pad_id=tok.pad_token_id)
        logp = np.asarray(score(batch.tokens))
        results.append((batch, logp, len(act_rows)))
    (b0, lp0, n), (b1, lp1, _) = results
    act = np.asarray(b0.roles[:n]) == Role.ACT
    assert act.sum() > 100 and (np.asarray(b0.roles[:n]) == Role.REHEARSE).sum() == 0
    np.testing.assert_array_equal(np.asarray(b0.tokens[:n]), np.asarray(b1.tokens[:n]))
    assert np.array_equal(lp0[:n][act], lp1[:n][act])  # bit-identical
    changed = 0
    for i in range(n, b0.shape[0]):
        at0 = np.asarray(b0.roles[i]) == Role.REHEARSE
        at1 = np.asarray(b1.roles[i]) == Role.REHEARSE
        same_target = (
            np.asarray(b0.tokens[i])[at0].tolist() == np.asarray(b1.tokens[i])[at1].tolist()
        )
        assert same_target and at0.sum() > 0
        changed += not np.array_equal(lp0[i][at0], lp1[i][at1])
    assert changed > 0  # the simulator rows do read the block


def test_grounded_rows_get_the_rehearse_baseline_of_their_task_group(tok, base):
    tasks = generate_tasks(1, 3, "train")
    sampler = Sampler(
        base,
        turn_spec(tok, mode="host", max_turns=6, max_message_tokens=96),
        pad_id=tok.pad_token_id,
    )
    group = GroupSampling(
        group_size=4,
        key=jax.random.key(0),
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=320,
        length_buckets=(256, 512, 768, 1024),
    )
    rb = grounded_rollouts(sampler, tok, tasks, group, max_message_tokens=96, simulator_rows=16)
    b = rb.batch
    roles, segs = np.asarray(b.roles), np.asarray(b.segments)
    n_act = 12
    assert b.shape[0] == n_act + 16
    # ACT rows carry no REHEARSE token; simulator rows one REHEARSE message and nothing else.
    assert not (roles[:n_act] == Role.REHEARSE).any()
    sim = np.asarray(b.lengths[n_act:]) > 0
    assert sim.sum() == min(16, rb.stats["simulator_answers"]) >= 4
    assert not (roles[n_act:] == Role.ACT).any() and segs[n_act:].max() == 1
    # Each simulator row is in its episode's task group, with its episode's reward.
    group_ids = np.asarray(b.group)
    assert set(group_ids[n_act:][sim]) <= set(range(len(tasks)))
    assert set(np.round(np.asarray(b.reward[n_act:][sim]), 6)) <= set(
        np.round(np.asarray(b.reward[:n_act]), 6)
    )
    cfg = GRPOConfig()
    adv, _ = compute_advantages(b.roles, b.segments, b.group, b.reward, cfg)
    want, rows = reference_advantages(b, cfg)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-6)
    # Spelled out: a REHEARSE row's advantage is its reward minus the mean reward of the
    # REHEARSE rows of its task group (more than one in the group, else the reference's 0).
    reward = np.asarray(b.reward)
    for i in np.flatnonzero(sim) + n_act:
        peers = [j for j in np.flatnonzero(sim) + n_act if group_ids[j] == group_ids[i]]
        expect = reward[i] - reward[peers].mean() if len(peers) > 1 else 0.0
        at = np.flatnonzero(roles[i] == Role.REHEARSE)
        np.testing.assert_allclose(np.asarray(adv)[i, at], expect, atol=1e-6)


def _smoke(mode: str, workdir: str = "", view: str = "grounded"):
    config = demo_config.get_config("smoke")
    config.model.preset = base_config().model.preset
    config.model.hf_path = "demo-base"  # a policy that makes tool calls
    config.mode = mode
    config.rollout.rehearsal_view = view
    config.data.simulator_demos = 1.0
    config.rollout.max_new_tokens = 256
    config.schedule.warm_start_dir = workdir
    return validate(config)


@pytest.mark.slow  # three short train jobs
def test_rl_in_world_rehearsal_calls_no_environment(tmp_path):
    """The trainer's call counter, in metrics.jsonl and summary.json: zero calls in either
    rehearsal view, and the real-environment mode's calls, so the counter is seen counting."""
    from envace_jax.train.trainer import Trainer

    warm = str(tmp_path / "warm")
    Trainer(load(_smoke("sft_only")), warm).run()
    calls = {}
    for name, mode, view in (
        ("grounded", "envace", "grounded"),
        ("shared", "envace", "shared"),
        ("real", "grpo_real_env", "grounded"),
    ):
        workdir = tmp_path / name
        Trainer(load(_smoke(mode, warm, view)), str(workdir)).run()
        rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        per_step = [r["env_calls"] for r in rows if r["phase"] == "rl"]
        summary = json.loads((workdir / "summary.json").read_text())
        assert len(per_step) == 2
        assert summary["final"]["env_calls_rl"] == sum(per_step)
        assert summary["warm_start"]["env_calls_rl"] == 0
        calls[name] = sum(per_step)
    assert calls["grounded"] == 0 and calls["shared"] == 0
    assert calls["real"] > 0
