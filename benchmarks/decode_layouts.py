"""One greedy decode step at a real size: the decoder's step versus a layer-by-layer step over
per-layer weights and caches in the layouts the dots read, side by side in one run.

The decoder scans its layers over stacked weights and a stacked cache [L, B, S, K, D]; on CPU,
XLA copies each layer's weight slice and cache window before the dots read them. The
layer-by-layer step has none of those copies:
  * weights per layer, q/k/v and gate/up fused, `o_proj` as [H*D, E];
  * caches per layer [B, K, S, D];
  * the new token's key and value are written by scatter before the attention reads the cache
    (batch > 1), or, at batch 1, written after the attention has read the old cache, with the
    token's own score added apart: at batch 1 XLA turns the scatter into a dynamic-update-slice
    fused into its reader and copies the whole donated cache, and at batch > 1 a write after
    the read makes it copy the cache too.

    make smollm2 && python benchmarks/decode_layouts.py --model workdir/smollm2 --json out.json

Prints, for each batch, both steps' median time and the ratio, and whether both give the same
greedy tokens. Compile time is excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np
from flax import nnx

from envace_jax.models.hf_io import load_hf_model
from envace_jax.models.kv_cache import init_cache
from envace_jax.models.primitives import apply_rope, rms_norm, rope_tables

# The step decodes at position window - CONTEXT_GAP: 300 of 384, where sampler.py's rows are on
# average (prompt 256 plus half of 128 new tokens, in windows of 384).
CONTEXT_GAP = 84


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def layer_weights(model) -> list[dict]:
    """The decoder's stacked parameters, one dict per layer in dot-ready layouts."""
    cfg = model.cfg
    L, E, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    st = nnx.state(model.layers, nnx.Param)
    get = lambda v: np.asarray(v[...])
    attn, mlp = st["attn"], st["mlp"]
    qkv = np.concatenate(
        [
            get(attn["q_proj"]["kernel"]).reshape(L, E, H * D),
            get(attn["k_proj"]["kernel"]).reshape(L, E, K * D),
            get(attn["v_proj"]["kernel"]).reshape(L, E, K * D),
        ],
        -1,
    )
    gate_up = np.concatenate([get(mlp["gate_proj"]["kernel"]), get(mlp["up_proj"]["kernel"])], -1)
    stacked = {
        "qkv": qkv,
        "o": get(attn["o_proj"]["kernel"]).reshape(L, H * D, E),
        "gate_up": gate_up,
        "down": get(mlp["down_proj"]["kernel"]),
        "attn_norm": get(st["attn_norm"]["scale"]),
        "mlp_norm": get(st["mlp_norm"]["scale"]),
    }
    if cfg.qk_norm:
        stacked["q_norm"] = get(attn["q_norm"]["scale"])
        stacked["k_norm"] = get(attn["k_norm"]["scale"])
    return [{name: jnp.asarray(a[i]) for name, a in stacked.items()} for i in range(L)]


def layered_step(cfg, weights, embed, final_scale, lm_head, ks, vs, tok, pos):
    """Greedy tokens [B] and the updated per-layer caches for tokens [B, 1] at positions [B, 1]."""
    B = tok.shape[0]
    H, K, D, F = (
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    G, eps, S = H // K, cfg.rms_norm_eps, ks[0].shape[2]
    low = jnp.finfo(jnp.float32).min
    rows = jnp.arange(B)[:, None]
    x = jnp.take(embed, tok[:, 0], axis=0)
    sin, cos = rope_tables(pos, cfg)
    new_k, new_v = [], []
    for w, kc, vc in zip(weights, ks, vs, strict=True):
        h = rms_norm(x, w["attn_norm"], eps) @ w["qkv"]
        q = h[:, : H * D].reshape(B, 1, H, D)
        k = h[:, H * D : (H + K) * D].reshape(B, 1, K, D)
        v = h[:, (H + K) * D :].reshape(B, K, D)
        if cfg.qk_norm:
            q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
        q = apply_rope(q, sin, cos).reshape(B, K, G, D) * D**-0.5
        k = apply_rope(k, sin, cos).reshape(B, K, D)
        put = dict(mode="drop", wrap_negative_indices=False)
        if B == 1:
            seen = (jnp.arange(S)[None, :] < pos)[:, None, None]
            s_cache = jnp.where(seen, jnp.einsum("bkgd,bksd->bkgs", q, kc), low)
            s_self = jnp.einsum("bkgd,bkd->bkg", q, k)
            top = jnp.maximum(s_cache.max(-1), s_self)
            e_cache, e_self = jnp.exp(s_cache - top[..., None]), jnp.exp(s_self - top)
            o = jnp.einsum("bkgs,bksd->bkgd", e_cache, vc) + e_self[..., None] * v[:, :, None]
            o = o / (e_cache.sum(-1) + e_self)[..., None]
            kc = kc.at[rows, :, pos].set(k[:, None], **put)
            vc = vc.at[rows, :, pos].set(v[:, None], **put)
        else:
            kc = kc.at[rows, :, pos].set(k[:, None], **put)
            vc = vc.at[rows, :, pos].set(v[:, None], **put)
            seen = (jnp.arange(S)[None, :] <= pos)[:, None, None]
            s = jnp.where(seen, jnp.einsum("bkgd,bksd->bkgs", q, kc), low)
            o = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s, -1), vc)
        x = x + o.reshape(B, H * D) @ w["o"]
        h = rms_norm(x, w["mlp_norm"], eps) @ w["gate_up"]
        x = x + (jax.nn.silu(h[:, :F]) * h[:, F:]) @ w["down"]
        new_k.append(kc)
        new_v.append(vc)
    x = rms_norm(x, final_scale, eps)
    logits = x @ lm_head if lm_head is not None else jnp.einsum("be,ve->bv", x, embed)
    return jnp.argmax(logits, -1), new_k, new_v


def bench(model, batch: int, window: int, repeats: int) -> dict:
    cfg = model.cfg
    tok = jnp.asarray(np.random.default_rng(batch).integers(20, 1000, (batch, 1)), jnp.int32)
    pos = jnp.full((batch, 1), window - CONTEXT_GAP, jnp.int32)  # the benchmark's mean context

    graphdef, params = nnx.split(model)

    def decoder_step(params, cache, tok, pos):
        logits, cache = nnx.merge(graphdef, params)(tok, pos, cache=cache, kv_window=window)
        return jnp.argmax(logits[:, 0], -1), cache

    step = jax.jit(decoder_step, donate_argnums=(1,))
    state = {"cache": init_cache(cfg, batch, window)}

    def run_decoder():
        out, state["cache"] = step(params, state["cache"], tok, pos)
        return jax.block_until_ready(out)

    weights = layer_weights(model)
    embed = model.embed.embedding[...]
    final_scale = model.final_norm.scale[...]
    lm_head = None if cfg.tie_word_embeddings else model.lm_head.kernel[...]
    shape = (batch, cfg.num_kv_heads, window, cfg.head_dim)
    zeros = lambda: [jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers)]
    fast = jax.jit(lambda *a: layered_step(cfg, *a), donate_argnums=(4, 5))
    caches = {"k": zeros(), "v": zeros()}

    def run_layered():
        out, caches["k"], caches["v"] = fast(
            weights, embed, final_scale, lm_head, caches["k"], caches["v"], tok, pos
        )
        return jax.block_until_ready(out)

    same = bool((run_decoder() == run_layered()).all())  # both compile here
    t_decoder, t_layered = median_time(run_decoder, repeats), median_time(run_layered, repeats)
    return {
        "batch": batch,
        "window": window,
        "decoder_ms": 1e3 * t_decoder,
        "layered_ms": 1e3 * t_layered,
        "speedup": t_decoder / t_layered,
        "same_greedy_tokens": same,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint directory")
    ap.add_argument("--batches", default="1,2,8")
    ap.add_argument("--window", type=int, default=384, help="cache slots a step attends over")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.window <= CONTEXT_GAP:
        ap.error(f"--window must exceed {CONTEXT_GAP}: the step decodes at window - {CONTEXT_GAP}")
    model, cfg = load_hf_model(args.model)
    print(f"{args.model}: {cfg.num_params / 1e6:.1f}M params, window {args.window}")
    rows = [bench(model, int(b), args.window, args.repeats) for b in args.batches.split(",")]
    print(f"{'batch':>6} {'decoder ms':>11} {'layered ms':>11} {'speedup':>8} {'same':>5}")
    for r in rows:
        print(
            f"{r['batch']:>6} {r['decoder_ms']:>11.1f} {r['layered_ms']:>11.1f}"
            f" {r['speedup']:>7.2f}x {str(r['same_greedy_tokens']):>5}"
        )
    if args.json:
        machine.write_json(args.json, {"model": args.model, "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
