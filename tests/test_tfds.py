"""TFDS ArrayRecord datasets of tasks, built and read without TensorFlow, and TaskStream."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.data import Task, TaskStream, load_tasks, save_tasks
from envace_jax.data.tfds_builders import (
    DemoTasks,
    GeneratedTaskConfig,
    GeneratedTaskDataset,
    TaskFileConfig,
    TaskFileDataset,
    TaskRecords,
    load_split,
)
from tests.task_samples import reference_row, task_dict


def test_tensorflow_is_not_installed():
    assert importlib.util.find_spec("tensorflow") is None


def _tasks(lo: int, hi: int) -> list[Task]:
    return [Task.from_dict(task_dict(i)) for i in range(lo, hi)]


def _read_all(records) -> list[Task]:
    return [records[i] for i in range(len(records))]


def test_task_file_dataset_builds_and_reads_back(tmp_path):
    train, val = _tasks(0, 7), _tasks(7, 9)
    save_tasks(tmp_path / "train.jsonl", train)
    save_tasks(tmp_path / "val.json", val)
    rows = [reference_row(i, tools_as_json=False) for i in range(2)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    test = load_tasks(tmp_path / "test.parquet").tasks

    files = {
        "train": [str(tmp_path / "train.jsonl")],
        "validation": [str(tmp_path / "val.json")],
        "test": [str(tmp_path / "test.parquet")],
    }
    data_dir = tmp_path / "tfds"
    builder = TaskFileDataset(config=TaskFileConfig(name="mixed", files=files), data_dir=data_dir)
    builder.download_and_prepare()
    sources = builder.as_data_source()
    assert set(sources) == {"train", "validation", "test"}
    # Stored in file order, decoded back to the same tasks (unicode included).
    assert _read_all(TaskRecords(sources["train"])) == train
    assert _read_all(TaskRecords(sources["validation"])) == val
    assert _read_all(TaskRecords(sources["test"])) == test
    raw = sources["train"][0]
    assert json.loads(raw["task_json"]) == train[0].to_dict()
    # The same data through the registered name, and from the directory alone.
    by_name = tfds.data_source("task_file_dataset/mixed", data_dir=data_dir, split="validation")
    assert _read_all(TaskRecords(by_name)) == val
    version_dir = data_dir / "task_file_dataset" / "mixed" / "1.0.0"
    assert any(
        p.name.startswith("task_file_dataset-train.array_record") for p in version_dir.iterdir()
    )
    assert _read_all(load_split(version_dir, "test")) == test
    assert "tensorflow" not in sys.modules


def test_split_fractions_assign_by_task_id_not_file_order(tmp_path):
    tasks = _tasks(0, 40)
    save_tasks(tmp_path / "a.jsonl", tasks)
    save_tasks(tmp_path / "b.jsonl", tasks[::-1])

    def build(name, src):
        cfg = TaskFileConfig(name=name, sources=[str(tmp_path / src)])
        b = TaskFileDataset(config=cfg, data_dir=tmp_path / "tfds")
        b.download_and_prepare()
        return {
            s: {t.task_id for t in _read_all(TaskRecords(ds))}
            for s, ds in b.as_data_source().items()
        }

    a, b = build("a", "a.jsonl"), build("b", "b.jsonl")
    assert a == b
    assert set().union(*a.values()) == {t.task_id for t in tasks}
    assert sum(len(v) for v in a.values()) == 40  # disjoint
    assert len(a["train"]) > len(a["validation"]) and len(a["train"]) > len(a["test"])


def test_manual_dir_and_invalid_files(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    save_tasks(manual / "train.jsonl", _tasks(0, 3))
    save_tasks(manual / "test.json", _tasks(3, 4))
    b = TaskFileDataset(data_dir=tmp_path / "tfds")
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))
    assert {k: len(v) for k, v in b.as_data_source().items()} == {"train": 3, "test": 1}

    bad = [task_dict(0), task_dict(1)]
    bad[1]["checklist"][0][0]["weight"] = "high"
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    cfg = TaskFileConfig(name="bad", files={"train": [str(tmp_path / "bad.jsonl")]})
    bad_weight = r"bad\.jsonl: record 1 \(task 'task-1'\): checklist\[0\]\[0\]\.weight"
    with pytest.raises(ValueError, match=bad_weight):
        TaskFileDataset(config=cfg, data_dir=tmp_path / "tfds").download_and_prepare()
    cfg = TaskFileConfig(
        name="lenient", files={"train": [str(tmp_path / "bad.jsonl")]}, strict=False
    )
    b = TaskFileDataset(config=cfg, data_dir=tmp_path / "tfds")
    b.download_and_prepare()
    assert len(b.as_data_source()["train"]) == 1


def _toy_generator(seed, n, split):
    offset = {"train": 0, "validation": 10_000, "test": 20_000}[split]
    return [task_dict(seed * 100_000 + offset + i) for i in range(n)]


def test_generated_dataset_from_a_callable(tmp_path):
    cfg = GeneratedTaskConfig(
        name="toy", generator=_toy_generator, seed=2, split_sizes={"train": 6, "test": 3}
    )
    b = GeneratedTaskDataset(config=cfg, data_dir=tmp_path)
    b.download_and_prepare()
    src = b.as_data_source()
    for split, n in (("train", 6), ("test", 3)):
        expected = [Task.from_dict(d) for d in _toy_generator(2, n, split)]
        assert _read_all(TaskRecords(src[split])) == expected

    leaky = GeneratedTaskConfig(
        name="leaky",
        generator=lambda seed, n, split: [task_dict(i) for i in range(n)],
        split_sizes={"train": 3, "test": 2},
    )
    with pytest.raises(ValueError, match="appears in split 'train' and 'test'"):
        GeneratedTaskDataset(config=leaky, data_dir=tmp_path).download_and_prepare()


def test_demo_tasks_dataset(tmp_path):
    from envace_jax.envs.demo import generate_tasks

    b = DemoTasks(config="small", data_dir=tmp_path)
    b.download_and_prepare()
    src = b.as_data_source()
    assert {k: len(v) for k, v in src.items()} == {"train": 64, "validation": 16, "test": 16}
    assert _read_all(TaskRecords(src["validation"])) == generate_tasks(0, 16, "validation")
    assert "tensorflow" not in sys.modules


# --------------------------------------------------------------------------------------------
# TaskStream


def test_resume_from_saved_position_across_epoch_boundaries(tmp_path):
    cfg = GeneratedTaskConfig(name="stream", generator=_toy_generator, split_sizes={"train": 7})
    b = GeneratedTaskDataset(config=cfg, data_dir=tmp_path)
    b.download_and_prepare()
    records = TaskRecords(b.as_data_source()["train"])

    full = TaskStream(records, seed=11)
    batches = [full.next_batch(3) for _ in range(6)]  # 18 records: epochs 0, 1 and part of 2
    ids = [t.task_id for batch in batches for t in batch]
    assert full.position == 18 and full.epoch == 2

    saved = TaskStream(records, seed=11)
    saved.next_batch(3), saved.next_batch(3), saved.next_batch(3)
    pos = saved.position
    assert pos == 9  # inside epoch 1
    resumed = TaskStream(records, seed=11, position=pos)
    rest = [t.task_id for _ in range(3) for t in resumed.next_batch(3)]
    assert rest == ids[9:]

    # Every epoch visits every record once, in a different order each epoch.
    epochs = [ids[0:7], ids[7:14]]
    all_ids = sorted(records[i].task_id for i in range(7))
    assert sorted(epochs[0]) == all_ids and sorted(epochs[1]) == all_ids
    assert epochs[0] != epochs[1]
    other_seed = [t.task_id for t in TaskStream(records, seed=12).next_batch(7)]
    assert other_seed != epochs[0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    seed=st.integers(0, 2**31),
    start=st.integers(0, 100),
    take=st.integers(1, 50),
    shards=st.integers(1, 4),
)
def test_resume_equals_uninterrupted(n, seed, start, take, shards):
    if n < shards:
        return
    source = list(range(n))
    for s in range(shards):
        full = TaskStream(source, seed, shard_index=s, shard_count=shards)
        full.next_batch(start)
        expected = full.next_batch(take)
        resumed = TaskStream(source, seed, position=start, shard_index=s, shard_count=shards)
        assert resumed.next_batch(take) == expected
        assert resumed.position == start + take


def test_shards_partition_each_epoch():
    n, k, seed = 23, 4, 5
    per = n // k
    streams = [TaskStream(list(range(n)), seed, shard_index=s, shard_count=k) for s in range(k)]
    for _ in range(3):  # three epochs
        parts = [st_.next_batch(per) for st_ in streams]
        flat = [x for p in parts for x in p]
        assert len(set(flat)) == per * k  # disjoint, no repeats
        assert all(len(p) == per for p in parts)
    assert all(s.position == 3 * per for s in streams)


def test_unshuffled_stream_and_bad_arguments():
    s = TaskStream(list("abcde"), seed=0, shuffle=False)
    assert s.next_batch(7) == list("abcdeab")
    assert next(iter(s)) == "c"
    with pytest.raises(ValueError, match="too few for 3 shards"):
        TaskStream([1, 2], seed=0, shard_count=3)
    with pytest.raises(ValueError, match="shard_index"):
        TaskStream([1, 2], seed=0, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="position"):
        TaskStream([1, 2], seed=0, position=-1)
    rng_order = np.random.default_rng(np.random.SeedSequence([0, 0])).permutation(5)
    assert TaskStream(list(range(5)), seed=0).next_batch(5) == rng_order.tolist()
