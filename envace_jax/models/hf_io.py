"""Hugging Face safetensors checkpoints <-> decoder parameters, one tensor at a time.

Loading reads `config.json` and the `*.safetensors` files (one file, or shards listed by
`model.safetensors.index.json`) and builds every parameter straight into its target
sharding: with a mesh, `jax.make_array_from_callback` asks each device for its own slice and
only that slice is read from disk, so no host ever holds a whole large model. Per-layer HF
tensors (`model.layers.{i}.*`) are stacked along the leading `layers` axis of our params.
The module itself comes from `abstract_model(cfg)`: nothing is randomly initialised.

Saving is the inverse, streamed too: the safetensors header only needs shapes and dtypes, so
each file is written one tensor at a time, each gathered to host (layer by layer for stacked
params) just before it is written.

The parameter names and layouts are `hf_names`; the safetensors writer is
`safetensors_writer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from envace_jax.models.hf_names import IGNORED, RULES, TIED_HEAD, Rule, rule_for
from envace_jax.models.safetensors_writer import TensorEntry, write_hf_tensors

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# Reading checkpoints


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of an HF model directory."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in HF model directory {os.fspath(path)!r}")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON at line {e.lineno}: {e.msg}") from None


class HFCheckpoint(contextlib.AbstractContextManager):
    """The tensors of an HF model directory, read lazily by name (and by slice).

    Use as a context manager: file handles stay open until exit.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._files = self._tensor_files()
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._slices: dict[str, Any] = {}

    def _tensor_files(self) -> dict[str, str]:
        """tensor name -> file name, from the index when there is one."""
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            for fname in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.path, fname)):
                    raise FileNotFoundError(f"{index} lists {fname!r}, which does not exist")
            return dict(weight_map)
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"no *.safetensors files in {self.path!r}")
        files: dict[str, str] = {}
        for fname in names:
            with safe_open(os.path.join(self.path, fname), framework="np") as f:
                for key in f.keys():
                    if key in files:
                        raise ValueError(f"tensor {key!r} is in both {files[key]} and {fname}")
                    files[key] = fname
        return files

    def __exit__(self, *exc):
        self.release()
        return None

    def release(self) -> None:
        """Closes the open files; later reads open them again. The files are memory-mapped, and
        the pages a read touched count as resident until their file is closed, so a loader that
        keeps every file open until the end peaks at the checkpoint's size on top of the model."""
        self._stack.close()
        self._handles.clear()
        self._slices.clear()

    def names(self) -> set[str]:
        return set(self._files)

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self._files[name])

    def _slice(self, name: str):
        if name not in self._slices:
            fname = self._files[name]
            if fname not in self._handles:
                full = os.path.join(self.path, fname)
                self._handles[fname] = self._stack.enter_context(safe_open(full, framework="np"))
            try:
                self._slices[name] = self._handles[fname].get_slice(name)
            except Exception as e:  # an index entry that the file does not hold
                raise ValueError(f"tensor {name!r} not found in {self.file_of(name)}: {e}") from e
        return self._slices[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or the box `index` (one unit-stride slice per dim) of it."""
        sl = self._slice(name)
        return np.asarray(sl[:] if index is None else sl[index])


def _norm_index(index: tuple, shape: tuple[int, ...]) -> tuple[range, ...]:
    """Per-dim ranges of a device's index (slices possibly open-ended) into `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append(range(start, stop))
    return tuple(out)


def _read_layer_box(
    ckpt: HFCheckpoint, rule: Rule, name: str, layer_shape: tuple, box: tuple[range, ...]
) -> np.ndarray:
    """The part `box` (ranges over our per-layer dims) of one layer, in our layout.

    Reads only the rows/columns of the HF tensor that the box touches (their bounding box).
    """
    if rule.n_in is None:
        return ckpt.read(name, tuple(slice(r.start, r.stop) for r in box))
    in_dims, out_dims = layer_shape[: rule.n_in], layer_shape[rule.n_in :]
    in_box, out_box = box[: rule.n_in], box[rule.n_in :]

    # HF rows are the C-order flattening of our output dims, columns of our input dims.
    def flat(ranges, dims):
        return np.ravel_multi_index(np.ix_(*[np.arange(r.start, r.stop) for r in ranges]), dims)

    rows, cols = flat(out_box, out_dims).ravel(), flat(in_box, in_dims).ravel()
    if rows.size == 0 or cols.size == 0:
        return np.zeros([len(r) for r in box], np.float32)  # empty shard: nothing to read
    r0, c0 = int(rows.min()), int(cols.min())
    band = ckpt.read(name, (slice(r0, int(rows.max()) + 1), slice(c0, int(cols.max()) + 1)))
    if band.shape != (len(rows), len(cols)):  # the box is not contiguous in HF order
        band = band[np.ix_(rows - r0, cols - c0)]
    return band.T.reshape([len(r) for r in box])


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Target of one param: global shape, dtype and sharding (None: default device)."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: jax.sharding.Sharding | None = None


def check_hf_tensors(ckpt: HFCheckpoint, specs: Mapping[str, ParamSpec]) -> None:
    """Raises ValueError unless the checkpoint holds exactly the tensors `specs` needs.

    Names every missing, unexpected and mis-shaped tensor (expected vs found shape, and the
    file it was found in).
    """
    expected: dict[str, tuple[int, ...]] = {}
    for path, spec in specs.items():
        rule = rule_for(path)
        hf_shape = rule.hf_shape(rule.layer_shape(spec.shape))
        for layer in range(rule.num_layers(spec.shape)):
            expected[rule.name(layer)] = hf_shape
    found = ckpt.names()
    problems = []
    missing = sorted(set(expected) - found, key=_natural)
    if missing:
        problems.append(f"missing tensors (expected shape): {_listing(missing, expected)}")
    allowed = {TIED_HEAD} if "lm_head.kernel" not in specs else set()
    extra = sorted(
        (n for n in found - set(expected) if n not in allowed and not IGNORED.fullmatch(n)),
        key=_natural,
    )
    if extra:
        where = {n: os.path.basename(ckpt.file_of(n)) for n in extra}
        problems.append(
            "unexpected tensors: "
            + ", ".join(f"{n} (shape {ckpt.shape(n)}, in {where[n]})" for n in extra[:20])
            + (f" and {len(extra) - 20} more" if len(extra) > 20 else "")
        )
    for name in sorted(set(expected) & found, key=_natural):
        got = ckpt.shape(name)
        if got != expected[name]:
            problems.append(
                f"tensor {name!r} has shape {got}, expected {expected[name]} "
                f"(in {ckpt.file_of(name)})"
            )
    if problems:
        raise ValueError(f"checkpoint {ckpt.path!r} does not fit the model: " + "; ".join(problems))


def _natural(name: str):
    """Sort key putting layer 2 before layer 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _listing(names: list[str], shapes: Mapping[str, tuple]) -> str:
    shown = ", ".join(f"{n} {shapes[n]}" for n in names[:20])
    return shown + (f" and {len(names) - 20} more" if len(names) > 20 else "")


def load_hf_params(path: str | os.PathLike, specs: Mapping[str, ParamSpec]) -> dict[str, jax.Array]:
    """Reads the params `specs` describes (by dotted path) from an HF model directory.

    Each param is built with `jax.make_array_from_callback` in its target sharding, so every
    device receives, and the host reads, only that device's slice; stacked params are read
    layer by layer. Values are cast to `spec.dtype` on host.
    Returns {dotted path: jax.Array}. Raises ValueError (see `check_hf_tensors`).
    """
    out = {}
    total = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in specs.values())
    done, start, last_log = 0, time.perf_counter(), time.perf_counter()
    with HFCheckpoint(path) as ckpt:
        check_hf_tensors(ckpt, specs)
        for p, spec in specs.items():
            out[p] = _load_one(ckpt, rule_for(p), spec)
            ckpt.release()
            done += math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
            now = time.perf_counter()
            if now - last_log > 10 and done < total:  # large models: a line every ~10 s
                rate = done / (now - start)
                log.info(
                    "loading %s: %.0f%% (%.0f MB/s, ETA %.0fs)",
                    ckpt.path,
                    100 * done / total,
                    rate / 1e6,
                    (total - done) / rate,
                )
                last_log = now
    log.info("loaded %.1f MB from %s in %.1fs", total / 1e6, path, time.perf_counter() - start)
    return out


def _load_one(ckpt: HFCheckpoint, rule: Rule, spec: ParamSpec) -> jax.Array:
    shape = tuple(spec.shape)
    layer_shape = rule.layer_shape(shape)
    dtype = np.dtype(spec.dtype)
    cache: dict[tuple, np.ndarray] = {}  # replicated shards ask for the same box repeatedly

    def callback(index) -> np.ndarray:
        box = _norm_index(index, shape)
        key = tuple((r.start, r.stop) for r in box)
        if key not in cache:
            if rule.stacked:
                layers, inner = box[0], box[1:]
                buf = np.empty([len(r) for r in box], dtype)
                for j, layer in enumerate(layers):
                    name = rule.name(layer)
                    buf[j] = _read_layer_box(ckpt, rule, name, layer_shape, inner)
                cache[key] = buf
            else:
                part = _read_layer_box(ckpt, rule, rule.hf, layer_shape, box)
                cache[key] = part.astype(dtype, copy=False)
        return cache[key]

    sharding = spec.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.make_array_from_callback(shape, sharding, callback)


# --------------------------------------------------------------------------------------
# Writing checkpoints


def hf_tensor_entries(params: Mapping[str, Any], dtype: Any | None = None) -> list[TensorEntry]:
    """The HF tensors of `params` ({dotted path: array}), in checkpoint order, unread.

    Each entry's `read()` brings one tensor (one layer of a stacked param) to host.
    """
    for p in params:
        rule_for(p)  # unknown params are an error, not silently dropped
    for required in ("embed.embedding", "final_norm.scale"):
        if required not in params:
            raise ValueError(f"params have no {required!r}; got {sorted(params)}")
    entries = []

    def add(path, layer):
        rule, arr = RULES[path], params[path]
        shape = tuple(arr.shape)
        out_dtype = np.dtype(dtype if dtype is not None else arr.dtype)
        hf_shape = rule.hf_shape(rule.layer_shape(shape))

        def read():
            x = arr[layer] if rule.stacked else arr
            return rule.to_hf(_to_host(x)).astype(out_dtype, copy=False)

        entries.append(TensorEntry(rule.name(layer), hf_shape, out_dtype, read))

    add("embed.embedding", 0)
    stacked = [p for p in RULES if RULES[p].stacked and p in params]
    n_layers = {params[p].shape[0] for p in stacked}
    if len(n_layers) > 1:
        raise ValueError(f"stacked params disagree on the number of layers: {n_layers}")
    for layer in range(n_layers.pop() if n_layers else 0):
        for p in stacked:
            add(p, layer)
    add("final_norm.scale", 0)
    if "lm_head.kernel" in params:
        add("lm_head.kernel", 0)
    return entries


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping {a: {b: x}} -> {'a.b': x}."""
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(flatten_params(v, key + "."))
        else:
            flat[key] = v
    return flat


# --------------------------------------------------------------------------------------
# Models


def _path_str(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def load_hf_model(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
    **overrides,
):
    """Loads an HF Qwen3 / Llama directory into a `Decoder`. Returns (model, cfg).

    overrides: ModelConfig fields HF does not describe or that should be replaced, e.g.
      `param_dtype='bfloat16'` (values are cast on host while loading), `dtype`, `remat`.
    mesh / rules: place every parameter in the NamedSharding its logical axes map to under
      `rules` (default `parallel.DEFAULTRULES`); each device reads only its slice.
      Without a mesh, params go to the default device.
    """
    from flax import nnx

    from envace_jax import parallel
    from envace_jax.models.config import ModelConfig
    from envace_jax.models.decoder import abstract_model

    cfg = ModelConfig.from_hf(read_hf_config(path), **overrides)
    abstract = abstract_model(cfg)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise NotImplementedError(
            f"the decoder has non-parameter state {list(nnx.to_flat_state(rest).paths)} "
            "that a checkpoint does not provide"
        )
    shardings = (
        {
            _path_str(p): s
            for p, s in nnx.to_flat_state(parallel.param_shardings(params, mesh, rules))
        }
        if mesh is not None
        else {}
    )
    specs = {}
    for p, var in nnx.to_flat_state(params):
        name = _path_str(p)
        value = var.get_value()
        specs[name] = ParamSpec(tuple(value.shape), value.dtype, shardings.get(name))
    loaded = load_hf_params(path, specs)
    for p, var in nnx.to_flat_state(params):
        var.set_value(loaded[_path_str(p)])
    return nnx.merge(graphdef, params, rest), cfg


def _flat_param_arrays(model_or_state) -> dict[str, Any]:
    """{dotted path: array} from a Module, an nnx.State, or a nested dict of arrays."""
    from flax import nnx

    if isinstance(model_or_state, nnx.Module):
        model_or_state = nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return {
            _path_str(p): v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(model_or_state)
        }
    if isinstance(model_or_state, Mapping):
        return flatten_params(model_or_state)
    raise TypeError(f"expected a Module, nnx.State or dict of params, got {type(model_or_state)}")


def save_hf_model(
    model_or_state,
    cfg,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes an HF model directory that `AutoModelForCausalLM.from_pretrained` loads.

    model_or_state: a Decoder, its `nnx.state(model, nnx.Param)`, or a nested dict of arrays.
    dtype: storage dtype of the written tensors (default: the params' own).
    Writes config.json (`cfg.to_hf()`), generation_config.json, model.safetensors (or shards
    of at most `max_shard_bytes` plus an index; one tensor larger than that gets a shard of
    its own) and the tokenizer's files if given. Params are gathered to host one tensor at
    a time. In a multi-process run every process must call this (the gathers are
    collective); only process 0 writes. Returns the names of the files written.
    """
    params = _flat_param_arrays(model_or_state)
    expected = {"embed.embedding", "final_norm.scale"}
    if not cfg.tie_word_embeddings:
        expected.add("lm_head.kernel")
    missing = sorted(expected - set(params))
    if missing:
        raise ValueError(f"params lack {missing} required by the config")
    if cfg.tie_word_embeddings and "lm_head.kernel" in params:
        raise ValueError("config ties the embeddings but params have an 'lm_head.kernel'")
    entries = hf_tensor_entries(params, dtype)
    hf_cfg = dict(cfg.to_hf())
    if entries:
        stored = str(entries[0].dtype)
        hf_cfg["dtype"] = hf_cfg["torch_dtype"] = stored
    gen = {
        k: hf_cfg[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_cfg.get(k) is not None
    }
    gen.update(generation_config or {})
    writer = jax.process_index() == 0
    out_dir = os.fspath(out_dir)
    if not writer:  # still take part in every gather, in the same order
        for e in entries:
            e.read()
        return []
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    files = write_hf_tensors(entries, out_dir, max_shard_bytes=max_shard_bytes)
    log.info(
        "wrote %.1f MB to %s in %.1fs",
        sum(e.nbytes for e in entries) / 1e6,
        out_dir,
        time.perf_counter() - start,
    )
    for name, content in (("config.json", hf_cfg), ("generation_config.json", gen)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
        files.append(name)
    if tokenizer is not None:
        files.extend(os.path.basename(f) for f in tokenizer.save_pretrained(out_dir))
    return files
