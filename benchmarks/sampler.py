"""Sampler speed, measured side by side in one run on the same tiny Qwen3 checkpoint.

1. Plain greedy generation (batch 32, prompt 64, 128 new tokens): our compiled sampler versus
   transformers' PyTorch `generate` on the same weights. Target: >= 3x tokens/s.
2. World rehearsal: trajectories/s with role switching inside the compiled loop versus a host
   loop that returns to Python at every role switch and re-prefills the whole history (what a
   re-encode-every-turn rollout does). Both follow the same scripted demo conversations, forced
   through the real model's logits, so they decode identical tokens. Target: >= 2x.
3. The same rehearsals: the decode loop's growing attention windows versus attending over the
   whole buffer at every step. Target: >= 1.5x.

    python benchmarks/sampler.py [--batch 32] [--repeats 3]

With `--model DIR` (an HF checkpoint, e.g. `make smollm2`'s workdir/smollm2) only the first
comparison runs, at a real size: prompts of 256 tokens, 128 new tokens, batch 1, 8 and 32. For
each batch it also prints the fraction of the memory-bandwidth roofline our decode reaches:
the bytes one decode step must read (every weight, plus the live KV cache at the mean
context), times decode steps per second (prefill timed apart and taken out), over the
bandwidth of a large array copy measured on the spot.

    python benchmarks/sampler.py --model workdir/smollm2 --json sampler-smollm2.json

Prints a table and the ratios; compile time is excluded (one warm-up call each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np
from flax import nnx

from envace_jax.models.decoder import CausalLM
from envace_jax.models.hf_io import load_hf_model
from envace_jax.sampling import loop
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler, pad_rows
from envace_jax.text.codes import Status
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.text.trajectory import encode_conversation


def make_checkpoint(out_dir: str, vocab: int) -> None:
    """A tiny random Qwen3 saved by transformers (the 'checkpoint' both sides load)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        # Qwen3's own base; Tunix 0.1.7's Qwen3 applies this one whatever its config says.
        rope_theta=1e6,
    )
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out_dir)


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def random_prompts(batch, prompt_len, vocab):
    """The prompts every side decodes: token ids drawn past the special ids, seed 0."""
    return np.random.default_rng(0).integers(20, vocab, size=(batch, prompt_len))


def our_generate(model, batch, prompt_len):
    """ours(n): our compiled greedy generation of n new tokens for `random_prompts`, returning
    the new tokens [batch, n]."""
    prompts = random_prompts(batch, prompt_len, model.cfg.vocab_size)
    # No stop id can end rows early: every row decodes exactly the asked tokens.
    spec = loop.TurnSpec(end_id=-1, tool_call_id=-1, mode="generate", max_message_tokens=10**6)
    sampler = Sampler(model, spec, pad_id=0)
    greedy = SamplingParams(greedy=True)

    def ours(n):
        out = sampler.start(
            prompts.tolist(), key=jax.random.key(0), sampling=greedy, max_new_tokens=n
        )
        return np.asarray(jax.block_until_ready(out.tokens))[:, prompt_len : prompt_len + n]

    return ours


def time_decode(ours, batch, new_tokens, repeats):
    """(tokens/s, decode steps/s with prefill taken out, the new tokens [batch, n]) of
    `our_generate`'s `ours`, compile excluded (one warm-up call each)."""
    mine = ours(new_tokens)
    ours(1)
    t_ours = best_of(lambda: ours(new_tokens), repeats)
    t_prefill = best_of(lambda: ours(1), repeats)
    steps_per_s = (new_tokens - 1) / max(t_ours - t_prefill, 1e-9)
    return batch * new_tokens / t_ours, steps_per_s, mine


def hf_generate(ckpt, batch, prompt_len, vocab):
    """theirs(n): transformers' PyTorch greedy `generate` of n new tokens for the same prompts
    as `our_generate`, from the same checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.as_tensor(random_prompts(batch, prompt_len, vocab))

    def theirs(n):
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, prompt_len:].numpy()

    return theirs


def bench_generate(ckpt, model, batch, prompt_len, new_tokens, repeats):
    """(our tokens/s, transformers tokens/s, share of identical greedy tokens, our decode steps
    per second with prefill taken out, our new tokens)."""
    ours, steps_per_s, mine = time_decode(
        our_generate(model, batch, prompt_len), batch, new_tokens, repeats
    )
    theirs = hf_generate(ckpt, batch, prompt_len, model.cfg.vocab_size)
    hf_tokens = theirs(new_tokens)  # warm up
    t_hf = best_of(lambda: theirs(new_tokens), repeats)
    n = batch * new_tokens
    return ours, n / t_hf, float((hf_tokens == mine).mean()), steps_per_s, mine


def bench_tunix(python, ckpt, prompts, new_tokens, repeats):
    """Tunix's sampler on the same checkpoint and prompts, run by `python` (a venv with
    google-tunix) through `tunix_peer.py`: (tokens/s, its new tokens)."""
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_peer.py")
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, out = os.path.join(tmp, "prompts.npy"), os.path.join(tmp, "tunix.json")
        np.save(prompts_file, prompts)
        cmd = [python, peer, "--checkpoint", ckpt, "--prompts", prompts_file]
        cmd += ["--new-tokens", str(new_tokens), "--repeats", str(repeats), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"tunix_peer.py failed under {python}:\n{done.stderr[-2000:]}")
        with open(out) as f:
            got = json.load(f)
    return got["tokens_per_s"], np.asarray(got["tokens"])


def decode_step_bytes(cfg, batch: int, context: float, weight_bytes: int) -> float:
    """Bytes one decode step reads: every weight once, and each row's keys and values."""
    kv = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * jnp.dtype(cfg.dtype).itemsize
    return weight_bytes + batch * context * kv


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (what every decode step reads once)."""
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def roofline_fraction(cfg, weights, batch, prompt_len, new_tokens, steps_per_s, bandwidth):
    """Share of `bandwidth` that `steps_per_s` decode steps reach, each reading `weights` bytes
    and every row's keys and values at the mean context."""
    step_bytes = decode_step_bytes(cfg, batch, prompt_len + new_tokens / 2, weights)
    return step_bytes * steps_per_s / bandwidth


def bench_real_model(path, batches, prompt_len, new_tokens, repeats):
    model, cfg = load_hf_model(path)
    weights = weight_bytes(model)
    print(f"{path}: {cfg.num_params / 1e6:.1f}M params, {weights / 2**20:.0f} MiB weights")
    bandwidth = machine.copy_bandwidth(512)
    print(f"array copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for batch in batches:
        ours, hf, agree, steps, _ = bench_generate(
            path, model, batch, prompt_len, new_tokens, repeats
        )
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": ours,
                "hf_tokens_per_s": hf,
                "ratio": ours / hf,
                "greedy_tokens_identical": agree,
                "decode_steps_per_s": steps,
                "roofline_fraction": roofline_fraction(
                    cfg, weights, batch, prompt_len, new_tokens, steps, bandwidth
                ),
            }
        )
    print(f"\nprompt {prompt_len}, {new_tokens} new tokens, greedy")
    head = ("batch", "ours tok/s", "hf tok/s", "ratio", "identical", "steps/s", "roofline")
    print(" ".join(f"{h:>11}" for h in head))
    for r in rows:
        print(" ".join(f"{v:>11.3f}" if isinstance(v, float) else f"{v:>11}" for v in r.values()))
    return {"model": path, "bandwidth_bytes_per_s": bandwidth, "rows": rows}


class ForcedModel(CausalLM):
    """The real decoder's forward (full cost), then the script's next token made certain."""

    def __init__(self, model, script):
        self.inner = model
        self.cfg = model.cfg
        self.script = nnx.Variable(jnp.asarray(script, jnp.int32))

    def init_cache(self, batch, max_len):
        return self.inner.init_cache(batch, max_len)

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        logits, cache = self.inner(
            tokens, positions, attention_mask=attention_mask, cache=cache, kv_window=kv_window
        )
        script = self.script[...]
        nxt = jnp.take_along_axis(script, jnp.minimum(positions + 1, script.shape[1] - 1), 1)
        return logits + jax.nn.one_hot(nxt, logits.shape[-1]) * 1e4, cache


def demo_conversations(tok, n):
    from envace_jax.envs.demo import generate_tasks, oracle_messages

    tasks = generate_tasks(0, n, split="train")
    return [(oracle_messages(t), t.tools) for t in tasks]


def scripted_rehearsal(model, batch):
    """The demo conversations forced through `model`: (forced model, reference encodings,
    prompts up to each first ACT token, buffer length T)."""
    tok = load_tokenizer("demo")
    convs = demo_conversations(tok, batch)
    refs = [encode_conversation(tok, m, tools) for m, tools in convs]
    n_prompt = [int(np.flatnonzero(r.roles)[0]) for r in refs]
    width = max(len(r.ids) for r in refs) + 8
    script = np.zeros((batch, width), np.int32)
    for b, r in enumerate(refs):
        script[b, : len(r.ids)] = r.ids
    T = 1 << int(np.ceil(np.log2(width + 1)))
    prompts = [r.ids[:n].tolist() for r, n in zip(refs, n_prompt, strict=True)]
    return ForcedModel(model, script), refs, prompts, T


def bench_rehearsal(model, batch, repeats):
    tok = load_tokenizer("demo")
    forced, refs, prompts, T = scripted_rehearsal(model, batch)
    greedy = SamplingParams(greedy=True)
    # The forced model reads its script by row, so every call keeps the whole batch.
    in_loop = Sampler(
        forced, turn_spec(tok, mode="rehearse", max_turns=16), pad_id=0, compact_rows=False
    )

    def ours():
        state = in_loop.start(
            prompts, key=jax.random.key(0), sampling=greedy, max_new_tokens=T, max_len=T
        )
        jax.block_until_ready(state.tokens)
        return state

    state = ours()
    t_ours = best_of(ours, repeats)
    lengths = np.asarray(state.length)
    assert (np.asarray(state.status) == Status.FINISHED).all(), np.asarray(state.status)

    # Host loop: every message is its own generate call; glue is appended on the host and the
    # whole history is prefilled again for the next message.
    per_message = Sampler(
        forced, turn_spec(tok, mode="generate", max_turns=16), pad_id=0, compact_rows=False
    )
    boundaries = [_message_bounds(r) for r in refs]

    def host_loop():
        histories = [list(p) for p in prompts]
        step = 0
        while True:
            rows = [b for b in range(batch) if step < len(boundaries[b])]
            if not rows:
                break
            # Rows whose conversation is over ride along with a 1-token budget.
            budgets = [T if step < len(boundaries[b]) else 1 for b in range(batch)]
            state = per_message.start(
                histories,
                key=jax.random.key(step),
                sampling=greedy,
                max_new_tokens=budgets,
                max_len=T,
            )
            toks, lens = np.asarray(state.tokens), np.asarray(state.length)
            for b in range(batch):
                if step < len(boundaries[b]):
                    start, end, glue_end = boundaries[b][step]
                    assert lens[b] == end, (b, step, lens[b], end)
                    histories[b] = toks[b, :end].tolist() + refs[b].ids[end:glue_end].tolist()
            step += 1
        return histories

    host_loop()
    t_host = best_of(host_loop, repeats)
    return batch / t_ours, batch / t_host, int(lengths.mean()), sum(map(len, boundaries)) / batch


def bench_windows(model, batch, repeats):
    """The same world rehearsals decoded in phases of growing attention windows (the loop's
    default) and attending over the whole buffer at every step."""
    tok = load_tokenizer("demo")
    forced, _, prompts, T = scripted_rehearsal(model, batch)
    graphdef, params = nnx.split(forced)
    spec = turn_spec(tok, mode="rehearse", max_turns=16)
    init = jax.jit(loop.init_state, static_argnums=0, static_argnames=("spec", "max_len"))
    decode = jax.jit(loop.decode, static_argnums=0, static_argnames=("spec", "sampling", "windows"))
    P = max(len(p) for p in prompts)
    runs = {}
    for windows in (None, (T,)):

        def run(windows=windows):
            state = init(
                graphdef,
                params,
                jnp.asarray(pad_rows(prompts, P, 0)),
                jnp.asarray([len(p) for p in prompts], jnp.int32),
                key=jax.random.key(0),
                spec=spec,
                max_len=T,
                max_new_tokens=T,
            )
            state = decode(
                graphdef,
                params,
                state,
                spec=spec,
                sampling=SamplingParams(greedy=True),
                max_steps=T,
                windows=windows,
            )
            return np.asarray(state.tokens)

        tokens = run()  # compile
        runs[windows] = (best_of(run, repeats), tokens)
    (t_phased, a), (t_whole, b) = runs[None], runs[(T,)]
    return batch / t_phased, batch / t_whole, T, float((a == b).mean())


def _message_bounds(ref):
    """(start, end, end of the glue after it) of each generated message of a reference."""
    out = []
    segs = ref.segments
    for s in range(1, int(segs.max()) + 1):
        idx = np.flatnonzero(segs == s)
        nxt = np.flatnonzero(segs > s)
        glue_end = int(nxt[0]) if len(nxt) else int(idx[-1]) + 1
        out.append((int(idx[0]), int(idx[-1]) + 1, glue_end))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=None, help="default: 64, 256 with --model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument("--model", help="an HF checkpoint directory: greedy decoding at its size")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes with --model")
    ap.add_argument(
        "--tunix-python",
        help="the python of a venv with google-tunix: also time Tunix's sampler (tiny model)",
    )
    args = ap.parse_args()
    if args.model:
        batches = [int(b) for b in args.batches.split(",")]
        prompt = args.prompt or 256
        out = bench_real_model(args.model, batches, prompt, args.new_tokens, args.repeats)
        if args.json:
            machine.write_json(args.json, out, indent=1)
        return

    tok = load_tokenizer("demo")
    with tempfile.TemporaryDirectory() as ckpt:
        make_checkpoint(ckpt, len(tok))
        model, cfg = load_hf_model(ckpt)
        print(f"tiny Qwen3: {cfg.num_params / 1e6:.2f}M params, backend {jax.default_backend()}")
        prompt = args.prompt or 64
        ours, hf, agree, _, mine = bench_generate(
            ckpt, model, args.batch, prompt, args.new_tokens, args.repeats
        )
        tunix = {}
        if args.tunix_python:
            prompts = random_prompts(args.batch, prompt, cfg.vocab_size)
            rate, theirs = bench_tunix(
                args.tunix_python, ckpt, prompts, args.new_tokens, args.repeats
            )
            tunix = {
                "tunix_tokens_per_s": rate,
                "tunix_ratio": ours / rate,
                "tunix_tokens_identical": float((theirs == mine).mean()),
            }
    traj_ours, traj_host, mean_len, messages = bench_rehearsal(model, args.batch, args.repeats)
    phased, whole, buffer, same = bench_windows(model, args.batch, args.repeats)
    rows = [
        ("greedy generate, tokens/s (ours)", ours),
        ("greedy generate, tokens/s (transformers)", hf),
        ("  ratio (target >= 3x)", ours / hf),
        ("  greedy tokens identical", agree),
    ]
    if tunix:
        rows += [
            ("greedy generate, tokens/s (Tunix sampler)", tunix["tunix_tokens_per_s"]),
            ("  ratio over Tunix (target >= 1x)", tunix["tunix_ratio"]),
            ("  greedy tokens identical to Tunix's", tunix["tunix_tokens_identical"]),
        ]
    rows += [
        ("world rehearsal, trajectories/s (in-loop switching)", traj_ours),
        ("world rehearsal, trajectories/s (host loop + re-prefill)", traj_host),
        ("  ratio (target >= 2x)", traj_ours / traj_host),
        ("  mean trajectory tokens / generated messages", f"{mean_len} / {messages:.1f}"),
        (f"world rehearsal, buffer {buffer}: trajectories/s (growing windows)", phased),
        (f"world rehearsal, buffer {buffer}: trajectories/s (whole buffer)", whole),
        ("  ratio (target >= 1.5x)", phased / whole),
        ("  tokens identical", same),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        shown = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")
    if args.json:
        machine.write_json(
            args.json,
            {
                "generate_tokens_per_s": ours,
                "hf_tokens_per_s": hf,
                "generate_ratio": ours / hf,
                "greedy_tokens_identical": agree,
                **tunix,
                "rehearsal_traj_per_s": traj_ours,
                "host_loop_traj_per_s": traj_host,
                "rehearsal_ratio": traj_ours / traj_host,
                "windowed_traj_per_s": phased,
                "whole_buffer_traj_per_s": whole,
                "window_ratio": phased / whole,
                "window_tokens_identical": same,
            },
        )


if __name__ == "__main__":
    main()
