"""Structured output's decode cost: grammar-masked decoding versus unconstrained decoding,
side by side in one run, on the same model, the same batch and the same prompts.

The serving engine (`serve.batcher.Engine`, as `python -m envace_jax.serve` builds it) decodes
B rows of `--new-tokens` tokens each, three ways, each timed `--repeats` times after an untimed
run that compiles its programs:

1. unconstrained: the engine's ordinary path, `--chunk-steps` tokens per host round-trip;
2. unconstrained, one token per round-trip (chunk_steps = 1): the round-trip alone, no mask;
3. constrained: every row under a JSON-schema grammar (`serve.structured`, llguidance), one
   token per round-trip, the packed mask an input of the compiled step.

Every row decodes exactly `--new-tokens` tokens in every configuration: the engine's end token
is one the model cannot sample, and the schema (an array of at least 1,000 of the LLM judge's
verdict objects) cannot be complete sooner, so the three differ only in the cost of a step.
The configurations run round-robin (`--repeats` rounds: the machine's load drifts between
minutes, not within a round). Printed: the best tokens/s of each, the median over rounds of
the ratios constrained / unconstrained and one-token / unconstrained, and the host's mask
time per constrained token (from the engine's counters).

With `--libraries`, the grammar libraries are compared first on random walks (each token drawn
uniformly among those the mask allows, the end token half the time it is allowed), checking
every finished reply with `jsonschema`: llguidance always, xgrammar when it is importable
(`pip install xgrammar`; it is not a dependency of the project). The figures chose the library
(`serve.structured`'s docstring).

    python benchmarks/structured_output.py [--batch 16] [--new-tokens 64] [--json out.json]
    python benchmarks/structured_output.py --libraries --walks 100

Without --model the shipped demo policy (`demo-base`) is served with the demo tokenizer.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import random
import statistics
import threading
import time

import machine
import numpy as np

from envace_jax.models.shipped import DEMO_BASE_DIR
from envace_jax.rewards.llm_judge import VERDICT_SCHEMA
from envace_jax.text.tokenizer import load_tokenizer

NESTED = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error", "pending"]},
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["a", "b", "c"]},
                    "maxItems": 3,
                },
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 30},
    },
    "required": ["status", "user", "active"],
    "additionalProperties": False,
}


def bounded_verdict(max_length: int = 40) -> dict:
    """The judge's verdict schema with every string at most `max_length` characters."""
    schema = copy.deepcopy(VERDICT_SCHEMA)
    for prop in schema["properties"].values():
        if prop.get("type") == "string":
            prop["maxLength"] = max_length
    return schema


# A grammar no row completes within the run: every row decodes all of its tokens.
ENDLESS = {"type": "array", "items": VERDICT_SCHEMA, "minItems": 1000}


# ----------------------------------------------------------------------------- engine timing


def build_engine(model_dir: str, tokenizer_name: str, batch: int, chunk_steps: int):
    """The engine as the server builds it, but with an end token no row can sample."""
    from envace_jax.models.hf_io import load_hf_model
    from envace_jax.sampling.loop import TurnSpec
    from envace_jax.serve.batcher import Engine
    from envace_jax.text.serving_template import serving_template

    tokenizer = load_tokenizer(tokenizer_name)
    template = serving_template(tokenizer)
    model, cfg = load_hf_model(model_dir)
    spec = TurnSpec(
        end_id=cfg.vocab_size,  # outside the vocabulary: never sampled
        tool_call_id=template.tool_call_id,
        mode="generate",
        max_message_tokens=1 << 30,
    )
    pad = tokenizer.pad_token_id
    engine = Engine(
        model,
        spec,
        pad_id=template.stop_id if pad is None else pad,
        max_batch=batch,
        row_buckets=(batch,),
        chunk_steps=chunk_steps,
    )
    return engine, tokenizer, template, cfg


def timed_run(engine, prompts, new_tokens: int, grammar=None) -> tuple[float, int]:
    """(seconds, tokens) for every prompt decoded at once to `new_tokens` tokens."""
    from envace_jax.sampling.distributions import SamplingParams
    from envace_jax.serve.batcher import Done, Sequence

    left = threading.Semaphore(0)
    counts = []

    def on_event(ev):
        if isinstance(ev, Done):
            counts.append(ev.num_generated)
            left.release()

    start = time.perf_counter()
    for p in prompts:
        seq = Sequence(tuple(p), new_tokens, SamplingParams(temperature=1.0), on_event)
        if grammar is not None:
            seq.grammar = grammar.new()
        engine.submit(seq)
    for _ in prompts:
        left.acquire()
    return time.perf_counter() - start, sum(counts)


def decode_cost(args) -> dict:
    from envace_jax.serve.structured import StructuredOutput
    from envace_jax.text.chat import encode, render_text

    chunked, tokenizer, template, cfg = build_engine(
        args.model, args.tokenizer, args.batch, args.chunk_steps
    )
    single = build_engine(args.model, args.tokenizer, args.batch, 1)[0]
    grammar = StructuredOutput(tokenizer, cfg.vocab_size, template.stop_id).compile_schema(
        ENDLESS, "schema"
    )
    runs = {  # name: (engine, grammar)
        "unconstrained": (chunked, None),
        "one_token_per_call": (single, None),
        "constrained": (chunked, grammar),
    }
    prompts = [
        encode(
            tokenizer,
            render_text(
                tokenizer,
                [{"role": "user", "content": f"Judge step {i}: was order {1000 + i} found?"}],
                add_generation_prompt=True,
            ),
        )
        for i in range(args.batch)
    ]
    times = {name: [] for name in runs}
    counters = ("masks", "mask_us", "chunks")
    masked = collections.Counter()  # the engine's counters over the constrained runs
    chunked.start(), single.start()
    try:
        for eng, g in runs.values():
            timed_run(eng, prompts, args.new_tokens, g)  # compiles its programs
        # Round-robin: the machine's load drifts between minutes, not within one round.
        for _ in range(args.repeats):
            for name, (eng, g) in runs.items():
                before = {k: eng.stats[k] for k in counters}
                secs, tokens = timed_run(eng, prompts, args.new_tokens, g)
                assert tokens == args.batch * args.new_tokens, (name, tokens)
                times[name].append(secs)
                if g is not None:
                    masked.update({k: eng.stats[k] - before[k] for k in counters})
        mask_us = masked["mask_us"] / max(masked["masks"], 1)
    finally:
        chunked.stop(), single.stop()
    tokens = args.batch * args.new_tokens
    out = {
        name: {"tok_per_s": tokens / min(ts), "seconds": ts, "round_trips": None}
        for name, ts in times.items()
    }
    out["constrained"]["mask_us_per_token"] = mask_us
    for name in runs:
        out[name]["round_trips"] = 1 + -(-(args.new_tokens - 1) // args.chunk_steps)
    out["one_token_per_call"]["round_trips"] = out["constrained"]["round_trips"] = args.new_tokens

    def ratio(name):
        per_round = [b / a for a, b in zip(times[name], times["unconstrained"], strict=True)]
        return statistics.median(per_round), per_round

    out["constrained_over_unconstrained"], out["constrained_over_unconstrained_rounds"] = ratio(
        "constrained"
    )
    out["one_token_over_unconstrained"], _ = ratio("one_token_per_call")
    print(f"\nbatch {args.batch}, {args.new_tokens} new tokens a row, best of {args.repeats}:")
    print(f"{'':>20} {'tok/s':>9} {'round-trips':>12}")
    for name in runs:
        r = out[name]
        print(f"{name:>20} {r['tok_per_s']:>9.1f} {r['round_trips']:>12}")
    rounds = out["constrained_over_unconstrained_rounds"]
    print(
        f"constrained / unconstrained tokens/s: {out['constrained_over_unconstrained']:.2f}x "
        f"(median of {len(rounds)} rounds, range {min(rounds):.2f}-{max(rounds):.2f}); "
        f"one token per call / unconstrained: {out['one_token_over_unconstrained']:.2f}x; "
        f"host mask time {mask_us:.1f} us per constrained token"
    )
    return out


# ----------------------------------------------------------------------------- libraries


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = (words[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab].astype(bool)


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab, end):
        from envace_jax.serve.structured import StructuredOutput

        self.so = StructuredOutput(tokenizer, vocab, end)
        self.so.ll_tokenizer()
        self.buf = np.zeros(self.so.words, np.int32)

    def compile(self, schema):
        return self.so.compile_schema(schema, "schema")

    def new(self, compiled):
        return compiled.new()

    def mask(self, m):
        m.fill_mask(self.buf)
        return self.buf

    def accept(self, m, t):
        return m.advance([t]) is None


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab, end):
        import xgrammar

        self.x = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[end]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.buf = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def new(self, compiled):
        return self.x.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.buf)
        return self.buf[0].numpy()

    def accept(self, m, t):
        return m.accept_token(t)


def random_walks(lib, tokenizer, vocab, end, walks: int, max_tokens: int = 400) -> dict:
    import jsonschema

    out = {}
    schemas = {"verdict_bounded": bounded_verdict(), "nested_enum": NESTED}
    for sname, schema in schemas.items():
        rng = random.Random(0)
        t = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms = (time.perf_counter() - t) * 1e3
        mask_s = accept_s = 0.0
        tokens = valid = invalid = incomplete = dead = 0
        for _ in range(walks):
            m, ids = lib.new(compiled), []
            for _ in range(max_tokens):
                t = time.perf_counter()
                allowed = np.flatnonzero(_unpack(lib.mask(m), vocab))
                mask_s += time.perf_counter() - t
                if not len(allowed):
                    dead += 1
                    break
                if end in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                    break
                tok = int(rng.choice([a for a in allowed if a != end]))
                t = time.perf_counter()
                ok = lib.accept(m, tok)
                accept_s += time.perf_counter() - t
                tokens += 1
                if not ok:
                    dead += 1
                    break
                ids.append(tok)
            else:
                incomplete += 1
                continue
            try:
                jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
        out[sname] = {
            "valid": valid,
            "invalid": invalid,
            "incomplete": incomplete,
            "dead_ends": dead,
            "mask_us_per_token": mask_s / max(tokens, 1) * 1e6,
            "consume_us_per_token": accept_s / max(tokens, 1) * 1e6,
            "compile_ms": compile_ms,
        }
    return out


def libraries(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    with open(f"{args.model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    libs = [_Llguidance]
    try:
        import xgrammar  # noqa: F401

        libs.append(_Xgrammar)
    except ImportError:
        print("xgrammar is not installed: only llguidance is measured")
    out = {}
    print(f"\nrandom walks ({args.walks} per schema), V = {vocab}:")
    head = ("library", "schema", "valid", "invalid", "mask us", "consume us")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (11, 16, 6, 8, 8, 11), strict=True)))
    for cls in libs:
        lib = cls(tokenizer, vocab, end)
        out[lib.name] = random_walks(lib, tokenizer, vocab, end, args.walks)
        for sname, r in out[lib.name].items():
            print(
                f"{lib.name:>11} {sname:>16} {r['valid']:>6} {r['invalid']:>8} "
                f"{r['mask_us_per_token']:>8.1f} {r['consume_us_per_token']:>11.1f}"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=DEMO_BASE_DIR, help="HF model dir (default: demo-base)")
    ap.add_argument("--tokenizer", default="demo", help="tokenizer directory or 'demo'")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=16, help="the server's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--libraries", action="store_true", help="also compare grammar libraries")
    ap.add_argument("--walks", type=int, default=100, help="random walks per schema")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()

    out = {"model": args.model, "batch": args.batch, "new_tokens": args.new_tokens}
    if args.libraries:
        out["libraries"] = libraries(args)
    out.update(decode_cost(args))
    if args.json:
        machine.write_json(args.json, out, indent=2)


if __name__ == "__main__":
    main()
