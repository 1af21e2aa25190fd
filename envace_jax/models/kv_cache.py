"""The decoder's KV cache: `KVCache` (keys and values stacked over layers), its row and length
operations, and the empty cache a model decodes with.

How a model writes and reads the cache (slot s holds position s; a query at position p reads
the slots <= p of its row) is in the `models.decoder` module docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from envace_jax.models.config import ModelConfig
from envace_jax.parallel import with_logical_constraint

# Logical axes of the KV cache [L, B, S, K, D] (for `parallel.logical_to_sharding`).
CACHE_LOGICAL_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Per-layer keys and values, k and v [L, B, S, K, D]; slot s holds position s.

    The row and length operations are methods, so that the decode loop serves any cache type
    (`models.layered.LayerCache` has the same ones)."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def take_rows(self, rows: jax.Array) -> KVCache:
        """The cache of rows `rows` [b] alone."""
        return KVCache(k=self.k[:, rows], v=self.v[:, rows])

    def put_rows(self, rows: jax.Array, part: KVCache) -> KVCache:
        """This cache with rows `rows` [b] replaced by `part`'s; rows >= B are dropped."""
        return KVCache(
            k=self.k.at[:, rows].set(part.k, mode="drop"),
            v=self.v.at[:, rows].set(part.v, mode="drop"),
        )

    def grow(self, max_len: int) -> KVCache:
        """This cache with `max_len` slots (>= its own); the new ones are empty."""
        return jax.tree.map(lambda a: zero_pad(a, 2, max_len), self)

    def constrained(self) -> KVCache:
        """Under a mesh, split over devices like the rows (`CACHE_LOGICAL_AXES`)."""
        return jax.tree.map(lambda a: with_logical_constraint(a, CACHE_LOGICAL_AXES), self)

    def check(self, cfg: ModelConfig, batch: int) -> None:
        """Raises ValueError unless this cache fits `cfg` and `batch` rows."""
        L, B, _, K, D = self.k.shape
        want = (cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim)
        if (L, B, K, D) != want or self.v.shape != self.k.shape:
            raise ValueError(
                f"KVCache k {self.k.shape} / v {self.v.shape} do not fit this model and "
                f"batch: expected [L={want[0]}, B={want[1]}, S, K={want[2]}, D={want[3]}]"
            )


def zero_pad(a: jax.Array, axis: int, size: int) -> jax.Array:
    """`a` zero-padded at the end of `axis` to `size`."""
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An all-zero cache for `batch` rows of up to `max_len` positions (dtype: cfg.dtype)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype if dtype is None else dtype)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
