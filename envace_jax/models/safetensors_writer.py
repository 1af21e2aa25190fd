"""Writing safetensors files one tensor at a time, sharded past a size limit.

The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes; the header needs only shapes, so each tensor is read
(gathered to host) just before its bytes are written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

_ST_DTYPES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]  # gathers this one tensor to host, in HF layout

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_safetensors(file: str, entries: list[TensorEntry]) -> None:
    """Writes `entries` as one safetensors file, reading one tensor at a time.

    The format is an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and byte range, then the raw bytes; the header needs only shapes, so the
    data can be streamed after it.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {e.name!r}: dtype {e.dtype} has no safetensors code")
        header[e.name] = {
            "dtype": _ST_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            x = e.read()
            if x.shape != e.shape or x.dtype != e.dtype:
                raise AssertionError(f"{e.name}: got {x.shape} {x.dtype}, want {e.shape}")
            f.write(np.ascontiguousarray(x).tobytes())


def write_hf_tensors(
    entries: list[TensorEntry], out_dir: str | os.PathLike, *, max_shard_bytes: int
) -> list[str]:
    """Writes `model.safetensors`, or numbered shards plus `model.safetensors.index.json`
    when the total exceeds `max_shard_bytes`. Returns the file names written."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(os.path.join(out_dir, name), shard)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: n for n, s in zip(names, shards, strict=True) for e in s},
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names
