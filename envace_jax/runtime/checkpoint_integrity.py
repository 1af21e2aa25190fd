"""What a checkpoint holds, checked (`envace_jax.runtime.checkpoint`): the state's leaves, the JSON
meta, and the `integrity` item: key path, shape, dtype and a 64-bit content checksum of every
leaf.

Orbax detects missing or truncated files and mismatched shapes, but bytes garbled inside a
compressed chunk decode silently to wrong numbers; the checksum written at save time catches
that. It is computed on device from the global values, so it is the same for any sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

VERSION = 1


def integrity_item(leaves: list[tuple[str, jax.Array]]) -> dict:
    """The JSON item saved beside the arrays (leaves: (key path, array))."""
    return {"version": VERSION, "leaves": describe(leaves)}


def describe(leaves: list[tuple[str, jax.Array]]) -> list[dict]:
    """Path, shape, dtype and content checksum (16 hex digits) of every leaf."""
    sums = jax.device_get(checksums([leaf for _, leaf in leaves]))
    return [
        {
            "path": name,
            "shape": list(leaf.shape),
            "dtype": jnp.dtype(leaf.dtype).name,
            "checksum": f"{int(s[0]):08x}{int(s[1]):08x}",
        }
        for (name, leaf), s in zip(leaves, sums, strict=True)
    ]


def state_leaves(state: Any) -> list[tuple[str, jax.Array]]:
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


def abstract_tree(target: Any) -> Any:
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


def json_problem(x: Any, where: str) -> str | None:
    """Why `x` would not round-trip through JSON unchanged, naming the offending key."""
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is not a string"
            problem = json_problem(v, f"{where}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            problem = json_problem(v, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if x is None or isinstance(x, str | bool | int | float):
        return None
    return (
        f"{where}: a {type(x).__name__} is not JSON (convert array scalars with float() / "
        "int() / .tolist())"
    )


def layout_problem(integrity: Any, target: Any) -> str | None:
    """Why the checkpoint's leaves (from its integrity item) do not fit `target`, or None."""
    try:
        saved = {e["path"]: e for e in integrity["leaves"]}
        if integrity["version"] != VERSION:
            return f"integrity item version {integrity['version']} is not {VERSION}"
    except (KeyError, TypeError) as e:
        return f"malformed integrity item ({type(e).__name__}: {e})"
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


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def checksums(xs: list[jax.Array]) -> jax.Array:
    """[n, 2] uint32: `checksum` of every array, as one program. One dispatch per save rather
    than one per leaf: with many cross-process reductions in flight at once, multi-process CPU
    runs (gloo collectives) can hang."""
    return jnp.stack([checksum(x) for x in xs])


@jax.jit
def checksum(x: jax.Array) -> jax.Array:
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
