"""The `tau2_mock` and `tau2_telecom` domains: tau2-bench's solo tasks, environments and
evaluator as worlds.

Fast tests need nothing installed: the splits and the tool-message mapping. Slow tests need
`make tau2` (as `make test-slow` does): the domain's success against tau2's evaluator run
separately on the episode's own chat messages (gold, empty and one-call-short episodes of every
task), the logged responses against tau2's environment called directly, a refused call, the
splits, and the smoke job."""

import json
import subprocess
from pathlib import Path

import pytest

from envace_jax.envs import tau2_solo
from envace_jax.envs.base import error_code
from envace_jax.envs.tau2_package import find_tau2, tau2_venv, venv_environ
from envace_jax.envs.tau2_solo.env import TOOL_ERROR, response
from tests.conftest import world_smoke_summary

TAU2 = find_tau2(tau2_venv())
needs_tau2 = pytest.mark.skipif(TAU2 is None, reason="make tau2")


def test_splits_keep_the_package_test_split_and_carve_validation_from_the_rest():
    entries = [{"id": f"t{i:02d}", "split": "test" if i % 3 == 0 else "train"} for i in range(30)]
    splits = tau2_solo.assign_splits(entries)
    assert {i for i, s in splits.items() if s == "test"} == {f"t{i:02d}" for i in range(0, 30, 3)}
    assert list(splits.values()).count("validation") == 4  # every fifth of the 20 others
    plain = tau2_solo.assign_splits([{"id": f"m{i}", "split": None} for i in range(5)])
    assert sorted(plain.values()) == ["test", "train", "train", "train", "validation"]


def test_tool_messages_become_tool_responses():
    assert response({"content": '{"task_id": "t1"}', "error": False}) == {"task_id": "t1"}
    assert response({"content": "[1, 2]", "error": False}) == {"result": [1, 2]}
    assert response({"content": "Airplane Mode is now OFF.", "error": False}) == {
        "result": "Airplane Mode is now OFF."
    }
    refused = response({"content": "Error: User nobody not found", "error": True})
    assert (
        error_code(refused) == TOOL_ERROR and refused["error"]["message"] == "User nobody not found"
    )


# ---------------------------------------------------------------------------------------------
# Against the package (slow: tau2's venv, its data, environments and evaluator)


def gold(task):
    return list(task.reference_messages)


def empty(task):
    return [*task.messages, {"role": "assistant", "content": "Done."}]


def one_call_short(task):
    """The gold episode without its last call (and that call's response)."""
    messages = list(task.reference_messages)
    last = max(i for i, m in enumerate(messages) if m.get("tool_calls"))
    return messages[:last] + messages[last + 2 :]


VARIANTS = {"gold": gold, "empty": empty, "one_call_short": one_call_short}

# tau2's evaluator on an episode given as our chat messages: the calls and tool contents are
# rebuilt as tau2's own messages and scored as `tau2 run` scores a solo episode.
_EVALUATE = r"""
import json, sys, uuid
from tau2.agent.llm_agent import LLMSoloAgent
from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage
from tau2.data_model.simulation import SimulationRun, TerminationReason
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.registry import registry

tasks = {}
out = {}
for item in json.load(open(sys.argv[1])):
    domain, task_id = item["package_id"].split("/", 1)
    if domain not in tasks:
        tasks[domain] = {t.id: t for t in registry.get_tasks_loader(domain)()}
    task = tasks[domain][task_id]
    state = task.initial_state
    messages = list(state.message_history or []) if state else []
    pending = []
    for k, m in enumerate(item["messages"]):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                ToolCall(id=f"c{k}_{i}", name=f["name"], arguments=f["arguments"])
                for i, f in enumerate(c["function"] for c in m["tool_calls"])
            ]
            messages.append(AssistantMessage(role="assistant", tool_calls=calls))
            pending = [c.id for c in calls]
        elif m["role"] == "tool":
            tool = ToolMessage(id=pending.pop(0), role="tool", content=m["raw"], error=m["error"])
            messages.append(tool)
    messages.append(AssistantMessage(role="assistant", content=LLMSoloAgent.STOP_TOKEN))
    run = SimulationRun(id=str(uuid.uuid4()), task_id=task.id, start_time="", end_time="",
                        duration=0.0, termination_reason=TerminationReason.AGENT_STOP,
                        messages=messages)
    try:
        reward = evaluate_simulation(run, task, EvaluationType.ALL, True, domain).reward
    except Exception:  # an env assertion about a record the episode never made
        reward = 0.0
    out[item["package_id"] + "|" + item["variant"]] = reward
json.dump(out, open(sys.argv[2], "w"))
"""


def _in_tau2(tmp_path: Path, script: str, payload) -> dict:
    (tmp_path / "script.py").write_text(script)
    (tmp_path / "in.json").write_text(json.dumps(payload))
    subprocess.run(
        [str(TAU2), "script.py", "in.json", "out.json"],
        cwd=tmp_path,
        env=venv_environ(),
        check=True,
        capture_output=True,
    )
    return json.loads((tmp_path / "out.json").read_text())


@pytest.fixture(scope="module")
def tasks():
    return tau2_solo.all_tasks("mock") + tau2_solo.all_tasks("telecom")


@pytest.mark.slow
@needs_tau2
def test_success_agrees_with_tau2s_evaluator_on_every_task(tasks, tmp_path):
    assert len(tasks) == 5 + 114
    verdicts, payload = {}, []
    for task in tasks:
        domain = tau2_solo.domain(task.metadata["package_id"].split("/")[0])
        for name, variant in VARIANTS.items():
            messages = variant(task)
            env = domain.make_env()
            env.reset(task)
            calls = [c["function"] for m in messages for c in m.get("tool_calls") or []]
            raws = env.worker.request("step", env=env._id, calls=calls) if calls else []
            # What the world answered is what the episode's tool messages hold.
            logged = [m["content"] for m in messages if m["role"] == "tool"]
            assert logged == [json.dumps(response(r), ensure_ascii=False) for r in raws]
            verdicts[task.metadata["package_id"] + "|" + name] = env.success("Done.", messages)
            answers = iter(raws)  # tau2's evaluator replays the calls and wants its own text
            rebuilt = [
                {"role": "tool", "raw": (a := next(answers))["content"], "error": a["error"]}
                if m["role"] == "tool"
                else m
                for m in messages
            ]
            payload.append(
                {"package_id": task.metadata["package_id"], "variant": name, "messages": rebuilt}
            )
    official = _in_tau2(tmp_path, _EVALUATE, payload)
    assert {k: v == 1.0 for k, v in official.items()} == verdicts
    for name in VARIANTS:
        passed = sum(ok for k, ok in verdicts.items() if k.endswith("|" + name))
        assert passed == (len(tasks) if name == "gold" else 0), (name, passed)


_DIRECT = r"""
import json, sys
from tau2.registry import registry
out = {}
for item in json.load(open(sys.argv[1])):
    domain, task_id = item["package_id"].split("/", 1)
    task = {t.id: t for t in registry.get_tasks_loader(domain)()}[task_id]
    env = registry.get_env_constructor(domain)(solo_mode=True)
    state = task.initial_state
    env.set_state(state.initialization_data if state else None,
                  state.initialization_actions if state else None,
                  list(state.message_history or []) if state else [])
    answers = []
    for action in task.evaluation_criteria.actions:
        value = env.make_tool_call(action.name, requestor="assistant", **action.arguments)
        env.sync_tools()
        answers.append(env.to_json_str(value))
    out[item["package_id"]] = answers
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
@needs_tau2
def test_logged_responses_are_what_tau2s_tools_return(tasks, tmp_path):
    """The reference conversation's tool messages against tau2's environment called directly
    (its tools' `make_tool_call`, no tool-message wrapping), for every task."""
    direct = _in_tau2(tmp_path, _DIRECT, [{"package_id": t.metadata["package_id"]} for t in tasks])
    for task in tasks:
        logged = [m["content"] for m in task.reference_messages if m["role"] == "tool"]
        answers = direct[task.metadata["package_id"]]
        expected = [json.dumps(response({"content": a}), ensure_ascii=False) for a in answers]
        assert logged == expected, task.task_id


@pytest.mark.slow
@needs_tau2
def test_a_refused_call_is_an_error_response_and_the_world_goes_on(tasks):
    task = next(t for t in tasks if t.metadata["package_id"] == "mock/create_task_1")
    env = tau2_solo.domain("mock").make_env()
    env.reset(task)
    calls = [
        {"name": "create_task", "arguments": {"user_id": "nobody", "title": "x"}},
        {"name": "create_task", "arguments": {"user_id": 7}},
        {"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}},
    ]
    refused, bad, made = env.step(calls)
    assert error_code(refused) == TOOL_ERROR and "nobody" in refused["error"]["message"]
    assert error_code(bad) == "bad_args"
    assert error_code(made) is None and made["title"] == "Important Meeting"
    assert env.state()["n_calls"] == 2
    # The refusal changed nothing: the episode still solves the ticket.
    assert env.success("Done.")


@pytest.mark.slow
@needs_tau2
def test_splits_never_share_a_task(tasks):
    for name in tau2_solo.DOMAINS:
        dom = tau2_solo.domain(name)
        ids = {
            s: {t.task_id for t in dom.generate_tasks(0, 1000, s)} for s in set(tau2_solo.SPLITS)
        }
        assert (
            not (ids["train"] & (ids["validation"] | ids["test"]))
            and not ids["validation"] & ids["test"]
        )
        assert sum(map(len, ids.values())) == len(tau2_solo.all_tasks(name))


@pytest.mark.slow
@needs_tau2
def test_smoke_job_runs_warm_start_envace_and_evaluation(tmp_path):
    summary = world_smoke_summary("tau2.py:smoke", tmp_path / "run")
    assert summary["tasks"] == 1
