"""The decoder's parameter tree and the NNX modules that hold it: embedding, RMSNorm, the
attention and MLP projections, and `Block`, the stacked transformer layers.

Parameter tree (`nnx.state(model, nnx.Param)`, see `param_paths`): kernels are [in, out]
(torch Linear weights transposed) with heads split out, and every per-layer parameter is
stacked over a leading layers axis L, so the forward is one `lax.scan` whose compile time
does not grow with depth. Every parameter carries its logical axis names as the NNX
`out_sharding` metadata (what `nnx.get_partition_spec` and `parallel.param_shardings` read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from envace_jax.models.config import ModelConfig
from envace_jax.models.primitives import apply_rope, attend, query_blocks, rms_norm
from envace_jax.parallel import with_logical_constraint

_INIT_STD = 0.02  # HF's initializer_range for both families


def param_paths(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every parameter path -> (shape, logical axes). The single source of the tree layout."""
    V, E, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    L, H, K, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = {
        "embed.embedding": ((V, E), ("vocab", "embed")),
        "layers.attn_norm.scale": ((L, E), ("layers", "norm")),
        "layers.attn.q_proj.kernel": ((L, E, H, D), ("layers", "embed", "heads", "head_dim")),
        "layers.attn.k_proj.kernel": ((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "layers.attn.v_proj.kernel": ((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim")),
        "layers.attn.o_proj.kernel": ((L, H, D, E), ("layers", "heads", "head_dim", "embed")),
    }
    if cfg.qk_norm:
        p["layers.attn.q_norm.scale"] = ((L, D), ("layers", "norm"))
        p["layers.attn.k_norm.scale"] = ((L, D), ("layers", "norm"))
    p.update(
        {
            "layers.mlp_norm.scale": ((L, E), ("layers", "norm")),
            "layers.mlp.gate_proj.kernel": ((L, E, F), ("layers", "embed", "mlp")),
            "layers.mlp.up_proj.kernel": ((L, E, F), ("layers", "embed", "mlp")),
            "layers.mlp.down_proj.kernel": ((L, F, E), ("layers", "mlp", "embed")),
            "final_norm.scale": ((E,), ("norm",)),
        }
    )
    if not cfg.tie_word_embeddings:
        p["lm_head.kernel"] = ((E, V), ("embed", "vocab"))
    return p


def _new_param(cfg: ModelConfig, path: str, rngs: nnx.Rngs) -> nnx.Param:
    shape, axes = param_paths(cfg)[path]
    dtype = jnp.dtype(cfg.param_dtype)
    if path.endswith(".scale"):
        value = jnp.ones(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    # eager_sharding=False: the names are logical, resolved later by parallel.shard_model.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embedding = _new_param(cfg, "embed.embedding", rngs)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
        self.scale = _new_param(cfg, path, rngs)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Kernel(nnx.Module):
    """A bias-free projection's weight; the caller applies it with an einsum."""

    def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
        self.kernel = _new_param(cfg, path, rngs)


def _add_kernels(
    module: nnx.Module, cfg: ModelConfig, prefix: str, names: tuple[str, ...], rngs: nnx.Rngs
):
    """Sets `module.<name>` to the `Kernel` at `<prefix>.<name>.kernel` for each name, in order
    (the order in which they draw their init keys)."""
    for name in names:
        setattr(module, name, Kernel(cfg, f"{prefix}.{name}.kernel", rngs))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        _add_kernels(self, cfg, "layers.attn", ("q_proj", "k_proj", "v_proj", "o_proj"), rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, "layers.attn.q_norm.scale", rngs)
            self.k_norm = RMSNorm(cfg, "layers.attn.k_norm.scale", rngs)

    def __call__(self, x, sin, cos, mask, positions, cache_kv, layer, fresh=False):
        """One layer's attention (called with that layer's slice of the stacked params).

        x [B, T, E]; sin/cos [B, T, D/2]; mask bool [B, T, W] over the attended slots (W = T
        without a cache or when `fresh`; with one, the first W <= S slots);
        positions [B, T]; cache_kv None or (k, v) [L, B, S, K, D]; layer: int32 index;
        fresh: the call's positions are 0..T-1 in every row, so its own keys are all it sees.
        Returns y [B, T, E] and the updated (k, v) or None.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        B, T, _ = x.shape
        K, D = cfg.num_kv_heads, cfg.head_dim
        G = cfg.num_heads // K
        q = jnp.einsum("bte,ehd->bthd", x, self.q_proj.kernel[...].astype(dt))
        k = jnp.einsum("bte,ekd->btkd", x, self.k_proj.kernel[...].astype(dt))
        v = jnp.einsum("bte,ekd->btkd", x, self.v_proj.kernel[...].astype(dt))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
        q = with_logical_constraint(q, ("batch", "length", "act_heads", "head_dim"))
        k = with_logical_constraint(k, ("batch", "length", "act_kv_heads", "head_dim"))
        v = with_logical_constraint(v, ("batch", "length", "act_kv_heads", "head_dim"))

        if cache_kv is None:
            keys, values = k, v
        else:
            ck, cv = cache_kv
            rows = jnp.arange(B)[:, None]  # [B, 1] broadcast against positions [B, T]
            put = dict(mode="drop", wrap_negative_indices=False)
            ck = ck.at[layer, rows, positions].set(k.astype(ck.dtype), **put)
            cv = cv.at[layer, rows, positions].set(v.astype(cv.dtype), **put)
            cache_kv = (ck, cv)
            if not fresh:
                W = mask.shape[-1]  # the attended slots [0, W), W <= S (`kv_window`)
                keys, values = ck[layer, :, :W].astype(dt), cv[layer, :, :W].astype(dt)
            else:
                keys, values = k.astype(ck.dtype).astype(dt), v.astype(cv.dtype).astype(dt)

        qg = q.reshape(B, T, K, G, D)
        if cache_kv is None or fresh:
            # Causal by token index: a block of queries needs no key past its last query.
            # Skipping those keys leaves about half the score matrix, the bulk of a long
            # sequence's cost (demo policy, 8 x 1,024 tokens: train step 5.2 s -> 2.4 s);
            # the skipped keys were masked, so the result is the same.
            blocks = [
                attend(qg[:, a:e], keys[:, :e], values[:, :e], mask[:, a:e, :e], dt)
                for a, e in query_blocks(T, cfg.query_block)
            ]
            out = jnp.concatenate(blocks, axis=1)
        else:
            out = attend(qg, keys, values, mask, dt)
        out = out.reshape(B, T, K * G, D)
        out = with_logical_constraint(out, ("batch", "length", "act_heads", "head_dim"))
        y = jnp.einsum("bthd,hde->bte", out, self.o_proj.kernel[...].astype(dt))
        return y, cache_kv


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        _add_kernels(self, cfg, "layers.mlp", ("gate_proj", "up_proj", "down_proj"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        gate = jnp.einsum("bte,ef->btf", x, self.gate_proj.kernel[...].astype(dt))
        up = jnp.einsum("bte,ef->btf", x, self.up_proj.kernel[...].astype(dt))
        h = with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return jnp.einsum("btf,fe->bte", h, self.down_proj.kernel[...].astype(dt))


class Block(nnx.Module):
    """All L layers: parameters are stacked [L, ...]; `__call__` runs ONE layer's slice."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, "layers.attn_norm.scale", rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, "layers.mlp_norm.scale", rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, sin, cos, mask, positions, cache_kv, layer, fresh=False):
        h, cache_kv = self.attn(
            self.attn_norm(x), sin, cos, mask, positions, cache_kv, layer, fresh
        )
        x = with_logical_constraint(x + h, ("batch", "length", "act_embed"))
        x = x + self.mlp(self.mlp_norm(x))
        return with_logical_constraint(x, ("batch", "length", "act_embed")), cache_kv
