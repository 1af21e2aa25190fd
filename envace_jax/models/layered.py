"""The sampler's model on a CPU device: the decoder's parameters, and its cache, once per layer.

`Decoder` scans its layers over parameters stacked [L, ...] and a cache [L, B, S, K, D]. On CPU,
XLA copies each layer's weight slice and cache window before the dots read them, about a third
of a SmolLM2-135M decode step (`benchmarks/decode_layouts.py`). `LayeredDecoder` holds the same
weights per layer, in the layouts its dots read (q/k/v fused, gate/up fused, o as [H*D, E]),
keeps a cache per layer [B, K, S, D] (`LayerCache`), and runs its layers unrolled. It computes
what the decoder computes, with the same cache semantics (the decoder's module docstring), so
the decode loop takes either model.

A decode step writes the new token's key and value before attending over the cache, except at
batch 1: there it attends over the old cache, adds the token's own score apart, and writes
after. At batch 1, XLA turns the write into a dynamic-update-slice fused into the attention that
reads it, and then copies the whole donated cache; at batch > 1, a write after the read makes it
copy the cache instead.

`DecodingWeights` picks what the sampler runs: a `LayeredDecoder` for a `Decoder` on one CPU
device, the model itself elsewhere (an accelerator, or a batch split over devices, keeps the
stacked layout that the train step shards). The server keeps the stacked decoder.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from flax import nnx, struct

from envace_jax.models.config import ModelConfig
from envace_jax.models.decoder import CausalLM, Decoder, check_inputs
from envace_jax.models.kv_cache import zero_pad
from envace_jax.models.primitives import (
    apply_rope,
    attend,
    causal_mask,
    query_blocks,
    rms_norm,
    rope_tables,
)
from envace_jax.parallel import with_logical_constraint

# Logical axes of one layer's keys or values [B, K, S, D].
LAYER_CACHE_AXES = ("batch", "kv_heads", "length", "head_dim")


@struct.dataclass
class LayerCache:
    """Keys and values per layer: k[i], v[i] [B, K, S, D] for layer i; slot s holds position s.
    The same methods as `decoder.KVCache`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def take_rows(self, rows: jax.Array) -> LayerCache:
        return jax.tree.map(lambda a: a[rows], self)

    def put_rows(self, rows: jax.Array, part: LayerCache) -> LayerCache:
        return jax.tree.map(lambda a, b: a.at[rows].set(b, mode="drop"), self, part)

    def grow(self, max_len: int) -> LayerCache:
        return jax.tree.map(lambda a: zero_pad(a, 2, max_len), self)

    def constrained(self) -> LayerCache:
        return jax.tree.map(lambda a: with_logical_constraint(a, LAYER_CACHE_AXES), self)

    def check(self, cfg: ModelConfig, batch: int) -> None:
        """Raises ValueError unless this cache fits `cfg` and `batch` rows."""
        L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        shapes = {a.shape for a in (*self.k, *self.v)}
        (b, k, _, d), *others = shapes
        if others or len(self.k) != L or len(self.v) != L or (b, k, d) != (batch, K, D):
            raise ValueError(
                f"LayerCache of {len(self.k)} / {len(self.v)} layers with shapes "
                f"{sorted(shapes)} does not fit this model and batch: expected {L} layers "
                f"of [B={batch}, K={K}, S, D={D}]"
            )


class LayerWeights(nnx.Module):
    """Layer `i` of a decoder's stacked parameters, in the layouts the layer's dots read."""

    def __init__(self, decoder: Decoder, i: int):
        cfg = decoder.cfg
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        layers = decoder.layers
        attn, mlp = layers.attn, layers.mlp
        at = lambda param: param[...][i]
        self.qkv = nnx.Param(
            jnp.concatenate(
                [
                    at(attn.q_proj.kernel).reshape(E, H * D),
                    at(attn.k_proj.kernel).reshape(E, K * D),
                    at(attn.v_proj.kernel).reshape(E, K * D),
                ],
                -1,
            )
        )
        self.o = nnx.Param(at(attn.o_proj.kernel).reshape(H * D, E))
        self.gate_up = nnx.Param(
            jnp.concatenate([at(mlp.gate_proj.kernel), at(mlp.up_proj.kernel)], -1)
        )
        self.down = nnx.Param(at(mlp.down_proj.kernel))
        self.attn_norm = nnx.Param(at(layers.attn_norm.scale))
        self.mlp_norm = nnx.Param(at(layers.mlp_norm.scale))
        if cfg.qk_norm:
            self.q_norm = nnx.Param(at(attn.q_norm.scale))
            self.k_norm = nnx.Param(at(attn.k_norm.scale))


class LayeredDecoder(CausalLM):
    """A `Decoder`'s network over per-layer weights and a `LayerCache` (the module docstring)."""

    def __init__(self, decoder: Decoder):
        cfg = self.cfg = decoder.cfg
        self.embedding = nnx.Param(decoder.embed.embedding[...])
        self.final_norm = nnx.Param(decoder.final_norm.scale[...])
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(decoder.lm_head.kernel[...])
        self.layers = nnx.List([LayerWeights(decoder, i) for i in range(cfg.num_layers)])

    def init_cache(self, batch: int, max_len: int) -> LayerCache:
        cfg = self.cfg
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
        return LayerCache(k=zeros(), v=zeros())

    def _hidden_states(self, tokens, positions, attention_mask, cache, kv_window, fresh=False):
        """The final-normed hidden states [B, T, E] and the updated cache (`Decoder`'s)."""
        cfg = self.cfg
        check_inputs(cfg, tokens, positions, attention_mask, cache, kv_window, LayerCache)
        B, T = tokens.shape
        positions = positions.astype(jnp.int32)
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(cfg.dtype)
        sin, cos = rope_tables(positions, cfg)
        if cache is None or fresh:
            order = "own"  # attend to the call's own keys, causal by token index
            mask = causal_mask(B, T, attention_mask)
        else:
            order = "read_first" if B == T == 1 else "write_first"
            slots = jnp.arange(kv_window or cache.max_len, dtype=jnp.int32)[None, None, :]
            if order == "read_first":  # the token's own slot is not written yet: added apart
                mask = slots < positions[:, :, None]
            else:
                mask = slots <= positions[:, :, None]  # [B, T, W]
        new_k, new_v = [], []
        for i, w in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = _layer(cfg, w, x, sin, cos, positions, mask, kv, order)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return x, None if cache is None else LayerCache(k=tuple(new_k), v=tuple(new_v))

    def prefill(self, tokens, positions, cache, kv_window=None, fresh=False) -> LayerCache:
        """`models.protocols.Prefills` (as `Decoder.prefill`): writes `tokens` into `cache`
        without computing logits."""
        return self._hidden_states(tokens, positions, None, cache, kv_window, fresh)[1]

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        dt = jnp.dtype(self.cfg.dtype)
        x, new_cache = self._hidden_states(tokens, positions, attention_mask, cache, kv_window)
        if self.cfg.tie_word_embeddings:
            spec, head = "bte,ve->btv", self.embedding[...]
        else:
            spec, head = "bte,ev->btv", self.lm_head[...]
        logits = jnp.einsum(spec, x, head.astype(dt), preferred_element_type=jnp.float32)
        return logits, new_cache


def _layer(cfg: ModelConfig, w: LayerWeights, x, sin, cos, positions, mask, kv, order):
    """One layer on x [B, T, E]. kv: None or this layer's (k, v) [B, K, S, D]. order: 'own'
    (the call's own keys; written to slots 0..T-1 if there is a cache), 'write_first' or
    'read_first' (see the module docstring). Returns x and the updated (k, v) or None."""
    dt = x.dtype
    B, T, _ = x.shape
    H, K, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    eps = cfg.rms_norm_eps
    x = x.reshape(B * T, -1)  # the dense layers are per token: plain [rows, E] matmuls
    h = (rms_norm(x, w.attn_norm[...], eps) @ w.qkv[...].astype(dt)).reshape(B, T, -1)
    q = h[..., : H * D].reshape(B, T, H, D)
    k = h[..., H * D : (H + K) * D].reshape(B, T, K, D)
    v = h[..., (H + K) * D :].reshape(B, T, K, D)
    if cfg.qk_norm:
        q, k = rms_norm(q, w.q_norm[...], eps), rms_norm(k, w.k_norm[...], eps)
    q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
    qg = q.reshape(B, T, K, H // K, D)
    if kv is not None:  # what the cache holds: the attention reads these values
        k, v = (a.astype(kv[0].dtype).astype(dt) for a in (k, v))

    if order == "own":
        out = jnp.concatenate(
            [
                attend(qg[:, a:e], k[:, :e], v[:, :e], mask[:, a:e, :e], dt)
                for a, e in query_blocks(T, cfg.query_block)
            ],
            axis=1,
        )
        if kv is not None:
            kv = tuple(
                jax.lax.dynamic_update_slice(c, a.transpose(0, 2, 1, 3).astype(c.dtype), (0,) * 4)
                for c, a in zip(kv, (k, v), strict=True)
            )
    elif order == "write_first":
        kv = _write(kv, k, v, positions)
        out = _attend_cache(qg, kv, mask, dt)
    else:
        out = _attend_cache_and_self(qg, kv, k, v, mask, dt)
        kv = _write(kv, k, v, positions)

    x = x + out.reshape(B * T, H * D) @ w.o[...].astype(dt)
    h = rms_norm(x, w.mlp_norm[...], eps) @ w.gate_up[...].astype(dt)
    x = x + (jax.nn.silu(h[:, :F]) * h[:, F:]) @ w.down[...].astype(dt)
    return x.reshape(B, T, -1), kv


def _write(kv, k, v, positions):
    """(k, v) caches [B, K, S, D] with the call's keys and values [B, T, K, D] at `positions`
    [B, T]; positions outside [0, S) are dropped (the decoder's rule)."""
    rows = jnp.arange(k.shape[0])[:, None]
    put = dict(mode="drop", wrap_negative_indices=False)
    return tuple(
        c.at[rows, :, positions].set(a.astype(c.dtype), **put)
        for c, a in zip(kv, (k, v), strict=True)
    )


def _attend_cache(qg, kv, mask, dt):
    """qg [B, T, K, G, D] over the first W cache slots (mask [B, T, W]) -> [B, T, K, G, D]."""
    W = mask.shape[-1]
    keys, values = (c[:, :, :W].astype(dt) for c in kv)
    if qg.shape[1] == 1:  # a decode step: without the query axis, no transposes around the dots
        scores = jnp.einsum("bkgd,bksd->bkgs", qg[:, 0], keys, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, :, None], scores * qg.shape[-1] ** -0.5, _LOW)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        return jnp.einsum("bkgs,bksd->bkgd", probs, values)[:, None]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * qg.shape[-1] ** -0.5, _LOW)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgts,bksd->btkgd", probs, values)


def _attend_cache_and_self(qg, kv, k, v, mask, dt):
    """One query per row (T = 1) over the cache slots before it (mask [B, 1, W]) and its own
    key and value k, v [B, 1, K, D], which the cache does not hold yet."""
    W = mask.shape[-1]
    keys, values = (c[:, :, :W].astype(dt) for c in kv)
    scale = qg.shape[-1] ** -0.5
    s_cache = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    s_cache = jnp.where(mask[:, None, None], s_cache * scale, _LOW)
    s_self = jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32) * scale
    top = jnp.maximum(s_cache.max(-1), s_self)
    e_cache, e_self = jnp.exp(s_cache - top[..., None]), jnp.exp(s_self - top)
    total = e_cache.sum(-1) + e_self
    out = jnp.einsum("bkgts,bksd->btkgd", e_cache.astype(dt), values)
    out = out + jnp.einsum("bkgt,btkd->btkgd", e_self.astype(dt), v)
    return (out / jnp.moveaxis(total, -1, 1)[..., None]).astype(dt)


_LOW = jnp.finfo(jnp.float32).min  # a finite fill: a row with no slot seen stays NaN-free


def layered_here(model: nnx.Module) -> bool:
    """Whether the sampling loop runs `model` as a `LayeredDecoder` (the module docstring)."""
    return isinstance(model, Decoder) and jax.default_backend() == "cpu" and jax.device_count() == 1


class DecodingWeights:
    """The graph and parameters a sampling loop runs `model` with (see `layered_here`).

    `bound(params)` gives weights over the model's own parameter State (e.g. a train step's);
    their per-layer copy is made when `params` is first read."""

    def __init__(self, model: nnx.Module):
        source, params = nnx.split(model)
        self.graphdef, self._convert = source, None
        if layered_here(model):
            self._convert = jax.jit(lambda p: nnx.state(LayeredDecoder(nnx.merge(source, p))))
            self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: LayeredDecoder(model)))
        self._source, self._params = params, None

    def bound(self, params) -> DecodingWeights:
        """The same graph and conversion over `params`; this object is left as it is."""
        view = copy.copy(self)
        view._source, view._params = params, None
        return view

    @property
    def params(self):
        if self._params is None:
            convert = self._convert or (lambda p: p)
            self._params = convert(self._source)
        return self._params
