"""Device mesh, logical-axis sharding rules, and multi-host initialisation.

Parameters and activations are annotated with *logical* axis names ('embed', 'heads',
'batch', ...). A rules table maps each logical name to mesh axes of a 3-axis mesh
('data', 'fsdp', 'tensor'). Resolution, per array dimension in order:

* the first rule for that logical name whose mesh axes are not already used by an earlier
  dimension of the same array and whose total size divides the dimension wins;
* otherwise the dimension is replicated (a debug log says why). Tiny test models therefore
  shard on a 2x2x2 mesh instead of failing, and e.g. 3 KV heads on a 2-way tensor axis
  simply stay replicated.

A rule may repeat a logical name to give fallbacks, e.g. ('batch', ('data', 'fsdp')) then
('batch', 'data').

Activation constraints (`with_logical_constraint`) only act inside `jax.set_mesh(mesh)`;
without an active mesh they are no-ops, so the same model code runs unsharded on one device.

Multi-host: `initialize_distributed` joins the processes from the environment, and
`row_layout(mesh, B)` says which rows of a global batch each process builds on the host
(`RowLayout.to_global` / `to_local` move them between host and the global arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, Any], ...]

# Logical name -> mesh axes. Parameters: FSDP over 'embed', tensor parallel over heads /
# MLP / vocab. Activations: batch over data x fsdp (FSDP is data parallel for activations),
# per-head / MLP / vocab activations over 'tensor'; the residual stream's embed dim stays
# unsharded (it meets the 'fsdp'-sharded batch).
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("batch", "data"),
    ("batch", "fsdp"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("head_dim", None),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


class _RulesContext(threading.local):
    def __init__(self):
        self.stack: list[Rules] = []


_RULES = _RulesContext()


@contextlib.contextmanager
def axis_rules(rules: Sequence[tuple[str, Any]]) -> Iterator[Rules]:
    """Makes `rules` the rules `with_logical_constraint` uses inside the block."""
    rules = _check_rules(rules)
    _RULES.stack.append(rules)
    try:
        yield rules
    finally:
        _RULES.stack.pop()


def current_rules() -> Rules:
    return _RULES.stack[-1] if _RULES.stack else DEFAULT_RULES


def _check_rules(rules) -> Rules:
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"sharding rule #{i} {rule!r}: expected (logical_name, mesh_axes)")
        name, axes = rule
        axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if any(not isinstance(a, str) for a in axes_t):
            raise ValueError(f"sharding rule #{i} {rule!r}: mesh axes must be names")
        out.append((name, axes))
    return tuple(out)


# --------------------------------------------------------------------------- mesh


def mesh_sizes(shape: Mapping[str, int] | Any, n: int) -> dict[str, int]:
    """The size of each of data / fsdp / tensor on `n` devices.

    `shape` is config.mesh: it maps each axis to a size (a dict or ml_collections ConfigDict; a
    missing axis has size 1); one size may be -1, meaning "all remaining devices". Raises
    ValueError, naming config.mesh, when the sizes do not multiply to the device count.
    """
    get = shape.get if hasattr(shape, "get") else lambda k, d=None: getattr(shape, k, d)
    keys = set(shape.keys()) if hasattr(shape, "keys") else set(MESH_AXES)
    unknown = sorted(keys - set(MESH_AXES))
    if unknown:
        raise ValueError(f"config.mesh has unknown axes {unknown}; axes are {MESH_AXES}")
    sizes = {}
    for name in MESH_AXES:
        v = get(name, 1)
        v = 1 if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            raise ValueError(f"config.mesh.{name}={v!r}: must be a positive int or -1")
        sizes[name] = v
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"config.mesh: only one axis may be -1, got {fill}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if n % known:
            raise ValueError(
                f"config.mesh: cannot fill axis {fill[0]!r}: {n} devices are not divisible by the "
                f"product {known} of the other axes {sizes}"
            )
        sizes[fill[0]] = n // known
    if math.prod(sizes.values()) != n:
        raise ValueError(
            f"config.mesh: data*fsdp*tensor = {math.prod(sizes.values())} ({sizes}) but there are "
            f"{n} devices; use -1 for one axis to take the remaining devices"
        )
    return sizes


def make_mesh(shape: Mapping[str, int] | Any, devices: Sequence[Any] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh with `AxisType.Auto` axes, sized by `mesh_sizes`."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(shape, len(devices))
    return jax.make_mesh(
        tuple(sizes[a] for a in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


# ------------------------------------------------------------------ logical -> mesh


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    mesh: Mesh | Any,
    rules: Sequence[tuple[str, Any]] | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `logical_axes`.

    With `shape`, a dimension whose size is not divisible by its mesh axes is replicated.
    Logical names with no rule are replicated.
    """
    rules = current_rules() if rules is None else _check_rules(rules)
    sizes = _mesh_sizes(mesh)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        chosen = None
        for rule_name, axes in rules if name is not None else ():
            if rule_name != name:
                continue
            axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            axes_t = tuple(a for a in axes_t if sizes.get(a, 1) > 1)  # size-1 axes are free
            if any(a not in sizes for a in axes_t):
                continue
            if used & set(axes_t):
                continue
            total = math.prod(sizes[a] for a in axes_t)
            if shape is not None and shape[i] % total:
                log.debug(
                    "replicating dim %d (%s, size %d): not divisible by mesh axes %s (%d)",
                    i,
                    name,
                    shape[i],
                    axes_t,
                    total,
                )
                continue
            chosen = axes_t
            break
        if chosen:
            used.update(chosen)
            spec.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def logical_to_sharding(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | None = None,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """NamedSharding for `logical_axes` on `mesh` (see `logical_to_spec`)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, rules, shape))


def _logical_axes_of(var: nnx.Variable) -> tuple | None:
    axes = var.get_metadata().get("out_sharding")
    return None if axes is None else tuple(axes)


def param_shardings(
    model_or_state: nnx.Module | nnx.State,
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> nnx.State:
    """NamedShardings for `nnx.state(model, nnx.Param)` (or the given state).

    The result has the state's structure with each Variable replaced by its NamedSharding,
    i.e. a pytree prefix of the state, which is what `jax.jit` in/out_shardings accept.
    Works on abstract models from `nnx.eval_shape` too. Variables without logical axes
    metadata are replicated.
    """
    state = (
        nnx.state(model_or_state, nnx.Param)
        if isinstance(model_or_state, nnx.Module)
        else model_or_state
    )

    def one(var):
        if not isinstance(var, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        axes = _logical_axes_of(var)
        shape = np.shape(var.get_value())  # a ShapeDtypeStruct for abstract models
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return logical_to_sharding(axes, mesh, rules, shape)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: Sequence[tuple[str, Any]] | None = None
) -> nnx.Module:
    """device_puts every parameter of `model` (in place) to its NamedSharding; returns it."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(state, mesh, rules)
    sharded = jax.tree.map(
        lambda v, s: jax.device_put(v.get_value(), s),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    nnx.update(model, sharded)
    return model


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op without an active mesh.

    The mesh is the one set by `jax.set_mesh`; rules come from `axis_rules` (default
    `DEFAULT_RULES`). Dimensions that do not divide their mesh axes are left replicated.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {x.shape}")
    spec = logical_to_spec(logical_axes, mesh, None, x.shape)
    return jax.lax.with_sharding_constraint(x, spec)


# -------------------------------------------------------------------- multi-host

# Variables that mean "this process is one of several": set by the user/launcher
# (JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID), by SLURM / Open MPI
# (which jax auto-detects), or present on Cloud TPU VMs of a multi-host slice.
_EXPLICIT_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _multi_process_env(env: Mapping[str, str]) -> str | None:
    """Which launcher makes this a multi-process run, or None for a single process."""
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "explicit"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    # Cloud TPU multi-host slices list every worker's hostname.
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return "tpu"
    return None


# The variable that numbers the processes, per launcher (TPU VMs number their workers).
_RANK_VARS = {
    "explicit": "JAX_PROCESS_ID",
    "slurm": "SLURM_PROCID",
    "mpi": "OMPI_COMM_WORLD_RANK",
    "tpu": "TPU_WORKER_ID",
}


def process_id_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's index as its launcher gives it (0 for a single process), known before
    `jax.distributed` is initialised (the job locks its workdir before anything else)."""
    env = os.environ if env is None else env
    kind = _multi_process_env(env)
    value = env.get(_RANK_VARS[kind], "0") if kind else "0"
    return int(value) if value.isdigit() else 0


def initialize_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize()` when the environment describes several processes.

    Returns True if it initialised. With JAX_COORDINATOR_ADDRESS set, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID are required and passed explicitly; for SLURM, Open MPI and multi-host
    Cloud TPU, jax detects the cluster itself. Single-process runs (the CPU demo, one GPU,
    one TPU VM) do nothing. Must be called before any other jax call touches devices.
    """
    env = os.environ if env is None else env
    kind = _multi_process_env(env)
    if kind is None:
        return False
    if kind == "explicit":
        missing = [k for k in _EXPLICIT_VARS[1:] if not env.get(k)]
        if missing:
            raise ValueError(
                f"JAX_COORDINATOR_ADDRESS is set but {missing} are not; set all of {_EXPLICIT_VARS}"
            )
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    log.info(
        "jax.distributed initialised (%s): process %d of %d, %d devices",
        kind,
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
    )
    return True


# ------------------------------------------------------------ host rows <-> global arrays


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Which rows of a global batch of `size` rows this process builds and reads back.

    Under a multi-process mesh every process holds only some rows of a batch-sharded array:
    `rows` (sorted global row indices) are those its devices hold under the 'batch' rule. Host
    work (reading records, tokenising, judging) is done for these rows only; `to_global`
    assembles the global array from every process's rows and `to_local` reads this process's
    rows back. A batch the mesh cannot split over processes (rows not divisible by the batch
    axes) is replicated, and then every process supplies every row. Without a mesh (or with one
    process), `rows` is every row and the conversions are plain host <-> device copies.
    """

    mesh: Mesh | None
    rules: Rules
    size: int
    rows: np.ndarray  # int64 [n], sorted

    def sharding(self, shape: Sequence[int]) -> NamedSharding:
        """The NamedSharding of a [size, ...] array: rows by the 'batch' rule, rest replicated."""
        axes = ("batch",) + (None,) * (len(shape) - 1)
        return logical_to_sharding(axes, self.mesh, self.rules, tuple(shape))

    def to_global(self, local: Any) -> jax.Array:
        """[len(rows), ...] host rows -> the global [size, ...] array (a collective)."""
        local = np.asarray(local)
        if local.shape[:1] != (len(self.rows),):
            raise ValueError(
                f"RowLayout.to_global: expected this process's {len(self.rows)} rows, got an "
                f"array of shape {local.shape}"
            )
        if self.mesh is None:
            return jax.numpy.asarray(local)
        shape = (self.size,) + local.shape[1:]
        return jax.make_array_from_process_local_data(self.sharding(shape), local, shape)

    def to_local(self, x: jax.Array) -> np.ndarray:
        """This process's rows [len(rows), ...] of a global [size, ...] array, on the host (a
        collective when the array spans processes)."""
        if x.shape[:1] != (self.size,):
            raise ValueError(f"RowLayout.to_local: expected [{self.size}, ...], got {x.shape}")
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)[self.rows]
        # A gather, which every process runs (they all call this together): reading only local
        # shards would need a fallback that some processes take and others not, and collectives
        # that do not match hang. Host-side arrays of a batch are small.
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))[self.rows]


def row_layout(mesh: Mesh | None, size: int, rules: Sequence[tuple[str, Any]] | None = None):
    """The `RowLayout` of a global batch of `size` rows on `mesh` (None: one process, all rows)."""
    if mesh is None:
        return RowLayout(None, current_rules(), size, np.arange(size))
    rules = current_rules() if rules is None else _check_rules(rules)
    sharding = logical_to_sharding(("batch",), mesh, rules, (size,))
    rows = set()
    for index in sharding.addressable_devices_indices_map((size,)).values():
        rows.update(range(size)[index[0]])
    return RowLayout(mesh, rules, size, np.asarray(sorted(rows), np.int64))


def process_max(value: int) -> int:
    """The largest `value` over all processes (a collective; the value itself with one)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def process_sum(values: Any) -> np.ndarray:
    """Element-wise sum of a float vector over all processes (a collective)."""
    values = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def check_whole_groups(layout: RowLayout, group_size: int, what: str) -> None:
    """Raises unless this process's rows of `layout` are whole groups of `group_size`
    consecutive rows (needed when each process draws the tasks of its own rows)."""
    groups, counts = np.unique(np.asarray(layout.rows) // group_size, return_counts=True)
    if np.any(counts != group_size):
        raise ValueError(
            f"{what} = {group_size}: process {jax.process_index()} holds part of a group of "
            f"the RL batch; with task files each host samples whole groups (use a group size "
            f"that divides the rows per host, {len(layout.rows)})"
        )
