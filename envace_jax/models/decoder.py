"""Decoder-only transformer (Flax NNX) for the Qwen3 and Llama families.

Both families are the same network: RMSNorm pre-norm blocks, rotary position embeddings
(Llama-3 frequency scaling optional), grouped-query attention, SwiGLU MLP, tied or untied
LM head. Qwen3 adds a per-head RMSNorm over head_dim on q and k (`cfg.qk_norm`). Parameters
are stored in `cfg.param_dtype`, matmuls run in `cfg.dtype`; RMSNorm, rotary, softmax and
the logits are float32.

Parameter tree (`nnx.state(model, nnx.Param)`, see `param_paths`): kernels are [in, out]
(torch Linear weights transposed) with heads split out, and every per-layer parameter is
stacked over a leading layers axis L, so the forward is one `lax.scan` whose compile time
does not grow with depth. Every parameter carries its logical axis names as the NNX
`out_sharding` metadata (what `nnx.get_partition_spec` and `parallel.param_shardings` read).

KV cache semantics (one code path for prefill, decode and chunked prefill):
    `KVCache.k`, `.v` are [L, B, S, K, D]. A token at position p of row b is written into
    slot p of row b, and a query at position p attends to the slots s <= p of its row.
    Positions in one call are contiguous per row (p = start_b + t), starts may differ per
    row. So
      * prefill: positions 0..T-1 on a right-padded prompt batch (the pad tokens' slots lie
        past each row's length and are overwritten later, never read before that);
      * decode: T = 1, positions = each row's current length (rows at different lengths);
      * chunked prefill of appended tokens (e.g. an observation after a tool call): positions
        start at each row's current length, right-padded like the prompt.
    Slots beyond a row's written tokens are never read: they are > p for every query.
    `kv_window=W` (static) attends over slots [0, W) only, for a caller that knows every
    position in the call is < W: the result is the same, at a cost that grows with W instead
    of S (the decode loop widens W as its rows grow; see `sampling.loop.decode`).
    The caller keeps 0 <= p < S. A token with p outside [0, S) is not written (the write
    uses scatter with mode='drop': `dynamic_update_slice` would clamp the start index and
    silently overwrite valid slots) and its own logits are meaningless; other rows and
    earlier slots are unaffected. With a cache, masking is by position only, so
    `attention_mask` must be None (pad tokens are handled by the slot rule above).

Cache-less path (training, scoring): causal by token index combined with `attention_mask`
on keys, so right- and left-padded batches both work; for left padding the caller passes
positions that start at 0 at each row's first real token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from envace_jax.models.config import ModelConfig
from envace_jax.parallel import with_logical_constraint

# Logical axes of the KV cache [L, B, S, K, D] (for `parallel.logical_to_sharding`).
CACHE_LOGICAL_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")
_INIT_STD = 0.02  # HF's initializer_range for both families


# --------------------------------------------------------------------------- tree


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


# ------------------------------------------------------------------- primitives


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies [D/2] (float32), with Llama-3 scaling if configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None:  # Llama 3.1: stretch long wavelengths, keep short ones, blend between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = np.where(medium, blended, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """sin, cos [B, T, D/2] float32 for int positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotates x [B, T, N, D] by sin/cos [B, T, D/2] (HF 'rotate_half' layout), in float32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------- modules


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


def causal_mask(batch: int, length: int, attention_mask: jax.Array | None) -> jax.Array:
    """bool [B, T, T]: causal by token index, and only onto real keys (attention_mask [B, T])."""
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, :] > 0)
    return jnp.broadcast_to(mask, (batch, length, length))


def query_blocks(length: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of the cache-less attention's query blocks: queries [start, end) attend
    to keys [0, end), all that causality lets them see."""
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def attend(qg, keys, values, mask, dt):
    """Grouped-query attention: qg [B, T, K, G, D], keys/values [B, S, K, D], mask bool
    [B, T, S] -> [B, T, K, G, D]. Scores and softmax in float32."""
    D = qg.shape[-1]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (D**-0.5)
    # A finite fill keeps fully masked rows (left padding's pad queries) NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgts,bskd->btkgd", probs, values)


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


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    # Save the projections' outputs (dots without batch dims); recompute attention and
    # elementwise work. The attention einsums carry batch dims and are recomputed.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class CausalLM(nnx.Module):
    """The call the sampling loop and the scorers make: `Decoder`'s, and that of a model
    standing in for one (`rollout.role_models.RoleDecoders`); a subclass implements `_forward`."""

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        kv_window: int | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions: int [B, T]. attention_mask: optional [B, T] (1 = real token),
        cache-less path only. cache: KVCache or None. kv_window: with a cache, attend over
        its first kv_window slots only (every position must be below it).

        Returns logits [B, T, V] float32 and the updated cache (None if none was given).
        """
        return self._forward(tokens, positions, attention_mask, cache, kv_window)

    def init_cache(self, batch: int, max_len: int):
        """The empty cache this model decodes `batch` rows of up to `max_len` positions with."""
        return init_cache(self.cfg, batch, max_len)

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        raise NotImplementedError


class Decoder(CausalLM):
    """Causal LM. See the module docstring for the parameter tree and cache semantics."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        self.layers = Block(cfg, rngs)
        self.final_norm = RMSNorm(cfg, "final_norm.scale", rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Kernel(cfg, "lm_head.kernel", rngs)

    def _hidden_states(self, tokens, positions, attention_mask, cache, kv_window, fresh=False):
        """The final-normed hidden states [B, T, E] (compute dtype) and the updated cache; the
        arguments are `__call__`'s, and `prefill`'s `fresh`."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        check_inputs(cfg, tokens, positions, attention_mask, cache, kv_window, KVCache)
        B, T = tokens.shape
        positions = positions.astype(jnp.int32)

        emb = self.embed.embedding[...]
        # Gather from a table whose embed dim is whole (FSDP all-gathers it, as for any
        # weight): gathering from the fsdp-sharded table would leave the activations
        # sharded on embed, which XLA can only reshard to batch by full rematerialisation.
        table = with_logical_constraint(emb, ("vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(dt)
        x = with_logical_constraint(x, ("batch", "length", "act_embed"))
        sin, cos = rope_tables(positions, cfg)

        if cache is None or fresh:
            mask = causal_mask(B, T, attention_mask)
            cache_kv = None if cache is None else (cache.k, cache.v)
        else:
            slots = jnp.arange(kv_window or cache.max_len, dtype=jnp.int32)
            mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, W]
            cache_kv = (cache.k, cache.v)

        # Scan with jax.lax.scan over the split layer state rather than nnx.scan: the
        # stacked parameters are plain xs, the cache is carried (written in place by the
        # scatter), and nothing depends on NNX transform metadata.
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            h, kv = carry
            params, layer = xs
            h, kv = nnx.merge(graphdef, params)(h, sin, cos, mask, positions, kv, layer, fresh)
            return (h, kv), None

        if cfg.remat != "none":
            body = jax.checkpoint(
                body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers
            )
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if cfg.scan_layers:
            (x, cache_kv), _ = jax.lax.scan(body, (x, cache_kv), (layer_state, layer_ids))
        else:
            for i in range(cfg.num_layers):
                params_i = jax.tree.map(lambda a, i=i: a[i], layer_state)
                (x, cache_kv), _ = body((x, cache_kv), (params_i, layer_ids[i]))

        x = self.final_norm(x)
        new_cache = None if cache is None else KVCache(k=cache_kv[0], v=cache_kv[1])
        return x, new_cache

    def prefill(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        kv_window: int | None = None,
        fresh: bool = False,
    ) -> KVCache:
        """Writes `tokens` [B, T] into `cache` without computing logits: a long prompt never
        materialises [B, T, V] (for a 150k vocabulary that is ~0.6 MB per token).

        fresh (static): `positions` are 0..T-1 in every row (a prompt batch), so the queries
        attend to the call's own keys in causal blocks, as the cache-less path does, instead
        of to every slot of the window (256 demo prompts in the 512-token bucket, 2 cores:
        11-14 s -> 7-9 s)."""
        return self._hidden_states(tokens, positions, None, cache, kv_window, fresh)[1]

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        """`__call__`: the logits from the final hidden states."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        x, new_cache = self._hidden_states(tokens, positions, attention_mask, cache, kv_window)
        emb = self.embed.embedding[...]
        if cfg.tie_word_embeddings:
            logits = jnp.einsum(
                "bte,ve->btv", x, emb.astype(dt), preferred_element_type=jnp.float32
            )
        else:
            logits = jnp.einsum(
                "bte,ev->btv",
                x,
                self.lm_head.kernel[...].astype(dt),
                preferred_element_type=jnp.float32,
            )
        logits = with_logical_constraint(logits, ("batch", "length", "act_vocab"))
        return logits, new_cache


def check_inputs(cfg, tokens, positions, attention_mask, cache, kv_window, cache_type):
    """Raises ValueError, naming the argument, for a call that a `CausalLM` cannot run."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    if attention_mask is not None:
        if cache is not None:
            raise ValueError(
                "attention_mask is only for the cache-less path; with a cache, masking is "
                "by position (see the decoder module docstring)"
            )
        if attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask {attention_mask.shape} must match tokens {tokens.shape}"
            )
    if kv_window is not None and not (cache is not None and 1 <= kv_window <= cache.max_len):
        raise ValueError(
            f"kv_window={kv_window} needs a cache and must lie in [1, the cache length"
            f" {None if cache is None else cache.max_len}]"
        )
    if cache is not None:
        if not isinstance(cache, cache_type):
            raise ValueError(
                f"cache: this model decodes with a {cache_type.__name__}, "
                f"not a {type(cache).__name__}"
            )
        cache.check(cfg, tokens.shape[0])


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The model with ShapeDtypeStruct parameters (no allocation), for loaders."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
