"""Write tasks as task files in the reference layout (verl parquet rows), losing nothing.

`export_tasks(tasks, path)` writes any tasks, `.parquet` or `.jsonl` by suffix; a registered
domain's tasks are written from the command line by `python -m envace_jax.envs.export`.

Each row holds, as the reference's rows do: `data_source` (the task's `metadata.data_source`,
else the given one), `messages` (the opening chat) and `extra_info` with `index` (row number),
`original_index` (the task id), `tools` (a JSON string, as the reference stores it),
`messages` (the full reference conversation) and `interaction_kwargs` (`name: "checklist"`,
`checklist_list`: [checklist][turn][item], the items' natural-language fields plus our `rule`
where there is one). So that reading the file back (`readers`, `sources`) gives tasks equal to
the originals, `extra_info` also holds `ground_truth` and `task_metadata` (the task's
`metadata`).

In parquet, values whose shape varies from row to row are JSON strings: a struct column holds
the union of every row's keys and cannot tell a missing key from a null one (the reference
stores `tools` as a JSON string for the same reason). So `extra_info.messages`,
`interaction_kwargs.checklist_list`, `ground_truth` and `task_metadata` are JSON strings there,
and `messages` is a list of {role, content} structs (what verl reads); a task whose opening
chat has other keys also gets `extra_info.opening_messages`, its exact opening chat as JSON.
In `.jsonl` every value but `tools` is plain JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from envace_jax.data.tasks import Task

DEFAULT_DATA_SOURCE = "checklist"  # the reference's default
ROW_GROUP_SIZE = 256  # rows per parquet row group (and per write): bounds writer memory


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _plain_opening(messages) -> bool:
    """Whether {role, content} structs hold these messages exactly."""
    return all(
        set(m) == {"role", "content"}
        and isinstance(m["role"], str)
        and isinstance(m["content"], str)
        for m in messages
    )


def reference_row(
    task: Task, index: int, *, data_source: str = DEFAULT_DATA_SOURCE, nested_as_json: bool
) -> dict[str, Any]:
    """One row of the reference layout; `nested_as_json` for parquet (see the module
    docstring)."""
    d = task.to_dict()
    checklist_list = [d["checklist"], *d.get("extra_checklists", [])]
    source = task.metadata.get("data_source")
    enc = _json if nested_as_json else (lambda v: v)
    extra: dict[str, Any] = {
        "index": index,
        "original_index": task.task_id,
        "tools": _json(d["tools"]),
        "messages": enc(d["reference_messages"]),
        "interaction_kwargs": {"name": "checklist", "checklist_list": enc(checklist_list)},
        "ground_truth": None if task.ground_truth is None else enc(d["ground_truth"]),
        "task_metadata": enc(d.get("metadata", {})),
    }
    messages = d["messages"]
    if nested_as_json:
        extra["opening_messages"] = None if _plain_opening(messages) else _json(messages)
        messages = [
            {
                "role": str(m.get("role")),
                "content": m["content"] if isinstance(m.get("content"), str) else None,
            }
            for m in messages
        ]
    else:
        extra = {k: v for k, v in extra.items() if v is not None}
    return {
        "data_source": source if isinstance(source, str) else data_source,
        "messages": messages,
        "extra_info": extra,
    }


def _parquet_schema():
    import pyarrow as pa

    string = pa.string()
    return pa.schema(
        [
            ("data_source", string),
            ("messages", pa.list_(pa.struct([("role", string), ("content", string)]))),
            (
                "extra_info",
                pa.struct(
                    [
                        ("index", pa.int64()),
                        ("original_index", string),
                        ("tools", string),
                        ("messages", string),
                        (
                            "interaction_kwargs",
                            pa.struct([("name", string), ("checklist_list", string)]),
                        ),
                        ("ground_truth", string),
                        ("task_metadata", string),
                        ("opening_messages", string),
                    ]
                ),
            ),
        ]
    )


def _chunks(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def export_tasks(
    tasks: Iterable[Task],
    path: str | os.PathLike,
    *,
    data_source: str = DEFAULT_DATA_SOURCE,
    row_group_size: int = ROW_GROUP_SIZE,
) -> int:
    """Write `tasks` (any iterable, consumed once, `row_group_size` at a time) to a `.parquet`
    or `.jsonl` file in the reference layout; returns the number written. Local paths or
    anything etils.epath opens."""
    path = os.fspath(path)
    if not path.endswith((".parquet", ".jsonl")):
        raise ValueError(f"{path}: can only write .parquet or .jsonl task files")
    parquet = path.endswith(".parquet")
    rows = (
        reference_row(t, i, data_source=data_source, nested_as_json=parquet)
        for i, t in enumerate(tasks)
    )
    n = 0
    if "://" in path:
        from etils import epath

        opened = epath.Path(path).open("wb")
    else:
        opened = open(path, "wb")
    with opened as f:
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = _parquet_schema()
            with pq.ParquetWriter(f, schema, compression="zstd") as writer:
                for chunk in _chunks(rows, row_group_size):
                    writer.write_table(
                        pa.Table.from_pylist(chunk, schema=schema), row_group_size=row_group_size
                    )
                    n += len(chunk)
        else:
            for row in rows:
                f.write((_json(row) + "\n").encode())
                n += 1
    return n
