"""The `bfcl_multi_turn` domain: bfcl-eval's multi-turn entries, backends and checker as a world.

Fast tests need nothing installed: the split by entry number, the schema mapping, an episode in
the package's result layout. Slow tests use the package's own virtual environment (created on
first use): the domain's success against `bfcl evaluate` on gold, empty and one-call-short
episodes of every entry, the logged responses against the backend classes called directly, a
backend that raises, and the smoke job."""

import json
import subprocess
from pathlib import Path

import pytest

from envace_jax.envs import bfcl_multi_turn as bmt
from envace_jax.envs.base import error_code
from envace_jax.envs.bfcl_multi_turn.env import EXECUTION_ERROR, response, result_turns
from envace_jax.text.tool_calls import parse_tool_calls
from tests.conftest import world_smoke_summary


def test_splits_follow_the_entry_number():
    splits = [bmt.split_of(f"multi_turn_base_{i}") for i in range(200)]
    assert splits.count("test") == 40 and splits.count("validation") == 40
    assert splits[:6] == ["test", "validation", "train", "train", "train", "test"]
    with pytest.raises(ValueError, match="split must be one of"):
        bmt.generate_tasks(0, 1, "dev")


def test_package_types_map_to_json_schema():
    doc = {
        "type": "dict",
        "properties": {
            "xs": {"type": "array", "items": {"type": "float"}},
            "pair": {"type": "tuple", "items": {"type": "string"}},
            "anything": {"type": "any", "description": "whatever"},
            "type": {"type": "string"},  # a parameter named like the keyword
        },
        "required": ["xs"],
    }
    schema = bmt.json_schema(doc)
    assert schema["type"] == "object"
    assert schema["properties"]["xs"]["items"] == {"type": "number"}
    assert schema["properties"]["pair"]["type"] == "array"
    assert schema["properties"]["anything"] == {"description": "whatever"}
    assert schema["properties"]["type"] == {"type": "string"}
    tool = bmt.tool_of({"name": "f", "description": "d", "parameters": doc, "response": {}})
    assert set(tool["function"]) == {"name", "description", "parameters"}


def test_backend_strings_become_tool_responses():
    assert response('{"watchlist": ["NVDA"]}') == {"watchlist": ["NVDA"]}
    assert response("None") == {"result": "None"}
    assert response("[1, 2]") == {"result": "[1, 2]"}
    raised = response("Error during execution: division by zero")
    assert error_code(raised) == EXECUTION_ERROR and "division" in raised["error"]["message"]


def test_an_episode_in_the_package_result_layout():
    call = {"type": "function", "function": {"name": "cd", "arguments": {"folder": "a b"}}}
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "{}"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "Nothing to do."},
    ]
    turns = result_turns(messages)
    assert len(turns) == 2 and turns[1] == ["Nothing to do."]
    step, reply = turns[0]
    assert reply == "Done."
    parsed = parse_tool_calls(step)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("cd", {"folder": "a b"})]


# ---------------------------------------------------------------------------------------------
# Against the package (slow: its virtual environment, then its data and backends)


def _turns_of(task):
    """The reference conversation cut at each user message: [[user, ...steps], ...]."""
    turns = []
    for m in task.reference_messages:
        if m["role"] == "user":
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def gold(task):
    return [m for turn in _turns_of(task) for m in turn]


def empty(task):
    return [
        m for turn in _turns_of(task) for m in (turn[0], {"role": "assistant", "content": "Done."})
    ]


def one_call_short(task):
    """Every turn without its last call (and that call's response)."""
    out = []
    for turn in _turns_of(task):
        steps = [i for i, m in enumerate(turn) if m.get("tool_calls")]
        out += turn[: steps[-1]] + turn[steps[-1] + 2 :] if steps else turn
    return out


VARIANTS = {"gold": gold, "empty": empty, "one_call_short": one_call_short}


@pytest.fixture(scope="module")
def tasks():
    return bmt.all_tasks()


def _bfcl_evaluate(root: Path, results: dict[str, list]) -> set[str]:
    """The ids `bfcl evaluate` passes, from result files holding `results` (id -> turns)."""
    from envace_jax.envs.bfcl_package import default_venv, ensure_venv
    from envace_jax.eval import bfcl

    python = ensure_venv(default_venv())
    root.mkdir(parents=True)
    (root / "launch_bfcl.py").write_text(bfcl._LAUNCHER)
    path = root / "result" / bfcl.MODEL_ID / "multi_turn" / "BFCL_v4_multi_turn_base_result.json"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"id": i, "result": r}) + "\n" for i, r in results.items()))
    bfcl.evaluate(python, root, ["multi_turn_base"], partial=True, timeout=600)
    (score,) = (root / "score" / bfcl.MODEL_ID).rglob("BFCL_v4_multi_turn_base_score.json")
    lines = [json.loads(line) for line in score.read_text().splitlines() if line.strip()]
    assert lines[0]["total_count"] == len(results)
    return set(results) - {line["id"] for line in lines[1:]}


@pytest.mark.slow
def test_success_agrees_with_bfcl_evaluate_on_every_entry(tasks, tmp_path):
    assert len(tasks) == 200
    env = bmt.BfclEnv()
    for name, variant in VARIANTS.items():
        verdicts, results = {}, {}
        for task in tasks:
            messages = variant(task)
            env.reset(task)
            verdicts[task.task_id] = env.success("Done.", messages)
            results[task.task_id] = result_turns(messages)
        official = _bfcl_evaluate(tmp_path / name, results)
        assert {i for i, ok in verdicts.items() if ok} == official, name
        expected = len(tasks) if name == "gold" else 0
        assert len(official) == expected, (name, sorted(official)[:5])


_DIRECT = r"""
import copy, importlib, json, sys
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
from bfcl_eval.utils import load_dataset_entry
entries = {e["id"]: e for e in load_dataset_entry("multi_turn_base")}
out = {}
for task_id, turns in json.load(open(sys.argv[1])).items():
    entry, instances, methods = entries[task_id], {}, {}
    for name in entry["involved_classes"]:
        module = importlib.import_module(CLASS_FILE_PATH_MAPPING[name])
        instances[name] = getattr(module, name)()
        if hasattr(instances[name], "_load_scenario"):
            config = copy.deepcopy(entry["initial_config"].get(name, {}))
            instances[name]._load_scenario(config)
        for m in dir(instances[name]):
            if not m.startswith("_"):
                methods[m] = getattr(instances[name], m)
    responses = []
    for calls in turns:
        for call in calls:
            value = methods[call["name"]](**call["arguments"])
            try:  # what the package's executor logs: JSON for a dict that has one
                text = json.dumps(value) if isinstance(value, dict) else str(value)
            except TypeError:
                text = str(value)
            responses.append(text)
    out[task_id] = responses
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_logged_responses_are_what_the_backend_classes_return(tasks, tmp_path):
    """The reference conversation's tool messages against the backend classes called directly
    (no executor, no call strings), for 60 entries of every backend combination."""
    from envace_jax.envs.bfcl_package import default_venv, ensure_venv, venv_environ

    chosen = tasks[:60]
    (tmp_path / "calls.json").write_text(
        json.dumps({t.task_id: t.ground_truth["calls"] for t in chosen})
    )
    (tmp_path / "direct.py").write_text(_DIRECT)
    subprocess.run(
        [str(ensure_venv(default_venv())), "direct.py", "calls.json", "out.json"],
        cwd=tmp_path,
        env=venv_environ(tmp_path),
        check=True,
        capture_output=True,
    )
    direct = json.loads((tmp_path / "out.json").read_text())
    for task in chosen:
        logged = [m["content"] for m in task.reference_messages if m["role"] == "tool"]
        expected = [json.dumps(response(r), ensure_ascii=False) for r in direct[task.task_id]]
        assert logged == expected, task.task_id


BREAK_OUT = "USD'); import os; ('"


@pytest.mark.slow
def test_model_calls_never_crash_the_world(tasks):
    """A backend that raises, a tool the task lacks, arguments off the schema and an argument
    written to break out of the call string: each gets an error response, and only the calls
    that match the schema reach the backends."""
    task = next(t for t in tasks if "TravelAPI" in t.metadata["involved_classes"])
    env = bmt.BfclEnv()
    env.reset(task)
    rate = "compute_exchange_rate"
    calls = [
        {"name": rate, "arguments": {"base_currency": "XXX", "target_currency": "YYY", "value": 1}},
        {"name": "no_such_tool", "arguments": {}},
        {"name": rate, "arguments": {"base_currency": "USD", "target_currency": "EUR"}},
        {
            "name": rate,
            "arguments": {
                "base_currency": "USD'); import os; ('",
                "target_currency": "EUR",
                "value": 2,
            },
        },
    ]
    raised, unknown, bad, injected = env.step(calls)
    assert error_code(raised) == EXECUTION_ERROR
    assert "No available exchange rate" in raised["error"]["message"]
    assert error_code(unknown) == "unknown_tool" and error_code(bad) == "bad_args"
    assert error_code(injected) == EXECUTION_ERROR  # a literal currency name, not code
    assert env.state()["n_calls"] == 2
    rates = env.step(
        [{"name": rate, "arguments": {**calls[3]["arguments"], "base_currency": "USD"}}]
    )
    assert error_code(rates[0]) is None and "exchanged_value" in rates[0], rates


@pytest.mark.slow
def test_splits_never_share_an_entry(tasks):
    ids = {s: {t.task_id for t in bmt.generate_tasks(0, 1000, s)} for s in set(bmt.SPLITS)}
    assert sum(map(len, ids.values())) == len(tasks) == 200
    assert not (ids["train"] & (ids["validation"] | ids["test"]))
    assert not ids["validation"] & ids["test"]


@pytest.mark.slow
def test_smoke_job_runs_warm_start_envace_and_evaluation(tmp_path):
    summary = world_smoke_summary("bfcl_multi_turn.py:smoke", tmp_path / "run")
    assert summary["tasks"] == 2
