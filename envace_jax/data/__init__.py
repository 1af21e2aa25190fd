"""Task records in the checklist format, file readers, TFDS ArrayRecord datasets, streams."""

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE, FOCUS_ON_VALUES, ChecklistItem
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
from envace_jax.data.stream import TaskStream
from envace_jax.data.tasks import Task
from envace_jax.data.validation import TaskValidationError

__all__ = [
    "DEFAULT_WEIGHT_TOLERANCE",
    "FOCUS_ON_VALUES",
    "ChecklistItem",
    "LoadReport",
    "Task",
    "TaskFileError",
    "TaskStream",
    "TaskValidationError",
    "iter_records",
    "load_tasks",
    "parse_record",
    "parse_records",
    "save_tasks",
    "to_python",
]
# The TFDS builders live in envace_jax.data.tfds_builders; importing tensorflow_datasets costs
# about a second, so they are not imported here.
