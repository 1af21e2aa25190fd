"""Decoder-only transformer (Flax NNX) for the Qwen3 and Llama families.

Both families are the same network: RMSNorm pre-norm blocks, rotary position embeddings
(Llama-3 frequency scaling optional), grouped-query attention, SwiGLU MLP, tied or untied
LM head. Qwen3 adds a per-head RMSNorm over head_dim on q and k (`cfg.qk_norm`). Parameters
are stored in `cfg.param_dtype`, matmuls run in `cfg.dtype`; RMSNorm, rotary, softmax and
the logits are float32.

This module holds the model (`CausalLM`, `Decoder`), its input checks and the cache semantics
below; its parts are the numerics (`models.primitives`), the parameter tree and layers
(`models.blocks`, `param_paths`: kernels [in, out] with heads split out, every per-layer
parameter stacked over a leading layers axis L and scanned) and the cache (`models.kv_cache`).

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

import jax
import jax.numpy as jnp
from flax import nnx

from envace_jax.models.blocks import Block, Embed, Kernel, RMSNorm, param_paths
from envace_jax.models.config import ModelConfig
from envace_jax.models.kv_cache import CACHE_LOGICAL_AXES, KVCache, init_cache, zero_pad
from envace_jax.models.primitives import causal_mask, rope_tables
from envace_jax.parallel import with_logical_constraint

# The decoder's API, part of it defined next to its parts (`kv_cache`, `blocks`).
__all__ = [
    "CACHE_LOGICAL_AXES",
    "CausalLM",
    "Decoder",
    "KVCache",
    "abstract_model",
    "check_inputs",
    "init_cache",
    "param_paths",
    "zero_pad",
]

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
    """Causal LM. See the module docstring for the cache semantics and `models.blocks` for the
    parameter tree."""

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
        """`models.protocols.Prefills`: writes `tokens` [B, T] into `cache` without computing
        logits, so a long prompt never materialises [B, T, V] (for a 150k vocabulary that is
        ~0.6 MB per token).

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
