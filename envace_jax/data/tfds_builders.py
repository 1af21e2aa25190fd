"""TFDS datasets of tasks in ArrayRecord files, built and read without TensorFlow.

Each example is `{"task_id": str, "task_json": str}` (the task in our layout, `Task.to_json`).
Building goes through `download_and_prepare` with `file_format="array_record"`; reading
through `builder.as_data_source()` or `tfds.data_source(...)` (random access, no tf.data).
`tfds.load` / `as_dataset` need TensorFlow and are never used. Examples are stored in
generation order (`disable_shuffling`): shuffling is `TaskStream`'s job, from a seed.

* `TaskFileDataset`: from task files. Either `TaskFileConfig.files` maps split names to files,
  or one list of files is divided by `split_fractions`, each task going to the split its
  task_id hashes to (so a split never changes when the file is reordered or extended), or the
  builder's manual dir holds `{train,validation,test}.{jsonl,json,parquet}`.
* `GeneratedTaskDataset`: from a generator `generate(seed, n, split) -> tasks` (Task objects
  or dicts in our layout); `DemoTasks` is the demo domain's generator with fixed sizes.

Read back with `TaskRecords(builder.as_data_source()["train"])`, which decodes to `Task`s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from envace_jax.data.readers import SUFFIXES, load_tasks
from envace_jax.data.tasks import Task

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
_DESCRIPTION = "Agent tasks in the checklist format, one JSON-serialised task per example."


class _ClassProperty:
    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, owner):
        return self.fn(owner)


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Common base. tfds 4.9 looks up a packaged builder's source file through the
    `importlib_resources` backport, which it only declares for Python < 3.9; the source file
    (used to find a checksums file, which download-free builders do not have) is found here
    the way tfds does for unpackaged builders instead."""

    code_path = _ClassProperty(lambda cls: epath.Path(inspect.getfile(cls)))

    def __init__(self, *, file_format: str = "array_record", **kwargs: Any):
        # TFRecord (the tfds default) needs TensorFlow to write; ArrayRecord does not.
        super().__init__(file_format=file_format, **kwargs)


def _features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict(
        {"task_id": tfds.features.Text(), "task_json": tfds.features.Text()}
    )


def _example(task: Task) -> dict[str, str]:
    return {"task_id": task.task_id, "task_json": task.to_json()}


def hash_split(task_id: str, fractions: Mapping[str, float]) -> str:
    """The split a task id falls in: a uniform number from sha256(task_id) against the
    cumulative fractions (in the mapping's order)."""
    u = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2.0**64
    acc = 0.0
    for name, frac in fractions.items():
        acc += frac
        if u < acc:
            return name
    return list(fractions)[-1]


# --------------------------------------------------------------------------------------------
# From task files


@dataclasses.dataclass(eq=False)
class TaskFileConfig(tfds.core.BuilderConfig):
    """Where a TaskFileDataset reads from. The config `name` names the built dataset.

    files: split name -> task files; takes precedence over `sources`.
    sources: task files divided among splits by `split_fractions` (hash of task_id).
    strict: reject the whole build on any invalid record (else skip them, logged).
    """

    files: Mapping[str, Sequence[str]] | None = None
    sources: Sequence[str] = ()
    split_fractions: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"train": 0.8, "validation": 0.1, "test": 0.1}
    )
    strict: bool = True


class TaskFileDataset(_Builder):
    """Tasks from .json / .jsonl / .parquet task files (any layout `load_tasks` reads)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Task id and JSON-serialised task per example."}
    BUILDER_CONFIGS = [TaskFileConfig(name="manual", description="Files in the manual dir.")]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put task files named {train,validation,test}.{jsonl,json,parquet} in the manual dir."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description=_DESCRIPTION, features=_features(), disable_shuffling=True
        )

    def _split_files(self, dl_manager) -> dict[str, list[str]]:
        cfg: TaskFileConfig = self.builder_config
        if cfg.files:
            return {split: [os.fspath(p) for p in paths] for split, paths in cfg.files.items()}
        if cfg.sources:
            return {}
        manual = os.fspath(dl_manager.manual_dir)
        found = {
            split: [os.path.join(manual, split + suf)]
            for split in SPLITS
            for suf in SUFFIXES
            if os.path.exists(os.path.join(manual, split + suf))
        }
        if not found:
            raise FileNotFoundError(f"{manual}: no task files; {self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
        return found

    def _split_generators(self, dl_manager):
        cfg: TaskFileConfig = self.builder_config
        by_split = self._split_files(dl_manager)
        if by_split:
            tasks = {s: [t for p in paths for t in self._load(p)] for s, paths in by_split.items()}
        else:
            total = sum(cfg.split_fractions.values())
            if abs(total - 1.0) > 1e-9 or any(f < 0 for f in cfg.split_fractions.values()):
                raise ValueError(
                    f"split_fractions must be >= 0 and sum to 1, got {dict(cfg.split_fractions)}"
                )
            tasks = {s: [] for s in cfg.split_fractions}
            for p in cfg.sources:
                for t in self._load(os.fspath(p)):
                    tasks[hash_split(t.task_id, cfg.split_fractions)].append(t)
        _check_unique(tasks)
        return {split: self._generate_examples(ts) for split, ts in tasks.items()}

    def _load(self, path: str) -> list[Task]:
        return load_tasks(path, strict=self.builder_config.strict).tasks

    def _generate_examples(self, tasks: Sequence[Task]):
        for t in tasks:
            yield t.task_id, _example(t)


def _check_unique(tasks: Mapping[str, Sequence[Task]]) -> None:
    """A task id in two splits is a leak between training and evaluation: refuse it."""
    where: dict[str, str] = {}
    for split, ts in tasks.items():
        for t in ts:
            if t.task_id in where:
                raise ValueError(
                    f"task_id {t.task_id!r} appears in split {where[t.task_id]!r} and {split!r}"
                )
            where[t.task_id] = split


# --------------------------------------------------------------------------------------------
# From a generator


TaskGenerator = Callable[[int, int, str], Sequence[Any]]


def resolve_generator(generator: TaskGenerator | str) -> TaskGenerator:
    """A callable, or a "package.module:function" name imported when the dataset is built
    (so this module does not import the domains that generate tasks)."""
    if callable(generator):
        return generator
    module, sep, attr = str(generator).partition(":")
    if not sep:
        raise ValueError(
            f"generator name must look like 'package.module:function', got {generator!r}"
        )
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"generator {generator!r} is not a callable")
    return fn


@dataclasses.dataclass(eq=False)
class GeneratedTaskConfig(tfds.core.BuilderConfig):
    """generator(seed, n, split) -> n tasks (Task or dict in our layout), deterministic in its
    arguments; a callable or a "package.module:function" name. The generator keeps splits
    apart (e.g. disjoint world seeds per split); a task id in two splits fails the build.

    split_sizes: split name -> number of tasks.
    """

    generator: TaskGenerator | str | None = None
    seed: int = 0
    split_sizes: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"train": 1000, "validation": 100, "test": 100}
    )


class GeneratedTaskDataset(_Builder):
    """Tasks drawn from a generator callable (e.g. an executable demo domain)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Task id and JSON-serialised task per example."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description=_DESCRIPTION, features=_features(), disable_shuffling=True
        )

    def _split_generators(self, dl_manager):
        cfg: GeneratedTaskConfig = self.builder_config
        if cfg.generator is None:
            raise ValueError(f"builder config {cfg.name!r} has no generator")
        generate = resolve_generator(cfg.generator)
        tasks: dict[str, list[Task]] = {}
        for split, n in cfg.split_sizes.items():
            raw = list(generate(cfg.seed, n, split))
            if len(raw) != n:
                raise ValueError(f"generator gave {len(raw)} tasks for split {split!r}, asked {n}")
            tasks[split] = [t if isinstance(t, Task) else Task.from_dict(t) for t in raw]
        _check_unique(tasks)
        return {split: self._generate_examples(ts) for split, ts in tasks.items()}

    def _generate_examples(self, tasks: Sequence[Task]):
        for t in tasks:
            yield t.task_id, _example(t)


class DemoTasks(GeneratedTaskDataset):
    """Tasks of the executable demo domain (shop and bank tools), generated from a seed.

    Bump VERSION when the demo generator's output changes for a given seed.
    """

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [
        GeneratedTaskConfig(
            name="default",
            description="1000 / 100 / 100 demo tasks from seed 0.",
            generator="envace_jax.envs.demo.tasks:generate_tasks",
        ),
        GeneratedTaskConfig(
            name="small",
            description="64 / 16 / 16 demo tasks from seed 0 (quick checks).",
            generator="envace_jax.envs.demo.tasks:generate_tasks",
            split_sizes={"train": 64, "validation": 16, "test": 16},
        ),
    ]


# --------------------------------------------------------------------------------------------
# Reading


class TaskRecords:
    """A random-access view of a built split that decodes examples to `Task`s.

    `source` is what `as_data_source()` / `tfds.data_source` return for one split.
    """

    def __init__(self, source: Any):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Task:
        ex = self.source[index]
        raw = ex["task_json"]
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return Task.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return f"TaskRecords({self.source!r}, n={len(self)})"


def load_split(dataset_dir: str | os.PathLike, split: str) -> TaskRecords:
    """Open one split of a built dataset from its directory (`.../<name>/<config>/<version>`)
    without needing the builder class."""
    builder = tfds.builder_from_directory(os.fspath(dataset_dir))
    return TaskRecords(builder.as_data_source(split=split))
