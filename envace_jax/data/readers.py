"""Read task files (.json list, .jsonl, .parquet) into validated `Task`s.

Three record layouts are recognised, per record:

* ours: the keys of `Task.to_dict` (`task_id`, `messages`, `tools`, `reference_messages`,
  `checklist`, ...);
* the reference training layout (verl parquet rows): top-level `messages` (the opening chat),
  `data_source`, and `extra_info` (a struct or a JSON string) holding `original_index` (the
  task id), `index`, `tools` (a list or a JSON string), `messages` (the full reference
  conversation) and `interaction_kwargs.checklist_list` ([checklist][turn][item]);
* the annotation layout the reference data is converted from: `uuid`, `messages` (the full
  conversation), `tools`, `checklists` ([checklist][turn][item]).

Errors name the file, the record index and the field path in the record's own layout, e.g.
`tasks.jsonl: record 7: checklist[0][2].weight: expected a number >= 0, got "high"`.
Strict mode raises `TaskFileError` listing every bad record; lenient mode skips them but
returns each with its reason in `LoadReport.rejected` and logs the count.

Parquet struct columns cannot tell a missing key from a null one (a struct column holds the
union of the keys of all rows), so keys whose value is null are dropped from every object read
from parquet. Values read by other means (pandas, datasets) may arrive as numpy arrays and
scalars; `to_python` turns them into plain lists, dicts and numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE
from envace_jax.data.tasks import Task, parse_task
from envace_jax.data.validation import Errors, lone_surrogate_path

log = logging.getLogger(__name__)

SUFFIXES = (".json", ".jsonl", ".parquet")


class TaskFileError(ValueError):
    """A task file could not be read, or (strict mode) holds invalid records."""

    def __init__(self, message: str, rejected: Sequence[tuple[int, str]] = ()):
        self.rejected = list(rejected)
        super().__init__(message)


@dataclasses.dataclass
class LoadReport:
    """tasks: the valid records, in file order; rejected: (record index, reason) per bad one."""

    path: str
    tasks: list[Task]
    rejected: list[tuple[int, str]]
    num_records: int


def to_python(value: Any) -> Any:
    """numpy arrays / scalars (what pandas gives for nested parquet columns) to plain Python."""
    if isinstance(value, np.ndarray):
        return [to_python(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    return value


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _maybe_json(value: Any, path: str, err: Errors) -> Any:
    """Reference columns may hold JSON strings instead of nested values."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            err.add(path, f"expected JSON or a nested value, got a string that is not JSON ({e})")
            return None
    return value


def _from_reference(rec: Mapping[str, Any], err: Errors) -> tuple[dict, dict[str, str]]:
    """verl layout -> our layout, plus the field paths to report errors under."""
    extra = _maybe_json(rec["extra_info"], "extra_info", err)
    if not isinstance(extra, Mapping):
        if extra is not None:
            err.expect("extra_info", "an object", extra)
        return {}, {}
    extra = dict(extra)
    paths = {"messages": "messages"}
    out: dict[str, Any] = {"messages": rec.get("messages")}
    for key in ("original_index", "uuid", "index"):
        if extra.get(key) is not None:
            out["task_id"] = extra.pop(key) if key != "index" else extra[key]
            paths["task_id"] = f"extra_info.{key}"
            break
    else:
        paths["task_id"] = "extra_info.original_index"
    if "tools" in extra:
        out["tools"] = _maybe_json(extra.pop("tools"), "extra_info.tools", err)
    paths["tools"] = "extra_info.tools"
    if "messages" in extra:
        out["reference_messages"] = _maybe_json(extra.pop("messages"), "extra_info.messages", err)
        paths["reference_messages"] = "extra_info.messages"
    ikw = _maybe_json(extra.pop("interaction_kwargs", None), "extra_info.interaction_kwargs", err)
    base = "extra_info.interaction_kwargs.checklist_list"
    if not isinstance(ikw, Mapping) or "checklist_list" not in ikw:
        err.add(base, "missing required field")
        return out, paths
    ikw = dict(ikw)
    cls = _maybe_json(ikw.pop("checklist_list"), base, err)
    if not isinstance(cls, list) or not cls:
        err.expect(base, "a non-empty list of checklists [checklist][turn][item]", cls)
        return out, paths
    out["checklist"] = cls[0]
    out["extra_checklists"] = cls[1:]
    paths["checklist"] = f"{base}[0]"
    paths.update({f"extra_checklists[{c}]": f"{base}[{c + 1}]" for c in range(len(cls) - 1)})
    if "ground_truth" in extra:
        out["ground_truth"] = _maybe_json(extra.pop("ground_truth"), "extra_info.ground_truth", err)
        paths["ground_truth"] = "extra_info.ground_truth"
    # Everything else is kept, not dropped: other columns and extra_info keys go to metadata.
    meta = {k: v for k, v in rec.items() if k not in ("messages", "extra_info")}
    if ikw:
        extra["interaction_kwargs"] = ikw
    if extra:
        meta["extra_info"] = extra
    out["metadata"] = meta
    return out, paths


def _from_annotation(rec: Mapping[str, Any], err: Errors) -> tuple[dict, dict[str, str]]:
    """Annotation layout (full conversation in `messages`, `checklists`) -> our layout."""
    conv = rec.get("messages")
    out: dict[str, Any] = {"task_id": rec.get("uuid"), "tools": rec.get("tools")}
    paths = {"task_id": "uuid", "reference_messages": "messages", "messages": "messages"}
    if isinstance(out["tools"], str):
        out["tools"] = _maybe_json(out["tools"], "tools", err)
    if isinstance(conv, list):
        first_user = next(
            (i for i, m in enumerate(conv) if isinstance(m, Mapping) and m.get("role") == "user"),
            len(conv) - 1,
        )
        # The annotated data gives user messages an empty tool_calls list; the opening chat
        # keeps the messages as they are.
        out["messages"] = conv[: first_user + 1]
        out["reference_messages"] = conv
    else:
        out["messages"] = conv
    cls = rec.get("checklists")
    if not isinstance(cls, list) or not cls:
        err.expect("checklists", "a non-empty list of checklists [checklist][turn][item]", cls)
        return out, paths
    out["checklist"] = cls[0]
    out["extra_checklists"] = cls[1:]
    paths["checklist"] = "checklists[0]"
    paths.update({f"extra_checklists[{c}]": f"checklists[{c + 1}]" for c in range(len(cls) - 1)})
    meta = {k: v for k, v in rec.items() if k not in ("uuid", "messages", "tools", "checklists")}
    if meta:
        out["metadata"] = meta
    return out, paths


def parse_record(
    rec: Any, *, weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE
) -> tuple[Task | None, list[tuple[str, str]]]:
    """One record of any recognised layout -> (task or None, [(field path, problem)])."""
    err = Errors()
    if not isinstance(rec, Mapping):
        err.expect("", "a JSON object", rec)
        return None, err.items
    if (bad := lone_surrogate_path(rec)) is not None:
        err.add(bad, "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), not text")
        return None, err.items
    if "extra_info" in rec:
        d, paths = _from_reference(rec, err)
    elif "checklists" in rec and "checklist" not in rec:
        d, paths = _from_annotation(rec, err)
    else:
        d, paths = rec, {}
    if err.items:
        return None, err.items
    task = parse_task(d, err, weight_tolerance=weight_tolerance, paths=paths)
    return task, err.items


def parse_records(
    records: Iterable[Any],
    source: str,
    *,
    strict: bool = True,
    weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
) -> LoadReport:
    """Validate in-memory records (e.g. `DataFrame.to_dict("records")`); `source` names them
    in errors. Each record may also be an exception raised while reading it."""
    tasks: list[Task] = []
    rejected: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    n = 0
    for i, rec in enumerate(records):
        n += 1
        if isinstance(rec, Exception):
            rejected.append((i, str(rec)))
            continue
        try:
            task, errors = parse_record(to_python(rec), weight_tolerance=weight_tolerance)
        except RecursionError:  # validation recurses through the record's values
            task, errors = None, [("", TOO_DEEP)]
        if task is not None and task.task_id in seen:
            first = seen[task.task_id]
            errors = [("task_id", f"duplicate {task.task_id!r} (first at record {first})")]
            task = None
        if task is None:
            rejected.append((i, "; ".join(f"{p}: {m}" if p else m for p, m in errors)))
            continue
        seen[task.task_id] = i
        tasks.append(task)
    if rejected:
        lines = [f"{source}: record {i}: {reason}" for i, reason in rejected]
        if strict:
            head = f"{source}: {len(rejected)} of {n} records are invalid:\n"
            raise TaskFileError(head + "\n".join(lines), rejected)
        log.warning(
            "%s: skipped %d of %d invalid records (lenient mode):\n%s",
            source,
            len(rejected),
            n,
            "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else ""),
        )
    log.info("%s: loaded %d tasks", source, len(tasks))
    return LoadReport(path=source, tasks=tasks, rejected=rejected, num_records=n)


class _BadRecord(ValueError):
    pass


TOO_DEEP = "nested too deeply (beyond Python's recursion limit)"
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, which some editors write first


def _text(data: bytes, where: str) -> str:
    """`data` as UTF-8 text; ValueError naming `where` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason})"
        ) from None


def _iter_json(path: str) -> Iterator[Any]:
    with open(path, "rb") as f:
        data = f.read().removeprefix(_BOM)
    try:
        text = _text(data, "")
    except ValueError as e:
        raise TaskFileError(f"{path}: {e}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise TaskFileError(f"{path}: {TOO_DEEP}") from None
    except ValueError as e:
        raise TaskFileError(f"{path}: not valid JSON ({e})") from e
    if isinstance(data, Mapping) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        kind = type(data).__name__
        raise TaskFileError(f"{path}: expected a JSON list of task records, got {kind}")
    yield from data


def _iter_jsonl(path: str) -> Iterator[Any]:
    """One record per line; a line that is not UTF-8 or not JSON is a bad record of its own
    (lenient mode skips it)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            try:
                yield json.loads(_text(raw, f"line {lineno}: "))
            except RecursionError:
                yield _BadRecord(f"line {lineno}: {TOO_DEEP}")
            except ValueError as e:
                message = (
                    str(e) if str(e).startswith("line ") else f"line {lineno}: not valid JSON ({e})"
                )
                yield _BadRecord(message)


def _iter_parquet(path: str, batch_size: int = 256) -> Iterator[Any]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise TaskFileError(f"{path}: not a readable parquet file ({e})") from e
    for batch in pf.iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            yield _drop_nulls(row)


def iter_records(path: str | os.PathLike) -> Iterator[Any]:
    """Raw records of a task file, by suffix."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TaskFileError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        return _iter_jsonl(path)
    if path.endswith(".json"):
        return _iter_json(path)
    if path.endswith(".parquet"):
        return _iter_parquet(path)
    raise TaskFileError(f"{path}: unknown task file type; expected one of {list(SUFFIXES)}")


def load_tasks(
    path: str | os.PathLike,
    *,
    strict: bool = True,
    weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
) -> LoadReport:
    """Load and validate a .json (list), .jsonl or .parquet task file."""
    return parse_records(
        iter_records(path), os.fspath(path), strict=strict, weight_tolerance=weight_tolerance
    )


def save_tasks(path: str | os.PathLike, tasks: Iterable[Task]) -> None:
    """Write tasks in our layout as .jsonl (one per line) or .json (a list)."""
    path = os.fspath(path)
    dicts = [t.to_dict() for t in tasks]
    with open(path, "w", encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for d in dicts:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        elif path.endswith(".json"):
            json.dump(dicts, f, ensure_ascii=False, indent=1)
        else:
            raise TaskFileError(f"{path}: can only write .json or .jsonl task files")
