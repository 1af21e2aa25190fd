"""Exporting tasks in the reference layout loses nothing; the shipped sample files."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envace_jax.data import FOCUS_ON_VALUES, Task, export_tasks, load_tasks, open_tasks
from envace_jax.data.samples import SAMPLES, sample_path
from envace_jax.envs.demo import generate_tasks
from tests.task_samples import reference_row, task_dict


def assert_same_tasks(got: list[Task], want: list[Task]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for field in dataclasses.fields(Task):  # field by field first: clearer failures
            assert getattr(g, field.name) == getattr(w, field.name), (w.task_id, field.name)
        assert g == w


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_demo_tasks_round_trip(tmp_path, suffix, split):
    tasks = generate_tasks(3, 24, split)
    path = tmp_path / f"tasks.{suffix}"
    assert export_tasks(tasks, path, row_group_size=10) == 24
    assert_same_tasks(load_tasks(path).tasks, tasks)
    assert_same_tasks(list(open_tasks(str(path))), tasks)


def _odd_tasks() -> list[Task]:
    """Tasks with what the demo's lack: extra checklists, no ground truth, opening chats with
    extra keys and null content, a numeric task id, metadata with an `extra_info` of its own."""
    plain = Task.from_dict(task_dict(0))
    d = task_dict(1)
    d["extra_checklists"] = [d["checklist"]]
    del d["ground_truth"]
    d["messages"][0]["name"] = "ops"
    d["reference_messages"][0]["name"] = "ops"
    d["metadata"] = {"extra_info": {"index": 99, "note": None}, "tags": ["a", None, 3.5]}
    extra = Task.from_dict(d)
    row = reference_row(2, tools_as_json=False)  # the reference's: metadata from its columns
    ann = {  # CM2's annotation layout: user messages carry an empty tool_calls
        "uuid": "u-2",
        "messages": row["extra_info"]["messages"],
        "tools": row["extra_info"]["tools"],
        "checklists": row["extra_info"]["interaction_kwargs"]["checklist_list"],
    }
    cm2 = load_tasks_from_rows([row, ann])
    e = task_dict(3)
    e["task_id"] = 12345
    e["metadata"] = {}
    e["messages"].insert(1, {"role": "assistant", "content": None})
    e["reference_messages"].insert(1, {"role": "assistant", "content": None})
    numeric = Task.from_dict(e)
    return [plain, extra, *cm2, numeric]


def load_tasks_from_rows(rows):
    from envace_jax.data import parse_records

    return parse_records(rows, "rows").tasks


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_every_task_field_round_trips(tmp_path, suffix):
    tasks = _odd_tasks()
    assert tasks[2].metadata["extra_info"]["interaction_kwargs"] == {"name": "checklist"}
    assert tasks[3].messages[0]["tool_calls"] == []
    path = tmp_path / f"odd.{suffix}"
    export_tasks(tasks, path)
    assert_same_tasks(load_tasks(path).tasks, tasks)


def test_the_parquet_holds_the_reference_layout(tmp_path):
    tasks = generate_tasks(0, 3, "train") + _odd_tasks()
    path = tmp_path / "t.parquet"
    export_tasks(tasks, path, data_source="fallback")
    table = pq.read_table(path)
    schema = table.schema
    assert schema.field("messages").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    assert schema.field("data_source").type == pa.string()
    extra_type = schema.field("extra_info").type
    assert pa.types.is_struct(extra_type)
    for name in ("tools", "messages", "ground_truth", "task_metadata"):
        assert extra_type.field(name).type == pa.string(), name
    rows = table.to_pylist()
    for i, (row, task) in enumerate(zip(rows, tasks, strict=True)):
        extra = row["extra_info"]
        assert extra["index"] == i
        assert extra["original_index"] == task.task_id
        assert json.loads(extra["tools"]) == [dict(t) for t in task.tools]
        assert json.loads(extra["messages"]) == [dict(m) for m in task.reference_messages]
        assert extra["interaction_kwargs"]["name"] == "checklist"
        checklist_list = json.loads(extra["interaction_kwargs"]["checklist_list"])
        assert len(checklist_list) == len(task.checklists)
        for cl, want in zip(checklist_list, task.checklists, strict=True):
            assert len(cl) == len(want)
            for turn, want_turn in zip(cl, want, strict=True):
                for item, it in zip(turn, want_turn, strict=True):
                    assert item["question"] == it.question
                    assert item["focus_on"] == it.focus_on
                    assert item["pass_condition"] == it.pass_condition
                    assert item["weight"] == it.weight
                    assert item.get("rule") == (None if it.rule is None else dict(it.rule))
        gt = extra["ground_truth"]
        assert (None if gt is None else json.loads(gt)) == task.ground_truth
        assert json.loads(extra["task_metadata"]) == dict(task.metadata)
        opening = [{"role": m["role"], "content": m.get("content")} for m in task.messages]
        assert row["messages"] == opening
        plain = all(
            set(m) == {"role", "content"} and isinstance(m["content"], str) for m in task.messages
        )
        assert (extra["opening_messages"] is None) == plain
        want_source = task.metadata.get("data_source", "fallback")
        assert row["data_source"] == want_source
    assert rows[0]["data_source"] == "demo"
    assert rows[3]["extra_info"]["ground_truth"] is not None
    assert rows[4]["extra_info"]["ground_truth"] is None


def test_the_jsonl_holds_plain_json_with_tools_as_a_string(tmp_path):
    tasks = generate_tasks(0, 2, "validation")
    path = tmp_path / "t.jsonl"
    export_tasks(tasks, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, task in zip(rows, tasks, strict=True):
        extra = row["extra_info"]
        assert isinstance(extra["tools"], str)
        assert json.loads(extra["tools"]) == [dict(t) for t in task.tools]
        assert extra["messages"] == [dict(m) for m in task.reference_messages]
        assert extra["interaction_kwargs"]["checklist_list"][0][0][0]["rule"] == dict(
            task.checklist[0][0].rule
        )
        assert extra["ground_truth"] == task.ground_truth
        assert row["messages"] == [dict(m) for m in task.messages]
        assert "opening_messages" not in extra


def test_export_rejects_other_suffixes(tmp_path):
    with pytest.raises(ValueError, match=r"can only write \.parquet or \.jsonl"):
        export_tasks([], tmp_path / "t.json")


def test_export_cli(tmp_path):
    out = tmp_path / "val.parquet"
    cmd = [sys.executable, "-m", "envace_jax.envs.export", "--domain", "demo"]
    cmd += ["--split", "validation", "--tasks", "6", "--seed", "4", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote 6 demo validation tasks (seed 4) to {out}\n"
    assert_same_tasks(load_tasks(out).tasks, generate_tasks(4, 6, "validation"))
    bad = subprocess.run(
        [sys.executable, "-m", "envace_jax.envs.export", "--domain", "nope", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "'nope'" in bad.stderr and "Traceback" not in bad.stderr


# --- the shipped samples --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, split, n",
    [("demo_train.parquet", "train", 64), ("demo_validation.parquet", "validation", 32)],
)
def test_shipped_demo_samples_are_the_demo_tasks(name, split, n):
    """Made by the commands in envace_jax/data/samples/__init__.py; regenerate them if this
    fails after a change to the demo domain."""
    assert_same_tasks(load_tasks(sample_path(name)).tasks, generate_tasks(0, n, split))


def test_handwritten_sample_is_multi_turn_reference_layout():
    path = sample_path("handwritten.jsonl")
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(rows) == 4
    for row in rows:
        extra = row["extra_info"]
        assert set(row) == {"data_source", "messages", "extra_info"}
        tools = json.loads(extra["tools"])
        names = {t["function"]["name"] for t in tools}
        assert all(t["function"]["parameters"]["type"] == "object" for t in tools)
        conv = extra["messages"]
        users = [m for m in conv if m["role"] == "user"]
        checklist = extra["interaction_kwargs"]["checklist_list"][0]
        assert 2 <= len(users) <= 3 and len(checklist) == len(users)
        assert row["messages"] == conv[: conv.index(users[0]) + 1]
        # Every call names an offered tool and is answered by a tool message with its id.
        calls = 0
        for k, m in enumerate(conv):
            for call in m.get("tool_calls") or []:
                calls += 1
                assert call["function"]["name"] in names
                json.loads(call["function"]["arguments"])
                answer = conv[k + 1]
                assert answer["role"] == "tool" and answer["tool_call_id"] == call["id"]
        assert calls >= len(users) - 1
        for turn in checklist:
            assert abs(sum(item["weight"] for item in turn) - 1) < 1e-9
            for item in turn:
                assert item["focus_on"] in FOCUS_ON_VALUES
                assert "rule" not in item
                assert item["question"] and item["pass_condition"]
    tasks = load_tasks(path).tasks
    assert [t.num_turns for t in tasks] == [
        len(r["extra_info"]["interaction_kwargs"]["checklist_list"][0]) for r in rows
    ]


def test_every_sample_is_listed_and_opens_as_a_source():
    source = open_tasks(",".join(sample_path(n) for n in SAMPLES), where="samples")
    assert len(source) == 64 + 32 + 4
    with pytest.raises(ValueError, match="no shipped sample"):
        sample_path("nope.parquet")
