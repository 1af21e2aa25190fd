"""Oracle demonstrations: role-tagged sequences whose ACT spans are the oracle's actions and
whose REHEARSE spans are what the real environment answered, checked against the tokenizer's
own chat template rendering and against a fresh environment run."""

import json

import numpy as np
import pytest

from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks, oracle_messages
from envace_jax.text import Role, load_tokenizer, parse_tool_calls, parse_tool_responses

ACT, REHEARSE = int(Role.ACT), int(Role.REHEARSE)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(seed=11, n=120, split="train")


def _template_ids(tokenizer, messages, tools):
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_oracle_messages_are_the_reference_and_leave_a_fresh_env_alone(tasks):
    other = DemoEnv()
    other.reset(tasks[0])
    before = other.state()
    for task in tasks:
        assert oracle_messages(task) == list(task.reference_messages)
    assert other.state() == before


def test_demonstrations_tag_actions_and_real_responses(tokenizer, tasks):
    demos = demonstrations(tasks, tokenizer)
    env = DemoEnv()
    lengths = []
    for task, demo in zip(tasks, demos, strict=True):
        msgs = oracle_messages(task)
        assert list(demo.ids) == _template_ids(tokenizer, msgs, task.template_tools)
        assert demo.ids.shape == demo.roles.shape == demo.segments.shape
        lengths.append(len(demo.ids))
        n = task.ground_truth["n_calls"]
        # ACT, REHEARSE alternate: n (call, response) pairs, then the final reply.
        assert demo.segment_roles() == [Role.ACT, Role.REHEARSE] * n + [Role.ACT]
        assert np.all((demo.segments == 0) == (demo.roles == 0))

        env.reset(task)
        call = None
        for s in range(1, demo.num_segments + 1):
            text = tokenizer.decode(demo.ids[demo.segments == s], skip_special_tokens=False)
            k = (s - 1) // 2
            if demo.segment_roles()[s - 1] == Role.REHEARSE:
                responses, problem = parse_tool_responses(text, num_calls=1)
                assert problem is None, text
                # The real environment, executing the call parsed from the ACT span.
                assert json.loads(responses[0]) == env.step([call])[0]
            elif k < n:
                action = parse_tool_calls(text.removesuffix("<|im_end|>"), task.tools)
                assert action.error is None, text
                (call,) = action.calls
                want = task.ground_truth["solution"][k]
                assert (call.name, call.arguments) == (want["name"], want["arguments"])
            else:
                assert text.removesuffix("<|im_end|>") == task.ground_truth["final_reply"]
        assert env.success(task.ground_truth["final_reply"])
    print(
        f"oracle demonstration tokens (demo tokenizer): min {min(lengths)}, "
        f"median {np.median(lengths):.0f}, mean {np.mean(lengths):.0f}, max {max(lengths)}"
    )


def test_demonstrations_are_deterministic(tokenizer, tasks):
    a = demonstrations(tasks[:10], tokenizer)
    b = demonstrations(tasks[:10], tokenizer)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.ids, y.ids) and np.array_equal(x.roles, y.roles)


def test_recovery_demonstrations_show_real_error_responses(tokenizer, tasks):
    """With failure demos, each sequence replays in a fresh environment: every REHEARSE span is
    what the environment answers the call of the ACT span before it, one lookup fails with
    not_found (a refused change would fail the task, so none is shown), and the episode still
    succeeds."""
    demos = demonstrations(tasks, tokenizer, failure_fraction=1.0, seed=3)
    env = DemoEnv()
    for task, demo in zip(tasks, demos, strict=True):
        env.reset(task)
        roles = demo.segment_roles()
        errors, call = [], None
        for s in range(1, demo.num_segments + 1):
            text = tokenizer.decode(demo.ids[demo.segments == s], skip_special_tokens=False)
            if roles[s - 1] == Role.REHEARSE:
                responses, problem = parse_tool_responses(text, num_calls=1)
                assert problem is None, text
                real = env.step([call])[0]
                assert json.loads(responses[0]) == real
                errors += [real["error"]["code"]] if "error" in real else []
            elif s < demo.num_segments:
                action = parse_tool_calls(text.removesuffix("<|im_end|>"), task.tools)
                assert action.error is None, text
                (call,) = action.calls
        assert errors == ["not_found"] and env.state()["refused"] == []
        assert roles == [Role.ACT, Role.REHEARSE] * (task.ground_truth["n_calls"] + 1) + [Role.ACT]
        assert env.success(task.ground_truth["final_reply"])
    # A share of the demonstrations: the rest are the plain oracle's.
    some = demonstrations(tasks, tokenizer, failure_fraction=0.25, seed=3)
    plain = demonstrations(tasks, tokenizer)
    changed = sum(not np.array_equal(a.ids, b.ids) for a, b in zip(some, plain, strict=True))
    assert 0.15 * len(tasks) < changed < 0.35 * len(tasks)


def test_unfinished_demonstrations_skip_the_last_call_and_fail(tokenizer, tasks):
    """With unfinished demos, each sequence is the oracle's without its last call and that
    call's response, and replayed in a fresh environment the episode fails when that call was
    a change (a branch that only replies needs none); a share of them leaves the rest exactly
    the oracle's."""
    demos = demonstrations(tasks, tokenizer, unfinished_fraction=1.0, seed=3)
    env = DemoEnv()
    for task, demo in zip(tasks, demos, strict=True):
        env.reset(task)
        calls = []
        roles = demo.segment_roles()
        for s in range(1, demo.num_segments):
            text = tokenizer.decode(demo.ids[demo.segments == s], skip_special_tokens=False)
            if roles[s - 1] == Role.ACT:
                action = parse_tool_calls(text.removesuffix("<|im_end|>"), task.tools)
                assert action.error is None, text
                calls += action.calls
                env.step(action.calls)
        solution = task.ground_truth["solution"]
        assert [c.name for c in calls] == [c["name"] for c in solution[:-1]]
        assert roles == [Role.ACT, Role.REHEARSE] * (len(solution) - 1) + [Role.ACT]
        changes = solution[-1]["name"] in ("cancel_order", "refund", "transfer")
        assert env.success(task.ground_truth["final_reply"]) == (not changes)
    some = demonstrations(tasks, tokenizer, unfinished_fraction=0.5, seed=3)
    plain = demonstrations(tasks, tokenizer)
    changed = sum(not np.array_equal(a.ids, b.ids) for a, b in zip(some, plain, strict=True))
    assert 0.35 * len(tasks) < changed < 0.65 * len(tasks)


def test_default_action_demonstrations_ignore_the_lookup_and_meet_the_real_world(tokenizer, tasks):
    """With default-action demos, each sequence makes the task's lookups, then its family's
    default change whatever the lookup showed; the environment's real answer follows (a refusal
    on the branches that need another call), then the agent's reply. Replayed in a fresh
    environment the episode succeeds exactly when the default was the task's branch."""
    from envace_jax.envs.demo import STATE_CHANGING

    demos = demonstrations(tasks, tokenizer, default_fraction=1.0, seed=3)
    env = DemoEnv()
    outcomes = set()
    for task, demo in zip(tasks, demos, strict=True):
        gt = task.ground_truth
        env.reset(task)
        roles = demo.segment_roles()
        calls, results = [], []
        for s in range(1, demo.num_segments):
            text = tokenizer.decode(demo.ids[demo.segments == s], skip_special_tokens=False)
            if roles[s - 1] == Role.ACT:
                action = parse_tool_calls(text.removesuffix("<|im_end|>"), task.tools)
                (call,) = action.calls
                calls.append({"name": call.name, "arguments": call.arguments})
                results += env.step(action.calls)
            else:
                responses, _ = parse_tool_responses(text, num_calls=1)
                assert json.loads(responses[0]) == results[-1]
        lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
        assert calls == [*lookups, gt["default_call"]]
        reply = tokenizer.decode(demo.ids[demo.segments == demo.num_segments])
        default_is_branch = gt["branch"] in ("open", "active")
        assert ("error" not in results[-1]) == default_is_branch
        assert env.success(reply.removesuffix("<|im_end|>")) == default_is_branch
        outcomes.add(default_is_branch)
    assert outcomes == {True, False}
