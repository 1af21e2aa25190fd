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
would block this save and shadow its checkpoints.

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

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

SUPERSEDED = "superseded"  # subdirectory for checkpoints of an abandoned run
_INTEGRITY_VERSION = 1

AbstractState = Any | Callable[[int, dict], Any]


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
        leaves = _state_leaves(state)
        problem = _json_problem(meta, "meta")
        if not isinstance(meta, dict):
            problem = f"meta: expected a dict, got {type(meta).__name__}"
        if problem:
            raise TypeError(f"checkpoint step {step}: {problem}")
        self.wait()
        self._make_room(step)
        # Checksums first: they must describe exactly the values handed to Orbax.
        integrity = {"version": _INTEGRITY_VERSION, "leaves": _describe(leaves)}
        visible = self.all_steps()
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                integrity=ocp.args.JsonSave(integrity),
            ),
            force=True,  # the caller decides when to save; never skip by Orbax's interval policy
        )
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
            raise CheckpointError(
                f"saving checkpoint step {step} in {self.directory} failed: {type(e).__name__}: {e}"
            ) from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

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
            target = _abstract_tree(target)
            problem = _layout_problem(integrity, target)
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
        got = _describe(_state_leaves(restored))
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
        if stale:
            log.warning(
                "checkpoint steps %s in %s are at or after step %d being saved (the run resumed "
                "from an older step); moving them to %s/",
                stale,
                self.directory,
                step,
                SUPERSEDED,
            )
        if ocp.multihost.is_primary_host(0):
            for path in self._unfinished_steps().values() if first else ():
                log.info("removing unfinished checkpoint save %s", path)
                path.rmtree()
            for s in stale:
                dest = self._path / SUPERSEDED / str(s)
                suffix = 0
                while dest.exists():
                    suffix += 1
                    dest = self._path / SUPERSEDED / f"{s}.{suffix}"
                dest.parent.mkdir(parents=True, exist_ok=True)
                (self._path / str(s)).rename(dest)
        self._barriers += 1  # Orbax barrier names must be unique
        ocp.multihost.sync_global_processes(f"envace_checkpoint_make_room_{self._barriers}")
        if stale:
            self._manager.reload()


# ---------------------------------------------------------------------------- pytrees


def _state_leaves(state: Any) -> list[tuple[str, jax.Array]]:
    """(key path, leaf) of a state to save; anything but a plain jax.Array is an error."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise ValueError("checkpoint state: the pytree has no leaves")
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        if not isinstance(leaf, jax.Array):
            raise TypeError(
                f"checkpoint state{name}: expected a jax.Array, got {type(leaf).__name__}"
            )
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"checkpoint state{name}: a typed PRNG key; save jax.random.key_data(key) "
                "(uint32) and rebuild it with jax.random.wrap_key_data"
            )
        out.append((name, leaf))
    return out


def _abstract_tree(target: Any) -> Any:
    """The restore target as ShapeDtypeStructs with shardings (jax.Arrays are described)."""

    def one(path, leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            return leaf
        raise TypeError(
            f"abstract_state{jax.tree_util.keystr(path)}: expected a jax.ShapeDtypeStruct with "
            f"a sharding (restore places each shard directly), got {leaf!r}"
        )

    return jax.tree_util.tree_map_with_path(one, target)


def _layout_problem(integrity: Any, target: Any) -> str | None:
    """Why the checkpoint's leaves (from its integrity item) do not fit `target`, or None."""
    try:
        saved = {e["path"]: e for e in integrity["leaves"]}
        if integrity["version"] != _INTEGRITY_VERSION:
            return f"integrity item version {integrity['version']} is not {_INTEGRITY_VERSION}"
    except (KeyError, TypeError) as e:
        return f"malformed integrity item ({_short(e)})"
    flat, _ = jax.tree_util.tree_flatten_with_path(target)
    want = {jax.tree_util.keystr(p): leaf for p, leaf in flat}
    missing = [p for p in want if p not in saved]
    extra = [p for p in saved if p not in want]
    if missing or extra:
        return (
            f"pytree structure differs from the target: target leaves missing from the "
            f"checkpoint {missing[:5]}, checkpoint leaves not in the target {extra[:5]}"
        )
    wrong = [
        f"{p}: checkpoint {saved[p]['dtype']}{list(saved[p]['shape'])}, "
        f"target {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for p, leaf in want.items()
        if list(saved[p]["shape"]) != list(leaf.shape)
        or saved[p]["dtype"] != jnp.dtype(leaf.dtype).name
    ]
    if wrong:
        return f"{len(wrong)} leaves do not fit the target ({'; '.join(wrong[:5])})"
    return None


def _json_problem(x: Any, where: str) -> str | None:
    """Why `x` would not round-trip through JSON unchanged, naming the offending key."""
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is not a string"
            problem = _json_problem(v, f"{where}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            problem = _json_problem(v, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if x is None or isinstance(x, str | bool | int | float):
        return None
    return (
        f"{where}: a {type(x).__name__} is not JSON (convert array scalars with float() / "
        "int() / .tolist())"
    )


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


# --------------------------------------------------------------------------- checksums


def _describe(leaves: list[tuple[str, jax.Array]]) -> list[dict]:
    """Path, shape, dtype and content checksum (16 hex digits) of every leaf."""
    sums = jax.device_get(_checksums([leaf for _, leaf in leaves]))
    return [
        {
            "path": name,
            "shape": list(leaf.shape),
            "dtype": jnp.dtype(leaf.dtype).name,
            "checksum": f"{int(s[0]):08x}{int(s[1]):08x}",
        }
        for (name, leaf), s in zip(leaves, sums, strict=True)
    ]


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _checksums(xs: list[jax.Array]) -> jax.Array:
    """[n, 2] uint32: `_checksum` of every array, as one program. One dispatch per save rather
    than one per leaf: with many cross-process reductions in flight at once, multi-process CPU
    runs (gloo collectives) can hang."""
    return jnp.stack([_checksum(x) for x in xs])


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """[2] uint32: two wrapping sums over elements of a mix of (flat index, bit pattern).

    Sums commute, so the result does not depend on how `x` is sharded or reduced; mixing in
    the index makes moved or swapped elements count. Runs where `x` lives (no host copy).
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: [..., 2]
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(
            stride % 2**32
        )
        stride *= bits.shape[d]
    mixed = _fmix32(bits ^ _fmix32(index ^ jnp.uint32(0x9E3779B9)))
    second = _fmix32(mixed + jnp.uint32(0x7F4A7C15))
    return jnp.stack([jnp.sum(mixed, dtype=jnp.uint32), jnp.sum(second, dtype=jnp.uint32)])
