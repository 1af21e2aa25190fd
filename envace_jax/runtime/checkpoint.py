"""Checkpoints: an Orbax `CheckpointManager` over one directory, one checkpoint per step.

    ckpt = Checkpointer(workdir + "/checkpoints", keep=3)
    ckpt.save(step, state, {"phase": "rl", "data_position": 1234, "config": cfg.to_dict()})
    step, state, meta = ckpt.restore(abstract_state)   # newest readable checkpoint

A step is an Orbax composite directory `<dir>/<step>/` with three items:

* `state`: the array pytree (`StandardSave`, TensorStore OCDBT). With several processes every
  process writes the shards it holds (one replica of each), into its own `ocdbt.process_<i>/`.
* `meta`: the caller's JSON (phase, data position, config, metrics). Orbax's JSON handler
  writes it from the primary process only; every process reads it back.
* `integrity`: key path, shape, dtype and a 64-bit content checksum of every leaf. Orbax
  detects missing or truncated files and mismatched shapes, but bytes garbled inside a
  compressed chunk decode silently to wrong numbers; the checksum catches that. It is
  computed on device from the global values, so it is the same for any sharding.

Completion. Orbax writes a step into `<step>.orbax-checkpoint-tmp/`, writes
`commit_success.txt` and renames the directory to `<step>` once every item on every process
is written (on GCS, where a rename is not atomic, the step directory is final once
`commit_success.txt` exists). A step that was never finalised is never listed or restored;
`restore()` names it in a warning and the first `save()` removes it.

Async saves return once the arrays are copied to host memory; the write continues in the
background. `all_steps()` / `latest_step()` list only steps confirmed durable (by `wait()`, a
later `save()`, or a synchronous save), so every process sees the same list.

Resuming from an older step. When `save(step)` finds checkpoints at or after `step` (the run
went back to an older checkpoint, e.g. because the newest one was corrupt), it moves them to
`<dir>/superseded/` with a warning: they belong to the abandoned run, and left in place they
would block this save and shadow its checkpoints. A step directory this process cannot read
(e.g. permissions) is never read or moved: it is renamed where it is, to `<step>.unreadable`,
and the warning names it.

Failed async saves. A background write that fails (e.g. out of disk) is raised as
CheckpointError by `check()`, which never waits for a running write (the trainer calls it at
every step boundary), and at the latest by the next `save()` or `wait()`.

Multi-host. Every process calls every method at the same point (Orbax synchronises them).
Orbax's barriers then go through the jax.distributed client rather than Orbax's default device
collective: run from its background save threads, a collective can interleave with the training
step's collectives in a different order on each process, and the job hangs.
The checks before reading arrays (readable JSON items, structure, shapes, dtypes) read the
same files on every process, and their verdict is all-gathered, so all processes fall back
together; the checksum check is symmetric by construction. A read error inside the array
restore itself can hit one process only (each reads its own shards); with several processes
that raises `CheckpointError` rather than risk processes restoring different steps.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from envace_jax.runtime.checkpoint_integrity import (
    abstract_tree,
    describe,
    integrity_item,
    json_problem,
    layout_problem,
    state_leaves,
)

log = logging.getLogger(__name__)

SUPERSEDED = "superseded"  # subdirectory for checkpoints of an abandoned run

AbstractState = Any | Callable[[int, dict], Any]


# Checkpointers not yet closed, closed at interpreter exit (a run stopped by an exception does
# not reach its close()).
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_open_checkpointers() -> None:
    for ckpt in list(_OPEN):
        ckpt._close_at_exit()


class CheckpointError(RuntimeError):
    """No readable checkpoint, an unreadable requested step, or a save that failed."""


class _Unreadable(Exception):
    """A checkpoint step that exists but cannot be restored (the message says why)."""


class Checkpointer:
    """Orbax CheckpointManager over `directory` (local path or gs://...), one checkpoint per
    step; the newest `keep` checkpoints are kept."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer keep: expected an integer >= 1, got {keep!r}")
        directory = os.fspath(directory)
        if jax.process_count() > 1:
            _use_distributed_barriers()
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self._path = epath.Path(self.directory)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self._path, options=options)
        self._async = async_save
        self._pending: int | None = None  # an async save not yet confirmed durable
        self._visible: list[int] = []  # what all_steps() shows while it is pending
        self._saved_once = False
        self._barriers = 0
        _OPEN.add(self)

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Saves `state` (a pytree of jax arrays, possibly sharded: params, optimizer state, PRNG
        key data as uint32, ...) and `meta` (JSON: phase, data position, config, metrics).

        Async: returns once the arrays are copied to host; the write finishes in the background
        (`wait()` blocks until it is durable). A failure of the previous async save is raised
        here as CheckpointError.
        """
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"checkpoint step: expected a non-negative integer, got {step!r}")
        step = int(step)
        leaves = state_leaves(state)
        problem = json_problem(meta, "meta")
        if not isinstance(meta, dict):
            problem = f"meta: expected a dict, got {type(meta).__name__}"
        if problem:
            raise TypeError(f"checkpoint step {step}: {problem}")
        self.wait()
        self._make_room(step)
        # Checksums first: they must describe exactly the values handed to Orbax.
        integrity = integrity_item(leaves)
        visible = self.all_steps()
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(meta),
                    integrity=ocp.args.JsonSave(integrity),
                ),
                force=True,  # the caller decides when to save, not Orbax's interval policy
            )
        except Exception as e:  # a synchronous save's write error (e.g. out of disk)
            raise self._save_failed(step, e) from e
        if not saved:
            raise CheckpointError(f"Orbax declined to save step {step} in {self.directory}")
        if self._async:
            self._pending, self._visible = step, visible

    def wait(self) -> None:
        """Blocks until pending async saves are durable; raises CheckpointError if one failed."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(step, e) from e

    def check(self) -> None:
        """Raises CheckpointError if the pending async save has failed; returns at once while
        it is still being written."""
        if self._pending is None or self._manager.is_saving_in_progress():
            return
        try:
            self._manager.wait_until_finished()  # finished: returns, or raises its error
        except Exception as e:
            step, self._pending = self._pending, None
            raise self._save_failed(step, e) from e

    def _save_failed(self, step: int | None, e: BaseException) -> CheckpointError:
        """The error of a failed write, its OS cause first: TensorStore puts that at the end of
        a message long enough to be cut."""
        codes = re.findall(r"os_error_code='(\d+)'", str(e))
        codes += [x.errno for x in (e, e.__cause__, e.__context__) if isinstance(x, OSError)]
        cause = next((f"{os.strerror(int(c))} (errno {c}); " for c in codes if c), "")
        return CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed: {cause}{_short(e)}"
        )

    def close(self) -> None:
        _OPEN.discard(self)
        try:
            self.wait()
        finally:
            self._manager.close()

    def _close_at_exit(self) -> None:
        """Stops Orbax's background threads before the interpreter tears down the modules they
        use (left running, each fails with a traceback of its own). A save that fails here
        is logged: no caller is left to raise it to."""
        try:
            self.close()
        except Exception as e:
            log.error("%s", _short(e, limit=1000))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------- listing

    def all_steps(self) -> list[int]:
        """Finalised steps, oldest first (a step whose async save is not yet confirmed by
        `wait()` or a later `save()` is not listed)."""
        if self._pending is not None:
            return list(self._visible)
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finalised step (it may still turn out unreadable: see `restore`)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------------------- restore

    def restore(
        self, abstract_state: AbstractState, step: int | None = None
    ) -> tuple[int, Any, dict]:
        """Restores `(step, state, meta)` straight into the target shardings.

        abstract_state: a pytree of `jax.ShapeDtypeStruct` with `.sharding` (or of jax.Arrays,
          whose shape, dtype and sharding are used), or a callable `(step, meta) -> pytree` for
          checkpoints whose layout depends on the step (e.g. the optimizer of each phase).
        step: None = the newest readable checkpoint. A step that is unfinished, unreadable
          (missing, truncated or garbled files) or does not fit the target (structure, shape,
          dtype) is skipped with a warning naming it and the problem; if none is readable,
          CheckpointError lists what was tried. An explicit step is not replaced by another:
          CheckpointError if it cannot be restored.
        """
        try:
            self.wait()
        except CheckpointError as e:
            log.warning("%s; restoring from what is on storage", e)
        finished = self.all_steps()
        if step is not None:
            if step not in finished:
                unfinished = self._unfinished_steps()
                why = (
                    f"its save was never finalised ({unfinished[step].name} was left behind)"
                    if step in unfinished
                    else "there is no such checkpoint"
                )
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory}: {why}; finished steps: {finished}"
                )
            try:
                return self._restore_step(step, abstract_state)
            except _Unreadable as e:
                raise CheckpointError(f"checkpoint step {step} in {self.directory}: {e}") from e

        unfinished = self._unfinished_steps()
        tried: list[str] = []
        for s in sorted(set(finished) | set(unfinished), reverse=True):
            if s in finished:
                try:
                    return self._restore_step(s, abstract_state)
                except _Unreadable as e:
                    problem = str(e)
                    # The reads Orbax dropped unawaited are collected now, under the job's
                    # unraisable hook (`main`), not later, where each prints a traceback or a
                    # "never awaited" warning: the problem above names them.
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", UNAWAITED_READ, RuntimeWarning)
                        gc.collect()
            else:
                problem = (
                    f"unfinished save: {unfinished[s].name} was left behind by a writer that "
                    "stopped before Orbax finalised the step"
                )
            log.warning(
                "checkpoint step %d in %s skipped: %s; falling back to an older step",
                s,
                self.directory,
                problem,
            )
            tried.append(f"step {s}: {problem}")
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}; "
            + ("tried " + "; ".join(tried) if tried else "the directory holds no checkpoints")
        )

    def read_meta(self, step: int) -> dict:
        """The meta dict saved with finished `step`, without reading its arrays (e.g. to
        decide whether a step is worth restoring). CheckpointError if it is unreadable."""
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: unreadable meta ({_short(e)})"
            ) from e
        if not isinstance(meta, dict):
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: meta is a {type(meta).__name__}"
            )
        return meta

    def _restore_step(self, step: int, abstract_state: AbstractState) -> tuple[int, Any, dict]:
        """One step, or _Unreadable. Target errors (a caller bug) propagate as they are."""
        problem, meta, integrity = None, None, None
        try:
            items = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore(), integrity=ocp.args.JsonRestore()
                ),
            )
            meta, integrity = items["meta"], items["integrity"]
            if not isinstance(meta, dict):
                problem = f"meta item is a {type(meta).__name__}, not a JSON object"
        except Exception as e:  # any unreadable JSON item or missing item directory
            problem = f"unreadable meta/integrity items ({_short(e)})"
        target = None
        if problem is None:
            target = abstract_state(step, meta) if callable(abstract_state) else abstract_state
            target = abstract_tree(target)
            problem = layout_problem(integrity, target)
        if not _all_processes_agree(problem is None):
            raise _Unreadable(problem or "unreadable on another process")
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]
        except Exception as e:
            if jax.process_count() > 1:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory}: reading the arrays failed on "
                    f"process {jax.process_index()} ({_short(e)}); with several processes a "
                    "partial read cannot be retried safely: move the step directory aside and "
                    "restart"
                ) from e
            raise _Unreadable(f"unreadable arrays ({_short(e)})") from e
        expected = {entry["path"]: entry["checksum"] for entry in integrity["leaves"]}
        got = describe(state_leaves(restored))
        bad = [d["path"] for d in got if d["checksum"] != expected[d["path"]]]
        if bad:
            raise _Unreadable(
                f"contents differ from the checksums written at save time in {len(bad)} "
                f"leaves ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''})"
            )
        return step, restored, meta

    # ----------------------------------------------------------------------- housekeeping

    def _unfinished_steps(self) -> dict[int, epath.Path]:
        """Step -> directory for saves that Orbax never finalised (the tmp directory, or on GCS
        a step directory without commit_success.txt)."""
        if not self._path.exists():
            return {}
        out = {}
        for tmp in ocp.step.all_temporary_paths(self._path):
            path = tmp.get()
            try:
                out[ocp.step.step_from_checkpoint_name(path.name)] = path
            except ValueError:  # not a step directory (e.g. superseded/)
                continue
        return out

    def _make_room(self, step: int) -> None:
        """Before the first save, removes unfinished saves left by a crashed writer; before any
        save, moves finished steps >= `step` (an abandoned run) to superseded/."""
        stale = [s for s in self._manager.all_steps() if s >= step]
        first = not self._saved_once
        self._saved_once = True
        if not stale and not first:
            return
        if ocp.multihost.is_primary_host(0):
            for path in self._unfinished_steps().values() if first else ():
                log.info("removing unfinished checkpoint save %s", path)
                if _accessible(path):
                    path.rmtree()
                else:
                    self._set_aside(path)
            moved = []
            for s in stale:
                path = self._path / str(s)
                if _accessible(path):
                    dest = _free_name(self._path / SUPERSEDED, str(s))
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    path.rename(dest)
                    moved.append(s)
                else:
                    self._set_aside(path)
            if moved:
                log.warning(
                    "checkpoint steps %s in %s are at or after step %d being saved (a run that "
                    "resumed from an older step, or one redoing its last step); moved to %s/",
                    moved,
                    self.directory,
                    step,
                    SUPERSEDED,
                )
        self._barriers += 1  # Orbax barrier names must be unique
        ocp.multihost.sync_global_processes(f"envace_checkpoint_make_room_{self._barriers}")
        if stale:
            self._manager.reload()

    def _set_aside(self, path: epath.Path) -> None:
        """Takes an unreadable step directory out of Orbax's view without reading or moving
        it: moving a directory elsewhere needs write permission on the directory itself, and
        removing it needs its contents, so it is renamed where it is, to a name that is no step
        (this needs only the checkpoint directory's permissions, which saving needs anyway)."""
        dest = _free_name(self._path, path.name.split(".")[0] + ".unreadable")
        path.rename(dest)
        log.warning(
            "checkpoint directory %s cannot be read, so it is neither restored nor moved to %s/; "
            "left in place as %s (inspect it, then delete it)",
            path,
            SUPERSEDED,
            dest,
        )


def _accessible(path: epath.Path) -> bool:
    """Whether this process may list, read and write inside `path` (always assumed for remote
    storage, where permissions are not per directory)."""
    if "://" in os.fspath(path):
        return True
    return os.access(path, os.R_OK | os.W_OK | os.X_OK)


def _free_name(parent: epath.Path, name: str) -> epath.Path:
    """parent/name, or parent/name.1, .2, ... if taken."""
    dest, suffix = parent / name, 0
    while dest.exists():
        suffix += 1
        dest = parent / f"{name}.{suffix}"
    return dest


# Orbax's coroutine that reads one array, and the warning for one it dropped before it started.
ORBAX_READ = "_read_array_index_and_device_put"
UNAWAITED_READ = f"coroutine '{ORBAX_READ}' was never awaited"


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _use_distributed_barriers() -> None:
    """Makes Orbax synchronise processes with the jax.distributed client (no device work)."""
    from absl import flags

    name = "experimental_orbax_use_distributed_barrier"
    if name in flags.FLAGS:
        flag = flags.FLAGS[name]
        flag.value = True
        flag.present = 1  # readable before (or without) absl parsing the command line


def _all_processes_agree(ok: bool) -> bool:
    """True iff `ok` on every process (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok, np.int32))))
