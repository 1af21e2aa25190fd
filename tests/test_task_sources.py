"""Task files as a job's data (`envace_jax.data.sources.open_tasks`) and the validate CLI:
specs, sharding, filters, bad records named by file, record index and task id."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envace_jax.data import TaskFileError, load_tasks
from envace_jax.data.sources import INVALID_TOOLS, PROMPT_TOO_LONG, Rejection, open_tasks

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
        },
    },
}


def ref_record(i: int, prefix: str = "task") -> dict:
    """A small valid record in the reference layout, task id `{prefix}-{i}`."""
    user = f"Look up key {i}." + " please" * (i % 7)
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"key": str(i)})},
    }
    conv = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps({"value": i})},
        {"role": "assistant", "content": f"The value is {i}."},
    ]
    item = {
        "question": "Did it look the key up?",
        "focus_on": "assistant.tool_calls",
        "pass_condition": f"lookup is called with key {i}",
        "failure_examples": [],
        "evidence": [],
        "weight": 1.0,
        "required_for_next_turn": False,
    }
    return {
        "data_source": "unit",
        "messages": conv[:1],
        "extra_info": {
            "index": i,
            "original_index": f"{prefix}-{i}",
            "tools": json.dumps([LOOKUP]),
            "messages": conv,
            "interaction_kwargs": {"name": "checklist", "checklist_list": [[[item]]]},
        },
    }


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def write_parquet(path, records) -> str:
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=1000)
    return str(path)


def ids(source) -> list[str]:
    return [t.task_id for t in source]


# --- one bad record among 10,000 ---------------------------------------------------------------

BAD = 7321


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    records = [ref_record(i) for i in range(10_000)]
    del records[BAD]["extra_info"]["interaction_kwargs"]["checklist_list"][0][0][0]["weight"]
    path = tmp_path_factory.mktemp("big") / "tasks.parquet"
    return write_parquet(path, records)


EXPECTED_BAD = Rejection(
    file="",
    index=BAD,
    task_id=f"task-{BAD}",
    reason="extra_info.interaction_kwargs.checklist_list[0][0][0].weight: missing required field",
)


def test_lenient_reads_9999_and_reports_the_bad_record(big_file, caplog):
    with caplog.at_level(logging.WARNING):
        source = open_tasks(big_file, skip_invalid=True, where="config.data.train_files")
    assert len(source) == 9_999
    assert source.report.rejected == [EXPECTED_BAD._replace(file=big_file)]
    assert source.report.records == source.report.total_records == 10_000
    assert source.report.valid == 9_999
    assert source.task_ids == [f"task-{i}" for i in range(10_000) if i != BAD]
    assert source.origin(BAD) == (big_file, BAD + 1)  # the task after the bad record
    # Tasks parse on access and hold what was written.
    assert source[BAD].reference_messages[-1]["content"] == f"The value is {BAD + 1}."
    assert source[-1].task_id == "task-9999"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 1 of 10000 invalid records" in warnings[0].getMessage()
    assert f"record {BAD} (task 'task-{BAD}')" in warnings[0].getMessage()


def test_strict_raises_with_the_same_report(big_file):
    with pytest.raises(TaskFileError) as e:
        open_tasks(big_file, where="config.data.train_files")
    message = str(e.value)
    assert message.splitlines() == [
        "config.data.train_files: 1 of 10000 records are invalid:",
        f"{big_file}: record {BAD} (task 'task-{BAD}'): {EXPECTED_BAD.reason}",
    ]
    assert e.value.rejected == [EXPECTED_BAD._replace(file=big_file)]


def test_strict_lists_every_bad_record_and_every_defect(tmp_path):
    records = [ref_record(i) for i in range(6)]
    item = records[1]["extra_info"]["interaction_kwargs"]["checklist_list"][0][0][0]
    item["weight"] = "high"
    item["focus_on"] = "vibes"
    records[4]["messages"] = [{"role": "user", "content": "something else"}]
    path = write_jsonl(tmp_path / "t.jsonl", records[:3] + ["{not json"] + records[3:])
    with pytest.raises(TaskFileError) as e:
        open_tasks(path, where="w")
    lines = str(e.value).splitlines()
    assert lines[0] == "w: 3 of 7 records are invalid:"
    base = "extra_info.interaction_kwargs.checklist_list[0][0][0]"
    assert lines[1].startswith(
        f"{path}: record 1 (task 'task-1'): {base}.focus_on: expected one of"
    )
    assert f'; {base}.weight: expected a number >= 0, got "high"' in lines[1]
    assert lines[2].startswith(f"{path}: record 3: line 4: not valid JSON")
    assert lines[3] == (
        f"{path}: record 5 (task 'task-4'): extra_info.messages: first user message differs "
        "from the opening chat's user message"
    )
    assert len(lines) == 4


# --- specs ----------------------------------------------------------------------------------


@pytest.fixture
def task_dir(tmp_path):
    d = tmp_path / "tasks"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [ref_record(i, "a") for i in range(3)])
    write_parquet(d / "b.parquet", [ref_record(i, "b") for i in range(4)])
    (d / "c.json").write_text(json.dumps([ref_record(i, "c") for i in range(2)]))
    (d / "notes.txt").write_text("not a task file")
    (d / "_SUCCESS").write_text("")
    write_jsonl(d / ".hidden.jsonl", ["{broken"])
    (d / "sub").mkdir()
    write_jsonl(d / "sub" / "deep.jsonl", [ref_record(0, "deep")])
    return d


A = [f"a-{i}" for i in range(3)]
B = [f"b-{i}" for i in range(4)]
C = [f"c-{i}" for i in range(2)]


def test_directory_glob_comma_and_sequence_specs(task_dir):
    assert ids(open_tasks(str(task_dir))) == A + B + C
    assert ids(open_tasks(f"{task_dir}/*.jsonl")) == A
    assert ids(open_tasks(f"{task_dir}/[bc].*")) == B + C
    assert ids(open_tasks(f" {task_dir}/c.json , {task_dir}/a.jsonl,")) == C + A
    assert ids(open_tasks([task_dir / "b.parquet", str(task_dir / "sub")])) == B + ["deep-0"]
    source = open_tasks(f"{task_dir}/sub/deep.jsonl,{task_dir}/c.json")
    assert source.report.files == [f"{task_dir}/sub/deep.jsonl", f"{task_dir}/c.json"]
    assert source.origin(2) == (f"{task_dir}/c.json", 1)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{d}/nope.parquet", "K: {d}/nope.parquet: no such file"),
        ("{d}/a.jsonl,{d}/missing.jsonl", "K: {d}/missing.jsonl: no such file"),
        ("{d}/*.csv", "K: {d}/*.csv: matches no task files (.json, .jsonl, .parquet)"),
        ("{d}/notes.txt", "K: {d}/notes.txt: unknown task file type"),
        ("{d}/empty", "K: {d}/empty: a directory with no task files"),
        (" , ", "K: no task files given"),
        ("{d},{d}/a.jsonl", "K: {d}/a.jsonl is named twice (by '{d}' and '{d}/a.jsonl')"),
    ],
)
def test_spec_errors_name_the_config_key(task_dir, spec, message):
    (task_dir / "empty").mkdir()
    with pytest.raises(TaskFileError) as e:
        open_tasks(spec.format(d=task_dir), where="K")
    assert str(e.value).startswith(message.format(d=task_dir))
    assert "\n" not in str(e.value)


def test_missing_file_names_the_key_exactly(tmp_path):
    with pytest.raises(TaskFileError) as e:
        open_tasks(str(tmp_path / "y.parquet"), where="config.data.train_files")
    assert str(e.value) == f"config.data.train_files: {tmp_path}/y.parquet: no such file"


def test_unreadable_file_names_the_key_and_the_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskFileError, match=r"^K: .*bad\.parquet: not a readable parquet file"):
        open_tasks(str(tmp_path / "bad.parquet"), where="K", skip_invalid=True)


def test_duplicate_ids_across_files_name_both_places(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [ref_record(i) for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [ref_record(i) for i in (7, 2)])
    with pytest.raises(TaskFileError) as e:
        open_tasks(f"{a},{b}", where="K")
    assert str(e.value).splitlines()[1] == (
        f"{b}: record 1 (task 'task-2'): task_id: duplicate 'task-2' (first at {a}: record 2)"
    )
    assert ids(open_tasks([a, b], skip_invalid=True)) == ["task-0", "task-1", "task-2", "task-7"]


def test_no_tasks_left_is_an_error(tmp_path):
    rec = ref_record(0)
    rec["extra_info"]["index"] = "x"
    del rec["extra_info"]["original_index"]
    rec["messages"] = "{nope"
    path = write_jsonl(tmp_path / "t.jsonl", [rec])
    with pytest.raises(TaskFileError, match=r"^K: no tasks left: 1 records in 1 file: 0 valid"):
        open_tasks(path, where="K", skip_invalid=True)


# --- shards ---------------------------------------------------------------------------------


def test_two_shards_partition_the_records_across_files(tmp_path):
    # 5 + 4 records: the second file's first record is record 5 of the concatenation.
    a = write_jsonl(tmp_path / "a.jsonl", [ref_record(i, "a") for i in range(5)])
    b = write_parquet(tmp_path / "b.parquet", [ref_record(i, "b") for i in range(4)])
    everything = [f"a-{i}" for i in range(5)] + [f"b-{i}" for i in range(4)]
    shards = [open_tasks([a, b], shard_index=s, shard_count=2) for s in (0, 1)]
    assert ids(shards[0]) == everything[0::2]
    assert ids(shards[1]) == everything[1::2]
    for s in shards:
        assert s.report.total_records == 9
        assert s.report.records == len(s)
    assert shards[1].origin(2) == (b, 0)  # record 5 overall is b's first
    three = [ids(open_tasks([a, b], shard_index=s, shard_count=3)) for s in range(3)]
    assert sorted(sum(three, [])) == sorted(everything)
    assert three[2] == [everything[2], everything[5], everything[8]]


def test_a_shard_reports_only_its_own_bad_records(tmp_path):
    records = [ref_record(i) for i in range(8)]
    del records[3]["extra_info"]["interaction_kwargs"]["checklist_list"][0][0][0]["question"]
    path = write_parquet(tmp_path / "t.parquet", records)
    even = open_tasks(path, shard_index=0, shard_count=2)
    assert even.report.rejected == [] and ids(even) == [f"task-{i}" for i in (0, 2, 4, 6)]
    with pytest.raises(TaskFileError, match=r"record 3 \(task 'task-3'\): extra_info\.inter"):
        open_tasks(path, shard_index=1, shard_count=2)
    odd = open_tasks(path, shard_index=1, shard_count=2, skip_invalid=True)
    assert [(r.index, r.task_id) for r in odd.report.rejected] == [(3, "task-3")]
    assert ids(odd) == ["task-1", "task-5", "task-7"]
    with pytest.raises(ValueError, match="shard_index must be in"):
        open_tasks(path, shard_index=2, shard_count=2)


# --- filters --------------------------------------------------------------------------------


def _tool_variants():
    records = [ref_record(i) for i in range(8)]
    tools = copy.deepcopy([LOOKUP])
    tools[0]["function"]["parameters"]["required"] = ["missing_arg"]
    records[1]["extra_info"]["tools"] = json.dumps(tools)  # invalid schema only: dropped
    records[2]["extra_info"]["tools"] = "[{not json"  # unparseable: dropped
    both = copy.deepcopy(records[3])
    both["extra_info"]["tools"] = json.dumps(tools)
    both["extra_info"]["interaction_kwargs"]["checklist_list"][0][0][0]["weight"] = 0.5
    records[3] = both  # a tool defect and another one: a bad record
    del records[4]["extra_info"]["tools"]  # no tools at all: a bad record
    return records


def test_invalid_tool_schemas_are_a_filter_whatever_skip_invalid_says(tmp_path, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", _tool_variants())
    with pytest.raises(TaskFileError) as e:
        open_tasks(path)
    assert [(r.index, r.task_id) for r in e.value.rejected] == [(3, "task-3"), (4, "task-4")]
    with caplog.at_level(logging.WARNING):
        source = open_tasks(path, skip_invalid=True)
    report = source.report
    assert ids(source) == [f"task-{i}" for i in (0, 5, 6, 7)]
    assert report.dropped == {INVALID_TOOLS: 2, PROMPT_TOO_LONG: 0}
    assert [(r.index, r.task_id) for r in report.filtered] == [(1, "task-1"), (2, "task-2")]
    assert report.filtered[0].reason == (
        "invalid_tools: extra_info.tools[0].function.parameters.required: names properties "
        'that are not defined: ["missing_arg"]'
    )
    assert report.filtered[1].reason.startswith("invalid_tools: extra_info.tools: expected JSON")
    assert (report.records, report.valid, len(report.rejected)) == (8, 4, 2)
    assert "dropped 2 records whose tool schemas are invalid" in caplog.text
    assert report.summary() == (
        "8 records in 1 file: 4 valid, 2 invalid, 2 dropped by filters "
        "(2 invalid_tools, 0 prompt_too_long)"
    )


def test_long_prompts_are_dropped_and_counted(tmp_path):
    records = [ref_record(i) for i in range(14)]
    path = write_parquet(tmp_path / "t.parquet", records)
    words = {
        r["extra_info"]["original_index"]: len(r["messages"][0]["content"].split()) for r in records
    }

    def prompt_length(task):  # the trainer passes the tokenizer's count; words will do here
        return len(task.messages[-1]["content"].split()) + 2 * len(task.tools)

    source = open_tasks(path, prompt_length=prompt_length, max_prompt_tokens=9)
    kept = [tid for tid, n in words.items() if n + 2 <= 9]
    assert ids(source) == kept and 0 < len(kept) < 14
    assert source.report.dropped[PROMPT_TOO_LONG] == 14 - len(kept)
    first = next(r for r in source.report.filtered)
    tid = first.task_id
    assert first.reason == (
        f"prompt_too_long: the opening prompt is {words[tid] + 2} tokens with its tools "
        "rendered, over max_prompt_tokens = 9"
    )
    # 0 turns the filter off; a filter without a way to count is a mistake.
    assert len(open_tasks(path, prompt_length=prompt_length, max_prompt_tokens=0)) == 14
    with pytest.raises(ValueError, match="needs a prompt_length"):
        open_tasks(path, max_prompt_tokens=9)


def test_a_prompt_that_cannot_be_rendered_is_a_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [ref_record(i) for i in range(3)])

    def prompt_length(task):
        if task.task_id == "task-1":
            raise ValueError("template says no")
        return 1

    with pytest.raises(TaskFileError, match=r"record 1 \(task 'task-1'\): its prompt could not"):
        open_tasks(path, prompt_length=prompt_length, max_prompt_tokens=5)


# --- what is kept ---------------------------------------------------------------------------


def test_source_tasks_equal_the_files_tasks_and_are_stored_compressed(tmp_path):
    records = [ref_record(i) for i in range(50)]
    path = write_parquet(tmp_path / "t.parquet", records)
    source = open_tasks(path)
    assert list(source) == load_tasks(path).tasks
    for task, rec in zip(source, records, strict=True):
        extra = rec["extra_info"]
        assert task.task_id == extra["original_index"]
        assert list(task.reference_messages) == extra["messages"]
        assert list(task.tools) == json.loads(extra["tools"])
    assert source.stored_bytes < sum(len(json.dumps(r)) for r in records) / 2
    assert source[2:4] == [source[2], source[3]]
    with pytest.raises(IndexError):
        source[50]


def test_loose_weight_tolerance_holds_on_access(tmp_path):
    rec = ref_record(0)
    rec["extra_info"]["interaction_kwargs"]["checklist_list"][0][0][0]["weight"] = 0.99
    path = write_jsonl(tmp_path / "t.jsonl", [rec])
    with pytest.raises(TaskFileError, match="weights sum to 0.99"):
        open_tasks(path)
    assert open_tasks(path, weight_tolerance=0.02)[0].checklist[0][0].weight == 0.99


# --- the validate CLI -----------------------------------------------------------------------


def validate(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "envace_jax.data.validate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_validate_cli_lines_and_exit_codes(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [ref_record(i, "g") for i in range(3)])
    done = validate(good)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "3 records in 1 file: 3 valid, 0 invalid, 0 dropped by filters "
        "(0 invalid_tools, 0 prompt_too_long)"
    ]

    records = _tool_variants()
    records[6]["extra_info"]["original_index"] = "g-1"  # a duplicate of good.jsonl's
    bad = write_parquet(tmp_path / "bad.parquet", records)
    done = validate(f"{good},{bad}")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        f"{bad}: record 3 (task 'task-3'): extra_info.tools[0].function.parameters.required"
    )
    weights = "extra_info.interaction_kwargs.checklist_list[0][0]: item weights sum to 0.5"
    assert f"; {weights}" in lines[0]
    assert lines[1] == f"{bad}: record 4 (task 'task-4'): extra_info.tools: missing required field"
    assert lines[2] == (
        f"{bad}: record 6 (task 'g-1'): task_id: duplicate 'g-1' (first at {good}: record 1)"
    )
    assert lines[3].startswith(f"{bad}: record 1 (task 'task-1'): dropped (invalid_tools): ")
    assert lines[4].startswith(f"{bad}: record 2 (task 'task-2'): dropped (invalid_tools): ")
    assert lines[5] == (
        "11 records in 2 files: 6 valid, 3 invalid, 2 dropped by filters "
        "(2 invalid_tools, 0 prompt_too_long)"
    )
    assert len(lines) == 6

    # Records only a filter drops: exit 0.
    dropped = write_jsonl(tmp_path / "dropped.jsonl", _tool_variants()[:3])
    assert validate(dropped).returncode == 0

    # Usage errors: one line on stderr, no traceback.
    done = validate(good, str(tmp_path / "nope.parquet"))
    assert done.returncode == 2
    assert done.stderr == f"validate: {tmp_path}/nope.parquet: no such file\n"
    assert done.stdout == ""
    done = validate("--max-prompt-tokens", "10", good)
    assert done.returncode == 2 and "needs --tokenizer" in done.stderr

    # A file that cannot be read at all: its line, then the others are still checked.
    (tmp_path / "broken.json").write_text("[{")
    done = validate(str(tmp_path / "broken.json"), good)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0].startswith(f"{tmp_path}/broken.json: not valid JSON")
    assert done.stdout.splitlines()[-1].startswith("3 records in 2 files: 3 valid, 0 invalid")


def test_validate_cli_counts_long_prompts_with_a_tokenizer():
    from envace_jax.data.samples import sample_path
    from envace_jax.text.role_pieces import prompt_ids
    from envace_jax.text.tokenizer import load_tokenizer

    path = sample_path("handwritten.jsonl")
    tokenizer = load_tokenizer("demo")
    lengths = {
        t.task_id: len(prompt_ids(tokenizer, t.messages, t.template_tools))
        for t in load_tasks(path).tasks
    }
    limit = sorted(lengths.values())[1]  # two of the four fit
    done = validate("--max-prompt-tokens", str(limit), "--tokenizer", "demo", path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    too_long = sorted(tid for tid, n in lengths.items() if n > limit)
    assert len(too_long) == 2
    assert sorted(line.split("'")[1] for line in lines[:-1]) == too_long
    for line in lines[:-1]:
        tid = line.split("'")[1]
        assert line.endswith(
            f"dropped (prompt_too_long): the opening prompt is {lengths[tid]} tokens with its "
            f"tools rendered, over max_prompt_tokens = {limit}"
        )
    assert lines[-1] == (
        "4 records in 1 file: 2 valid, 0 invalid, 2 dropped by filters "
        "(0 invalid_tools, 2 prompt_too_long)"
    )
