"""Tunix's sampler on an HF Qwen3 checkpoint: the JAX peer's side of `sampler.py --tunix-python`.

Runs in a venv that has `google-tunix` (it pins its own jax and flax, so it does not share this
project's venv). Greedy decoding of the given token prompts, no stop token, timed best of
`--repeats` after one warm-up call; writes tokens/s and the new tokens to `--out`.

    TUNIX_VENV/bin/python benchmarks/tunix_peer.py --checkpoint DIR --prompts P.npy \
        --new-tokens 128 --out tunix.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as tunix_sampler
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params

TUNIX_ROPE_THETA = 1_000_000  # the base Tunix's Qwen3 rotates with


class IdTokenizer:
    """Prompts travel as space-separated token ids, so both sides decode the same ids."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0  # falsy: Tunix prepends no BOS

    def eos_id(self) -> int:
        return -1  # no id is negative: no row stops early

    def pad_id(self) -> int:
        return 0


def model_config(hf: dict) -> qwen3_model.ModelConfig:
    # transformers 5 writes rope_theta under rope_parameters; older configs keep it on top.
    theta = hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta"))
    if theta != TUNIX_ROPE_THETA:
        # Tunix 0.1.7's Qwen3 attention calls apply_rope with its default base and never
        # reads ModelConfig.rope_theta, so it would decode another function.
        raise SystemExit(
            f"config.json rope_theta is {theta}; Tunix's Qwen3 always rotates with"
            f" {TUNIX_ROPE_THETA:,}, so it cannot run this checkpoint as transformers does"
        )
    return qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(theta),
        norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf.get("tie_word_embeddings", False),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompts", required=True, help=".npy of int token ids [batch, length]")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        hf = json.load(f)
    cfg = model_config(hf)
    model = qwen3_params.create_model_from_safe_tensors(args.checkpoint, cfg)
    prompts = np.load(args.prompts)
    batch, length = prompts.shape
    cache = tunix_sampler.CacheConfig(
        cache_size=length + args.new_tokens,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    sampler = tunix_sampler.Sampler(model, IdTokenizer(), cache)
    texts = [" ".join(map(str, row)) for row in prompts]

    def run():
        out = sampler(
            texts,
            max_generation_steps=args.new_tokens,
            max_prompt_length=length,
            temperature=0.0,
            eos_tokens=[-1],
            pad_output=True,
        )
        return np.asarray(out.tokens)[:, : args.new_tokens]

    tokens = run()  # compile
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    best = min(times)
    with open(args.out, "w") as f:
        json.dump(
            {
                "tokens_per_s": batch * args.new_tokens / best,
                "seconds": best,
                "tokens": tokens.tolist(),
            },
            f,
        )


if __name__ == "__main__":
    main()
