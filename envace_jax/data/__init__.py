"""Task records in the checklist format, file readers and writers, task sources for jobs, TFDS
ArrayRecord datasets, streams."""

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE, FOCUS_ON_VALUES, ChecklistItem
from envace_jax.data.export import export_tasks
from envace_jax.data.readers import (
    LoadReport,
    TaskFileError,
    iter_records,
    load_tasks,
    parse_record,
    parse_records,
    save_tasks,
    to_python,
)
from envace_jax.data.sources import SourceReport, TaskSource, open_tasks
from envace_jax.data.stream import TaskStream
from envace_jax.data.tasks import Task
from envace_jax.data.validation import TaskValidationError

__all__ = [
    "DEFAULT_WEIGHT_TOLERANCE",
    "FOCUS_ON_VALUES",
    "ChecklistItem",
    "LoadReport",
    "Task",
    "SourceReport",
    "TaskFileError",
    "TaskSource",
    "TaskStream",
    "TaskValidationError",
    "export_tasks",
    "iter_records",
    "load_tasks",
    "open_tasks",
    "parse_record",
    "parse_records",
    "save_tasks",
    "to_python",
]
# The TFDS builders live in envace_jax.data.tfds_builders; importing tensorflow_datasets costs
# about a second, so they are not imported here.
