"""Task records: schema, validation errors (file, record, field path), readers for every layout."""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envace_jax.data import (
    ChecklistItem,
    Task,
    TaskFileError,
    TaskValidationError,
    load_tasks,
    parse_records,
    save_tasks,
)
from tests.task_samples import reference_row, task_dict


def errors_of(d: dict) -> list[tuple[str, str]]:
    with pytest.raises(TaskValidationError) as e:
        Task.from_dict(d)
    return e.value.errors


def test_round_trip_keeps_every_field():
    d = task_dict(3)
    task = Task.from_dict(d)
    assert task.task_id == "task-3"
    assert task.num_turns == 2
    assert task.checklist[0][0].rule == {
        "kind": "call",
        "tool": "get_weather",
        "args": {"city": "Oslo"},
    }
    assert task.checklist[1][0].weight == 0.6
    assert task.user_message(1)["content"] == "And book a table for two at Maaemo."
    assert task.to_dict() == d
    assert Task.from_dict(json.loads(task.to_json())) == task


def test_reference_messages_default_to_opening_chat_for_single_turn_tasks():
    d = task_dict()
    d["checklist"] = d["checklist"][:1]
    del d["reference_messages"]
    task = Task.from_dict(d)
    assert task.reference_messages == tuple(d["messages"])


@pytest.mark.parametrize(
    "mutate, path, fragment",
    [
        (lambda d: d.pop("checklist"), "checklist", "missing required field"),
        (lambda d: d.pop("task_id"), "task_id", "missing required field"),
        (lambda d: d.update(messages="hello"), "messages", 'got "hello"'),
        (lambda d: d["messages"][1].update(role="human"), "messages[1].role", '"human"'),
        (lambda d: d["messages"][1].update(content=7), "messages[1].content", "got 7"),
        (
            lambda d: d["checklist"][0][2].update(weight="high"),
            "checklist[0][2].weight",
            'expected a number >= 0, got "high"',
        ),
        (lambda d: d["checklist"][0][1].update(weight=-0.25), "checklist[0][1].weight", "-0.25"),
        (lambda d: d["checklist"][1][0].update(weight=0.5), "checklist[1]", "sum to 0.9"),
        (lambda d: d["checklist"].__setitem__(1, []), "checklist[1]", "at least one"),
        (
            lambda d: d["checklist"][0][0].update(focus_on="vibes"),
            "checklist[0][0].focus_on",
            "vibes",
        ),
        (lambda d: d["checklist"][0][0].pop("question"), "checklist[0][0].question", "missing"),
        (
            lambda d: d["checklist"][0][0].update(required_for_next_turn="yes"),
            "checklist[0][0].required_for_next_turn",
            "true or false",
        ),
        (
            lambda d: d["checklist"][0][1].update(failure_examples="x"),
            "checklist[0][1].failure_examples",
            "list of strings",
        ),
        (
            lambda d: d["checklist"][0][0].update(rule={"tool": "x"}),
            "checklist[0][0].rule.kind",
            "",
        ),
        (lambda d: d.update(ground_truth=[1]), "ground_truth", "JSON object"),
        (lambda d: d["tools"][0].update(type="fn"), "tools[0].type", '"fn"'),
        (lambda d: d["tools"][0]["function"].pop("name"), "tools[0].function.name", "missing"),
        (
            lambda d: d["tools"][0]["function"]["parameters"].update(type="array"),
            "tools[0].function.parameters.type",
            '"array"',
        ),
        (
            lambda d: d["tools"][0]["function"]["parameters"]["properties"]["city"].update(
                type="str"
            ),
            "tools[0].function.parameters.properties.city.type",
            '"str"',
        ),
        (
            lambda d: d["tools"][0]["function"]["parameters"]["properties"]["tags"]["items"].update(
                type="text"
            ),
            "tools[0].function.parameters.properties.tags.items.type",
            '"text"',
        ),
        (
            lambda d: d["tools"][1]["function"]["parameters"]["properties"]["party"].update(
                required=["age"]
            ),
            "tools[1].function.parameters.properties.party.required",
            '["age"]',
        ),
        (
            lambda d: d["tools"][1]["function"].update(name="get_weather"),
            "tools[1].function.name",
            "duplicate tool name",
        ),
        (
            lambda d: d["reference_messages"].pop(5),
            "reference_messages",
            "1 user messages but the checklist has 2 turns",
        ),
        (
            lambda d: d["messages"].append({"role": "assistant", "content": "hi"}),
            "messages",
            "ending with its only user message",
        ),
        (lambda d: d.update(colour="red"), "", "unknown fields ['colour']"),
    ],
)
def test_each_defect_names_its_field(mutate, path, fragment):
    d = task_dict()
    mutate(d)
    errs = errors_of(d)
    assert any(p == path and fragment in m for p, m in errs), errs


def test_all_errors_of_a_record_are_reported_together():
    d = task_dict()
    d["checklist"][0][2]["weight"] = "high"
    d["tools"][0]["type"] = "fn"
    d["messages"][1]["role"] = "human"
    paths = {p for p, _ in errors_of(d)}
    assert {"checklist[0][2].weight", "tools[0].type", "messages[1].role"} <= paths


def test_weights_sum_to_one_within_tolerance():
    d = task_dict()
    d["checklist"][1][0]["weight"] = 0.6 + 5e-7
    Task.from_dict(d)  # within 1e-6
    d["checklist"][1][0]["weight"] = 0.6 + 5e-3
    assert any(p == "checklist[1]" for p, _ in errors_of(d))
    Task.from_dict(d, weight_tolerance=1e-2)


def test_evidence_objects_keep_their_sources():
    d = task_dict()
    ev = [{"turn": 0, "step": 1, "from": "assistant.tool_calls", "snippet": "get_weather"}]
    d["checklist"][0][0]["evidence"] = ev
    it = Task.from_dict(d).checklist[0][0]
    assert it.evidence == ("get_weather",)
    assert it.to_dict()["evidence"] == ev
    assert ChecklistItem.from_dict(it.to_dict()) == it


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _defective_records():
    good = [task_dict(i) for i in range(9)]
    recs: list = copy.deepcopy(good)
    recs[1].pop("tools")  # missing field
    recs[2]["messages"] = {"role": "user"}  # wrong type
    recs[3]["tools"][0]["function"]["parameters"]["required"] = ["country"]  # bad tool schema
    recs[4] = "{not json"
    recs[5]["checklist"][0][2]["weight"] = "high"  # bad weight
    recs[6]["task_id"] = "task-0"  # duplicate id
    recs[7]["checklist"][0][2]["weight"] = "high"  # the example in the docs
    return recs


EXPECTED_REJECTS = {
    1: "tools: missing required field",
    2: 'messages: expected a list of chat messages, got {"role": "user"}',
    3: 'tools[0].function.parameters.required: names properties that are not defined: ["country"]',
    4: "not valid JSON",
    5: 'checklist[0][2].weight: expected a number >= 0, got "high"',
    6: "task_id: duplicate 'task-0' (first at record 0)",
    7: 'checklist[0][2].weight: expected a number >= 0, got "high"',
}


def test_strict_jsonl_lists_every_bad_record_with_file_record_and_field(tmp_path):
    path = tmp_path / "tasks.jsonl"
    _write_jsonl(path, _defective_records())
    with pytest.raises(TaskFileError) as e:
        load_tasks(path)
    msg = str(e.value)
    assert f"{path}: 7 of 9 records are invalid" in msg
    for i, fragment in EXPECTED_REJECTS.items():
        # Each line names the record's task id when it has one (record 4 is not JSON at all;
        # record 6 reuses task-0's id).
        label = f"record {i}" if i == 4 else f"record {i} (task 'task-{0 if i == 6 else i}')"
        line = next(ln for ln in msg.splitlines() if ln.startswith(f"{path}: {label}: "))
        assert fragment in line, (i, line)
    expected = f"{path}: record 7 (task 'task-7'): checklist[0][2].weight: expected a number >= 0"
    assert expected + ', got "high"' in msg
    assert [i for i, _ in e.value.rejected] == sorted(EXPECTED_REJECTS)


def test_lenient_mode_skips_but_returns_and_logs_every_rejection(tmp_path, caplog):
    path = tmp_path / "tasks.jsonl"
    _write_jsonl(path, _defective_records())
    with caplog.at_level(logging.WARNING):
        report = load_tasks(path, strict=False)
    assert [t.task_id for t in report.tasks] == ["task-0", "task-8"]
    assert report.num_records == 9
    assert [i for i, _ in report.rejected] == sorted(EXPECTED_REJECTS)
    for i, reason in report.rejected:
        assert EXPECTED_REJECTS[i] in reason
    assert "skipped 7 of 9 invalid records" in caplog.text


def test_json_list_file_and_writer_round_trip(tmp_path):
    tasks = [Task.from_dict(task_dict(i)) for i in range(3)]
    for name in ("tasks.json", "tasks.jsonl"):
        save_tasks(tmp_path / name, tasks)
        assert load_tasks(tmp_path / name).tasks == tasks
    bad = [task_dict(0), task_dict(1)]
    bad[1]["checklist"][0][0]["weight"] = None
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(
        TaskFileError,
        match=r"bad\.json: record 1 \(task 'task-1'\): checklist\[0\]\[0\]\.weight: miss",
    ):
        load_tasks(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(TaskFileError, match=r"broken\.json: not valid JSON"):
        load_tasks(tmp_path / "broken.json")
    (tmp_path / "tasks.csv").write_text("a,b\n")
    with pytest.raises(TaskFileError, match="unknown task file type"):
        load_tasks(tmp_path / "tasks.csv")


def _check_reference_task(task: Task, row: dict):
    """The loaded task holds the reference row's content unchanged."""
    extra = row["extra_info"]
    tools = extra["tools"]
    tools = json.loads(tools) if isinstance(tools, str) else tools
    cl = extra["interaction_kwargs"]["checklist_list"]
    assert task.task_id == extra["original_index"]
    assert list(task.messages) == row["messages"]
    assert list(task.tools) == tools
    assert list(task.reference_messages) == extra["messages"]
    assert [[it.to_dict() for it in turn] for turn in task.checklist] == cl[0]
    assert task.extra_checklists == ()
    assert task.metadata["data_source"] == row["data_source"]
    assert task.metadata["extra_info"] == {
        "index": extra["index"],
        "interaction_kwargs": {"name": "checklist"},
    }
    assert task.checklist[0][0].evidence == ('"name": "get_games"',)
    assert task.checklist[0][0].required_for_next_turn is True


@pytest.mark.parametrize("tools_as_json", [True, False])
def test_reference_parquet_layout_loads_unchanged(tmp_path, tools_as_json):
    rows = [reference_row(i, tools_as_json=tools_as_json) for i in range(3)]
    table = pa.Table.from_pylist(rows)
    # Nested columns really are structs and lists (not JSON strings) in this file.
    ei = table.schema.field("extra_info").type
    assert pa.types.is_struct(ei)
    assert pa.types.is_list(ei.field("interaction_kwargs").type.field("checklist_list").type)
    if not tools_as_json:  # a struct column holds the union of every row's property names
        assert (
            ei.field("tools")
            .type.value_type.field("function")
            .type.field("parameters")
            .type.field("properties")
            .type.num_fields
            == 3
        )
    path = tmp_path / "checklist_train.parquet"
    pq.write_table(table, path)
    report = load_tasks(path)
    assert report.rejected == [] and len(report.tasks) == 3
    for task, row in zip(report.tasks, rows, strict=True):
        _check_reference_task(task, row)


def test_reference_parquet_errors_name_the_reference_field_paths(tmp_path):
    rows = [reference_row(i, tools_as_json=True) for i in range(3)]
    rows[1]["extra_info"]["interaction_kwargs"]["checklist_list"][0][1][0]["weight"] = 0.5
    rows[2]["extra_info"]["tools"] = "[{broken"
    path = tmp_path / "ref.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = load_tasks(path, strict=False)
    assert [t.task_id for t in report.tasks] == ["uuid-0"]
    reasons = dict(report.rejected)
    assert (
        "extra_info.interaction_kwargs.checklist_list[0][1]: item weights sum to 0.5" in reasons[1]
    )
    assert reasons[2].startswith("extra_info.tools: expected JSON or a nested value")


def test_records_from_pandas_style_numpy_arrays_load():
    row = reference_row(0, tools_as_json=False)
    ex = row["extra_info"]
    # pandas gives nested parquet columns as numpy object arrays, and numbers as numpy scalars.
    np_row = {
        "data_source": row["data_source"],
        "messages": np.array(row["messages"], dtype=object),
        "extra_info": {
            **ex,
            "index": np.int64(0),
            "messages": np.array(ex["messages"], dtype=object),
            "tools": np.array(ex["tools"], dtype=object),
        },
    }
    report = parse_records([np_row], "frame")
    _check_reference_task(report.tasks[0], row)


def test_annotation_layout_loads(tmp_path):
    row = reference_row(4, tools_as_json=False)
    ann = {
        "uuid": "u-4",
        "messages": row["extra_info"]["messages"],
        "tools": row["extra_info"]["tools"],
        "checklists": row["extra_info"]["interaction_kwargs"]["checklist_list"] * 2,
    }
    (tmp_path / "ann.json").write_text(json.dumps([ann]))
    (task,) = load_tasks(tmp_path / "ann.json").tasks
    assert task.task_id == "u-4"
    assert list(task.messages) == ann["messages"][:1]
    assert list(task.reference_messages) == ann["messages"]
    assert len(task.checklists) == 2 and task.extra_checklists[0] == task.checklist


def test_the_loaders_edges_are_clear_errors_per_record(tmp_path):
    """Bytes that are not UTF-8 aborted even lenient mode with a raw UnicodeDecodeError, deep
    nesting raised RecursionError, a byte-order mark rejected the first record, and a lone
    surrogate in a task id was accepted."""
    good = [json.dumps(task_dict(i)).encode() for i in range(3)]
    bad_id = json.dumps({**task_dict(3), "task_id": "t-\ud800"}).encode()  # the escape, as sent
    lines = [
        b"\xef\xbb\xbf" + good[0],  # a byte-order mark before the first record
        good[1][:-1] + b', "metadata": {"note": "caf\xe9"}}',  # Latin-1, not UTF-8
        b"[" * 100_000 + b"]" * 100_000,
        bad_id,
        good[2],
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TaskFileError) as e:
        load_tasks(path)
    message = str(e.value)
    assert "3 of 5 records are invalid" in message
    assert "record 1: line 2: not UTF-8 text (byte 0xe9" in message
    assert "record 2: line 3: nested too deeply" in message
    assert "record 3: task_id: holds a lone UTF-16 surrogate" in message
    report = load_tasks(path, strict=False)
    assert [t.task_id for t in report.tasks] == [task_dict(i)["task_id"] for i in (0, 2)]
    assert [i for i, _ in report.rejected] == [1, 2, 3]


def test_a_json_file_with_a_bom_loads_and_one_with_bad_bytes_or_deep_nesting_is_one_error(
    tmp_path,
):
    path = tmp_path / "tasks.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([task_dict(0)]).encode())
    assert len(load_tasks(path).tasks) == 1
    path.write_bytes(json.dumps([task_dict(0)]).encode()[:-2] + b"\xff]")
    with pytest.raises(TaskFileError, match=r"tasks.json: not UTF-8 text \(byte 0xff at offset"):
        load_tasks(path, strict=False)
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(TaskFileError, match="tasks.json: nested too deeply"):
        load_tasks(path, strict=False)
