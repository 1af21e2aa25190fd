"""Task files as a job's data: `open_tasks(spec)` validates them in one streaming pass and
gives a random-access `TaskSource` of `Task`s.

    source = open_tasks("gs://bucket/tasks/train_*.parquet,extra.jsonl",
                        where="config.data.train_files")
    len(source), source[0]           # a Task, parsed on access
    source.report.summary()          # records read, valid, rejected, dropped by each filter

`spec` is one path or a comma-separated list (or a sequence) of task files (`.parquet`,
`.jsonl`, `.json`, in any layout `readers` knows), directories (their task files, sorted by
name, not recursive; names starting with `.` or `_` are left out) and globs. Local paths and
`gs://` alike (etils.epath). A file named twice (say by a directory and a glob) is an error.

Memory: a valid record is kept as the zstd-compressed JSON of its task (our layout), all of them
in one buffer, and parsed into a `Task` on access; parquet files are read batch by batch. A
100 MB reference-layout parquet (7.5k tasks) so never sits in host memory as Python objects:
`benchmarks/task_files.py` measured about +0.3 GiB peak RSS for it, against +0.8 GiB for the
same tasks held as `Task`s.

Multi-host: record i of the concatenated files (in spec order) belongs to shard
`i % shard_count`; a host decodes and validates only its own records, and reports the bad ones
among them. Duplicate task ids are found among the records one host reads (with
`shard_count > 1`, run `python -m envace_jax.data.validate` on the files once to check them
all).

Bad records (any defect `readers.parse_record` finds, a duplicate task id, a prompt the
`prompt_length` callable fails on): with `skip_invalid=False` the load stops with one
`TaskFileError` listing every bad record by file, record index and task id; with
`skip_invalid=True` they are skipped, listed in `report.rejected` and logged as one warning.

Filters, as the reference applies them (counted in `report.dropped`, each record listed in
`report.filtered`, logged with the count, and applied whatever `skip_invalid` says):

* `invalid_tools`: records whose only defects are in their tool schemas (the reference drops
  samples whose tools fail `OpenAIFunctionToolSchema`). A record with other defects too is a
  bad record, and so is one with no `tools` field at all.
* `prompt_too_long`: tasks whose opening prompt, tools rendered, is longer than
  `max_prompt_tokens` tokens as `prompt_length(task)` counts them (the trainer passes the
  policy tokenizer's count; 0 = no filter; the reference keeps 3,500).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import glob as globlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE
from envace_jax.data.readers import (
    SKIPPED,
    SUFFIXES,
    TOO_DEEP,
    TaskFileError,
    parse_record,
    read_records,
    record_label,
    record_task_id,
)
from envace_jax.data.tasks import Task

log = logging.getLogger(__name__)

INVALID_TOOLS = "invalid_tools"
PROMPT_TOO_LONG = "prompt_too_long"
FILTERS = (INVALID_TOOLS, PROMPT_TOO_LONG)

_GLOB_CHARS = re.compile(r"[*?\[]")
_TOOLS_PATH = re.compile(r"^(extra_info\.)?tools(\[|\.|$)")
_LOG_LINES = 20  # bad records a warning lists before "..."
PROGRESS_EVERY_S = 15.0  # a long read logs its progress this often


class Rejection(NamedTuple):
    """One record left out: where it is (`index` counts the records of its file from 0), its
    task id when it names a usable one, and why (every defect, `; `-separated)."""

    file: str
    index: int
    task_id: str | None
    reason: str

    def line(self) -> str:
        return f"{record_label(self.file, self.index, self.task_id)}: {self.reason}"


@dataclasses.dataclass
class SourceReport:
    """What one `open_tasks` read.

    total_records: records in the files, every shard's.
    records: this shard's records, each decoded and validated.
    valid: tasks kept (`len(source)`).
    rejected: the bad records of this shard.
    dropped: records each filter dropped (`FILTERS`), and `filtered` the records themselves
      (their reason starts with the filter's name).
    """

    where: str
    files: list[str]
    shard_index: int = 0
    shard_count: int = 1
    total_records: int = 0
    records: int = 0
    valid: int = 0
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    dropped: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FILTERS, 0))
    filtered: list[Rejection] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        shard = f" (shard {self.shard_index} of {self.shard_count})" if self.shard_count > 1 else ""
        files = f"{len(self.files)} file" + ("s" if len(self.files) != 1 else "")
        drops = ", ".join(f"{n} {name}" for name, n in self.dropped.items())
        return (
            f"{self.records} records in {files}{shard}: {self.valid} valid, "
            f"{len(self.rejected)} invalid, {sum(self.dropped.values())} dropped by filters "
            f"({drops})"
        )


@functools.cache
def _codec():
    import pyarrow as pa

    # zstd level 1: about 2.4x smaller than the JSON, 0.3 ms a 50 KB task each way
    return pa.Codec("zstd", compression_level=1)


def _pack(task: Task) -> tuple[bytes, int]:
    raw = json.dumps(task.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()
    return _codec().compress(raw, asbytes=True), len(raw)


def _unpack(blob, size: int) -> dict:
    return json.loads(_codec().decompress(blob, decompressed_size=size, asbytes=True))


class TaskSource:
    """Random access to the valid tasks of some task files, in file order.

    `source[i]` decompresses and parses the i-th stored task (about 0.5 ms for 40 KB of JSON);
    `task_ids` and `origin(i)` need no parsing.
    """

    def __init__(
        self,
        data: bytearray,
        ends: array.array,
        sizes: array.array,
        task_ids: list[str],
        file_of: array.array,
        index_of: array.array,
        report: SourceReport,
        weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
    ):
        self._data = data  # the compressed tasks, one after another
        self._ends = ends  # where each ends in `_data`
        self._sizes = sizes  # each one's JSON size
        self.task_ids = task_ids
        self._file_of = file_of
        self._index_of = index_of
        self.report = report
        self._weight_tolerance = weight_tolerance

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> Task:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # IndexError out of range; negative indices count from the end
        start = self._ends[i - 1] if i else 0
        d = _unpack(memoryview(self._data)[start : self._ends[i]], self._sizes[i])
        return Task.from_dict(d, weight_tolerance=self._weight_tolerance)

    def __iter__(self) -> Iterator[Task]:
        return (self[i] for i in range(len(self)))

    def origin(self, i: int) -> tuple[str, int]:
        """(file, record index in it) of task i."""
        return self.report.files[self._file_of[i]], self._index_of[i]

    @property
    def stored_bytes(self) -> int:
        """Bytes of the compressed task records held."""
        return len(self._data)

    def __repr__(self) -> str:
        files = len(self.report.files)
        return f"TaskSource({self.report.where}: {len(self)} tasks from {files} files)"


# --- resolving a spec into files ------------------------------------------------------------


def _epath(path: str):
    from etils import epath

    return epath.Path(path)


def _is_task_file(name: str) -> bool:
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return base.endswith(SUFFIXES) and not base.startswith((".", "_"))


def _glob(pattern: str) -> list[str]:
    if "://" not in pattern:
        return sorted(globlib.glob(pattern, recursive=True))
    parts = pattern.split("/")
    k = next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))
    base, rest = "/".join(parts[:k]), "/".join(parts[k:])
    return sorted(str(p) for p in _epath(base).glob(rest))


def _entry_files(entry: str, where: str) -> list[str]:
    suffixes = ", ".join(SUFFIXES)
    if _GLOB_CHARS.search(entry):
        files = [f for f in _glob(entry) if _is_task_file(f)]
        if not files:
            raise TaskFileError(f"{where}: {entry}: matches no task files ({suffixes})")
        return files
    path = _epath(entry)
    if path.is_dir():
        names = sorted(p.name for p in path.iterdir())
        if "dataset_info.json" in names:
            raise TaskFileError(
                f"{where}: {entry}: a TFDS dataset directory, not a directory of task files; "
                "read it with envace_jax.data.tfds_builders.load_split, or name the task files "
                "it was built from"
            )
        files = [os.path.join(entry, n) if "://" not in entry else str(path / n) for n in names]
        files = [f for f in files if _is_task_file(f) and not _epath(f).is_dir()]
        if not files:
            raise TaskFileError(f"{where}: {entry}: a directory with no task files ({suffixes})")
        return files
    if not path.exists():
        raise TaskFileError(f"{where}: {entry}: no such file")
    if not entry.endswith(SUFFIXES):
        raise TaskFileError(f"{where}: {entry}: unknown task file type; expected one of {suffixes}")
    return [entry]


def resolve_files(spec: str | os.PathLike | Sequence[str | os.PathLike], where: str = "data"):
    """The task files `spec` names, in order; TaskFileError (naming `where`) for an entry that
    names nothing, and for a file named twice."""
    if isinstance(spec, (str, os.PathLike)):
        entries = os.fspath(spec).split(",")
    else:
        entries = [os.fspath(e) for e in spec]
    entries = [e.strip() for e in entries if e.strip()]
    if not entries:
        raise TaskFileError(
            f"{where}: no task files given; expected task files ({', '.join(SUFFIXES)}), "
            "directories or globs, comma-separated"
        )
    files: list[str] = []
    named_by: dict[str, str] = {}
    for entry in entries:
        for f in _entry_files(entry, where):
            key = f if "://" in f else os.path.realpath(f)
            if key in named_by:
                raise TaskFileError(
                    f"{where}: {f} is named twice (by {named_by[key]!r} and {entry!r})"
                )
            named_by[key] = entry
            files.append(f)
    return files


# --- one streaming pass ---------------------------------------------------------------------


def _is_tool_defect(path: str, message: str) -> bool:
    return bool(_TOOLS_PATH.match(path)) and not (
        message == "missing required field" and path.rsplit(".", 1)[-1] == "tools"
    )


class Scanner:
    """Validates records file after file, keeping the valid ones compactly (`keep_tasks`).
    `validate` drives it file by file; `open_tasks` over all files at once."""

    def __init__(
        self,
        where: str,
        files: list[str],
        *,
        shard_index: int = 0,
        shard_count: int = 1,
        prompt_length: Callable[[Task], int] | None = None,
        max_prompt_tokens: int = 0,
        weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
        keep_tasks: bool = True,
    ):
        if shard_count < 1 or not 0 <= shard_index < shard_count:
            raise ValueError(
                f"{where}: shard_index must be in [0, shard_count), got {shard_index} of "
                f"{shard_count}"
            )
        if max_prompt_tokens < 0:
            raise ValueError(f"{where}: max_prompt_tokens must be >= 0, got {max_prompt_tokens}")
        if max_prompt_tokens and prompt_length is None:
            raise ValueError(f"{where}: max_prompt_tokens needs a prompt_length callable")
        self.report = SourceReport(where, list(files), shard_index, shard_count)
        self.prompt_length = prompt_length if max_prompt_tokens else None
        self.max_prompt_tokens = max_prompt_tokens
        self.weight_tolerance = weight_tolerance
        self.keep_tasks = keep_tasks
        self.data = bytearray()
        self.ends = array.array("q")
        self.sizes = array.array("q")
        self.task_ids: list[str] = []
        self.file_of = array.array("i")
        self.index_of = array.array("q")
        self._seen: dict[str, tuple[int, int]] = {}
        self._next_global = 0  # global index of the next file's first record
        self._start = self._last_log = time.monotonic()

    def scan_file(self, fi: int) -> None:
        """Reads file `fi` of `report.files`; TaskFileError for a file-level problem."""
        path = self.report.files[fi]
        first, k, s = self._next_global, self.report.shard_count, self.report.shard_index
        keep = None if k == 1 else (lambda i: (first + i) % k == s)
        n = 0
        for i, rec in enumerate(read_records(path, keep)):
            n += 1
            if rec is not SKIPPED:
                self._record(fi, path, i, rec)
                if self.report.records % 256 == 0:
                    self._progress(fi)
        self._next_global += n
        self.report.total_records += n

    def _progress(self, fi: int) -> None:
        now = time.monotonic()
        if now - self._last_log >= PROGRESS_EVERY_S:
            self._last_log = now
            rate = self.report.records / (now - self._start)
            log.info(
                "%s: %d records validated (%.0f/s), file %d of %d",
                self.report.where,
                self.report.records,
                rate,
                fi + 1,
                len(self.report.files),
            )

    def _record(self, fi: int, path: str, i: int, rec) -> None:
        report = self.report
        report.records += 1
        if isinstance(rec, Exception):
            report.rejected.append(Rejection(path, i, None, str(rec)))
            return
        try:
            task, errors = parse_record(rec, weight_tolerance=self.weight_tolerance)
        except RecursionError:  # validation recurses through the record's values
            task, errors = None, [("", TOO_DEEP)]
        if task is None:
            reason = "; ".join(f"{p}: {m}" if p else m for p, m in errors)
            if errors and all(_is_tool_defect(p, m) for p, m in errors):
                self._drop(INVALID_TOOLS, Rejection(path, i, record_task_id(rec), reason))
            else:
                report.rejected.append(Rejection(path, i, record_task_id(rec), reason))
            return
        tid = task.task_id
        if tid in self._seen:
            fj, j = self._seen[tid]
            first = record_label(report.files[fj], j)
            reason = f"task_id: duplicate {tid!r} (first at {first})"
            report.rejected.append(Rejection(path, i, tid, reason))
            return
        self._seen[tid] = (fi, i)
        if self.prompt_length is not None:
            try:
                n = int(self.prompt_length(task))
            except Exception as e:  # the chat template's or tokenizer's own errors
                reason = f"its prompt could not be rendered ({type(e).__name__}: {e})"
                report.rejected.append(Rejection(path, i, tid, reason))
                return
            if n > self.max_prompt_tokens:
                reason = (
                    f"the opening prompt is {n} tokens with its tools rendered, over "
                    f"max_prompt_tokens = {self.max_prompt_tokens}"
                )
                self._drop(PROMPT_TOO_LONG, Rejection(path, i, tid, reason))
                return
        report.valid += 1
        if self.keep_tasks:
            blob, size = _pack(task)
            self.data += blob
            self.ends.append(len(self.data))
            self.sizes.append(size)
            self.task_ids.append(tid)
            self.file_of.append(fi)
            self.index_of.append(i)

    def _drop(self, name: str, rejection: Rejection) -> None:
        self.report.dropped[name] += 1
        self.report.filtered.append(rejection._replace(reason=f"{name}: {rejection.reason}"))


def _listing(lines: list[str], limit: int | None = None) -> str:
    shown = lines if limit is None else lines[:limit]
    return "\n".join(shown) + ("\n..." if len(shown) < len(lines) else "")


def open_tasks(
    spec: str | Sequence[str],
    *,
    skip_invalid: bool = False,
    shard_index: int = 0,
    shard_count: int = 1,
    prompt_length: Callable[[Task], int] | None = None,
    max_prompt_tokens: int = 0,
    weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
    where: str = "data",
) -> TaskSource:
    """The valid tasks of the files `spec` names (this shard's share); see the module
    docstring. Errors are TaskFileErrors whose message starts with `where` (the config key),
    e.g. `config.data.train_files: /x/y.parquet: no such file`."""
    files = resolve_files(spec, where)
    scanner = Scanner(
        where,
        files,
        shard_index=shard_index,
        shard_count=shard_count,
        prompt_length=prompt_length,
        max_prompt_tokens=max_prompt_tokens,
        weight_tolerance=weight_tolerance,
    )
    for fi in range(len(files)):
        try:
            scanner.scan_file(fi)
        except TaskFileError as e:
            raise TaskFileError(f"{where}: {e}") from e
    report = scanner.report
    lines = [r.line() for r in report.rejected]
    if lines and not skip_invalid:
        raise TaskFileError(
            f"{where}: {len(lines)} of {report.records} records are invalid:\n" + _listing(lines),
            report.rejected,
        )
    if lines:
        log.warning(
            "%s: skipped %d of %d invalid records:\n%s",
            where,
            len(lines),
            report.records,
            _listing(lines, _LOG_LINES),
        )
    if report.dropped[INVALID_TOOLS]:
        bad = [r.line() for r in report.filtered if r.reason.startswith(INVALID_TOOLS)]
        log.warning(
            "%s: dropped %d records whose tool schemas are invalid (as the reference does):\n%s",
            where,
            len(bad),
            _listing(bad, _LOG_LINES),
        )
    if report.dropped[PROMPT_TOO_LONG]:
        log.info(
            "%s: dropped %d tasks whose prompt is over %d tokens",
            where,
            report.dropped[PROMPT_TOO_LONG],
            max_prompt_tokens,
        )
    if not report.valid:
        raise TaskFileError(f"{where}: no tasks left: {report.summary()}", report.rejected)
    log.info("%s: %s", where, report.summary())
    return TaskSource(
        scanner.data,
        scanner.ends,
        scanner.sizes,
        scanner.task_ids,
        scanner.file_of,
        scanner.index_of,
        report,
        weight_tolerance,
    )
