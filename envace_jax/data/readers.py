"""Read task files (.json list, .jsonl, .parquet) into validated `Task`s.

Three record layouts are recognised, per record:

* ours: the keys of `Task.to_dict` (`task_id`, `messages`, `tools`, `reference_messages`,
  `checklist`, ...);
* the reference training layout (verl parquet rows): top-level `messages` (the opening chat),
  `data_source`, and `extra_info` (a struct or a JSON string) holding `original_index` (the
  task id), `index`, `tools` (a list or a JSON string), `messages` (the full reference
  conversation) and `interaction_kwargs.checklist_list` ([checklist][turn][item]). Any of the
  nested values (the top-level `messages` too) may be a JSON string. Files written by
  `envace_jax.data.export` add `extra_info.ground_truth`, `extra_info.task_metadata` (the
  task's own `metadata`, taken as it is: the layout's bookkeeping, `data_source`,
  `extra_info.index` and `interaction_kwargs.name`, is then not copied into it) and, where a
  parquet `messages` column of {role, content} structs cannot hold the opening chat exactly,
  `extra_info.opening_messages` (which then is the opening chat);
* the annotation layout the reference data is converted from: `uuid`, `messages` (the full
  conversation), `tools`, `checklists` ([checklist][turn][item]).

Errors name the file, the record index, the task id when the record has a usable one, and the
field path in the record's own layout, e.g.
`tasks.jsonl: record 7 (task 'abc-12'): checklist[0][2].weight: expected a number >= 0, got
"high"`.
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
from envace_jax.data.validation import LONE_SURROGATE, Errors, lone_surrogate_path

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
    out: dict[str, Any] = {"messages": _maybe_json(rec.get("messages"), "messages", err)}
    if "opening_messages" in extra:  # export's exact opening chat, where `messages` is lossy
        opening = extra.pop("opening_messages")
        out["messages"] = _maybe_json(opening, "extra_info.opening_messages", err)
        paths["messages"] = "extra_info.opening_messages"
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
        gt = _maybe_json(extra.pop("ground_truth"), "extra_info.ground_truth", err)
        if gt is not None:
            out["ground_truth"] = gt
        paths["ground_truth"] = "extra_info.ground_truth"
    if "task_metadata" in extra:  # written by envace_jax.data.export: the task's metadata
        own = _maybe_json(extra.pop("task_metadata"), "extra_info.task_metadata", err)
        paths["metadata"] = "extra_info.task_metadata"
        # The layout's bookkeeping (regenerated on export) is not the task's; anything else
        # someone added to the file is kept.
        extra.pop("index", None)
        if set(ikw) <= {"name"}:
            ikw = {}
        meta = {k: v for k, v in rec.items() if k not in ("messages", "extra_info", "data_source")}
        if isinstance(own, Mapping):
            meta = {**meta, **own}
        elif own is not None:
            meta = own  # parse_task names the bad value
    else:
        # Everything else is kept, not dropped: other columns and extra_info keys go to
        # metadata.
        meta = {k: v for k, v in rec.items() if k not in ("messages", "extra_info")}
    if ikw:
        extra["interaction_kwargs"] = ikw
    if extra and isinstance(meta, dict):
        if isinstance(meta.get("extra_info"), Mapping):
            extra = {**meta["extra_info"], **extra}
        meta = {**meta, "extra_info": extra}
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


def record_task_id(rec: Any) -> str | None:
    """The task id a raw record names (`task_id`, the reference's `extra_info.original_index`,
    the annotation layout's `uuid`), for error messages; None when it has no usable one."""
    if not isinstance(rec, Mapping):
        return None
    if "extra_info" in rec:
        extra = rec["extra_info"]
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except (ValueError, RecursionError):
                return None
        if not isinstance(extra, Mapping):
            return None
        value = next(
            (extra[k] for k in ("original_index", "uuid", "index") if extra.get(k) is not None),
            None,
        )
    elif "checklists" in rec and "checklist" not in rec:
        value = rec.get("uuid")
    else:
        value = rec.get("task_id")
    if isinstance(value, (np.integer, int)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value or LONE_SURROGATE.search(value):
        return None
    return value if len(value) <= 80 else value[:77] + "..."


def record_label(source: str, index: int, task_id: str | None = None) -> str:
    """`tasks.parquet: record 7 (task 'abc-12')`: where a record is, for messages."""
    return f"{source}: record {index}" + (f" (task {task_id!r})" if task_id else "")


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
    labels: list[str] = []
    seen: dict[str, int] = {}
    n = 0
    for i, rec in enumerate(records):
        n += 1
        if isinstance(rec, Exception):
            rejected.append((i, str(rec)))
            labels.append(record_label(source, i))
            continue
        try:
            rec = to_python(rec)
            task, errors = parse_record(rec, weight_tolerance=weight_tolerance)
        except RecursionError:  # validation recurses through the record's values
            task, errors = None, [("", TOO_DEEP)]
        if task is not None and task.task_id in seen:
            first = seen[task.task_id]
            errors = [("task_id", f"duplicate {task.task_id!r} (first at record {first})")]
            task = None
        if task is None:
            rejected.append((i, "; ".join(f"{p}: {m}" if p else m for p, m in errors)))
            labels.append(record_label(source, i, record_task_id(rec)))
            continue
        seen[task.task_id] = i
        tasks.append(task)
    if rejected:
        lines = [f"{label}: {reason}" for label, (_, reason) in zip(labels, rejected, strict=True)]
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


SKIPPED = object()  # `read_records`' placeholder for a record its `keep` left undecoded


def open_binary(path: str):
    """A task file opened for reading bytes: local paths directly, others (gs://...) through
    etils.epath."""
    if "://" not in path:
        return open(path, "rb")
    from etils import epath

    return epath.Path(path).open("rb")


def _exists(path: str) -> bool:
    if "://" not in path:
        return os.path.exists(path)
    from etils import epath

    return epath.Path(path).exists()


def _iter_json(path: str, keep) -> Iterator[Any]:
    with open_binary(path) as f:
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
    for i, rec in enumerate(data):
        yield rec if keep is None or keep(i) else SKIPPED


def _jsonl_record(raw: bytes, lineno: int) -> Any:
    try:
        return json.loads(_text(raw, f"line {lineno}: "))
    except RecursionError:
        return _BadRecord(f"line {lineno}: {TOO_DEEP}")
    except ValueError as e:
        message = str(e) if str(e).startswith("line ") else f"line {lineno}: not valid JSON ({e})"
        return _BadRecord(message)


def _iter_jsonl(path: str, keep) -> Iterator[Any]:
    """One record per non-blank line; a line that is not UTF-8 or not JSON is a bad record of
    its own (lenient mode skips it)."""
    i = 0
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            yield _jsonl_record(raw, lineno) if keep is None or keep(i) else SKIPPED
            i += 1


def _iter_parquet(path: str, keep, batch_size: int = 64) -> Iterator[Any]:
    """Rows batch by batch (a batch at a time in memory as Python objects); rows `keep`
    leaves out are never converted."""
    import pyarrow.parquet as pq

    with open_binary(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TaskFileError(f"{path}: not a readable parquet file ({e})") from e
        start = 0
        batches = pf.iter_batches(batch_size=batch_size)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # a corrupt page or column chunk
                raise TaskFileError(f"{path}: not a readable parquet file ({e})") from e
            n = batch.num_rows
            if keep is None:
                rows = iter(batch.to_pylist())
                kept = [True] * n
            else:
                kept = [bool(keep(start + j)) for j in range(n)]
                take = [j for j in range(n) if kept[j]]
                rows = iter(batch.take(take).to_pylist() if take else [])
            for k in kept:
                yield _drop_nulls(next(rows)) if k else SKIPPED
            start += n


def read_records(path: str | os.PathLike, keep=None) -> Iterator[Any]:
    """Each record of a task file, in order: the record, a ValueError for one that could not be
    decoded (a bad JSON line), or `SKIPPED` where `keep(record index)` is false (the record is
    not decoded: a host reading its share skips the others' cheaply). File-level problems
    (no such file, unknown type, unreadable file) raise TaskFileError."""
    path = os.fspath(path)
    if not _exists(path):
        raise TaskFileError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        return _iter_jsonl(path, keep)
    if path.endswith(".json"):
        return _iter_json(path, keep)
    if path.endswith(".parquet"):
        return _iter_parquet(path, keep)
    raise TaskFileError(f"{path}: unknown task file type; expected one of {list(SUFFIXES)}")


def iter_records(path: str | os.PathLike) -> Iterator[Any]:
    """Raw records of a task file, by suffix (a record that could not be decoded is a
    ValueError naming its line)."""
    return read_records(path)


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
