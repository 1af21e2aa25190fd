"""Packed-trajectory GRPO step vs the one-row-per-message formulation, measured in one run;
and the packed step with the decoder's query-blocked attention vs one block (whole score matrix).

Both formulations go through the same jitted GRPO step with the same optimizer and train the
same objective (same advantages, message-mean loss); the script prints their losses side by
side as a check. The row formulation re-encodes every message's prefix, so the tokens the
model must process grow quadratically with the number of turns.

MFU = the step's model FLOPs (counted analytically: projections, the query-key pairs the
attention computes, LM head; backward = 2 x forward) per second, over this machine's measured
float32 matmul throughput. (XLA's cost analysis counts a scanned layer once, so it is not used.)

  python benchmarks/train_step.py                 # demo-size policy, 4-turn trajectories
  python benchmarks/train_step.py --turns 8 --repeats 5 --json train-step.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np
from flax import nnx

from envace_jax.models.config import ModelConfig, get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.models.primitives import query_blocks
from envace_jax.rl import steps, synthetic
from envace_jax.rl.batch import TrajectoryBatch, pad, validate
from envace_jax.rl.config import GRPOConfig
from envace_jax.rl.optim import OptimConfig, make_optimizer


def attention_pairs(length: int, query_block: int) -> int:
    """Query-key pairs the cache-less attention computes per row."""
    return sum((end - start) * end for start, end in query_blocks(length, query_block))


def forward_flops(cfg: ModelConfig, rows: int, length: int) -> float:
    """Matmul FLOPs of one forward pass over [rows, length] tokens."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = cfg.num_layers * 2 * (e * (hd + 2 * kd) + hd * e + 3 * e * f) + 2 * e * v
    pairs = attention_pairs(length, cfg.query_block)
    attention = cfg.num_layers * 2 * 2 * pairs * hd  # QK^T and PV, per row
    return rows * (length * per_token + attention)


def step_flops(cfg: ModelConfig, rows: int, length: int) -> float:
    """Model FLOPs of one train step over [rows, length] tokens: forward + backward (2x)."""
    return 3 * forward_flops(cfg, rows, length)


def matmul_peak(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best observed matmul FLOP/s in `dtype` (float32 by default) on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fewest_micro_batches(rows: int, micro_rows: int) -> int:
    """The fewest equal micro-batches of at most `micro_rows` rows that `rows` divides into."""
    return next(n for n in range(-(-rows // micro_rows), rows + 1) if rows % n == 0)


def time_grpo_steps(models, batches, micro, repeats, tx=None):
    """Median seconds per GRPO step and the first step's metrics, by name: `models[name]`
    trains on `batches[name]` in `micro[name]` micro-batches, from the same initial parameters
    (`models`' first), compile excluded. Steps run interleaved, so background load hits all
    alike."""
    tx = tx or make_optimizer(OptimConfig())
    params = nnx.state(next(iter(models.values())), nnx.Param)
    step = {
        n: steps.make_grpo_step(models[n], tx, GRPOConfig(micro_batches=micro[n])) for n in batches
    }
    states: dict[str, steps.TrainState] = {}
    first: dict[str, dict] = {}
    for name, batch in batches.items():  # compile and warm up
        states[name] = steps.init_train_state(params, tx)
        states[name], m = step[name](states[name], batch)
        first[name] = {k: float(v) for k, v in m.items()}
    times = {name: [] for name in batches}
    for _ in range(repeats):
        for name, batch in batches.items():
            t0 = time.perf_counter()
            states[name], m = step[name](states[name], batch)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, first


def print_table(models, batches, micro, times, first, peak) -> dict:
    """One line per formulation (see `time_grpo_steps`' arguments); returns the JSON figures."""
    cols = (
        "rows x T",
        "micro",
        "real tok",
        "padded tok",
        "step s",
        "GFLOP",
        "MFU",
        "loss",
        "grad norm",
    )
    print(f"{'':>8}" + "".join(f"{c:>12}" for c in cols))
    figures = {}
    for name, batch in batches.items():
        b, t = batch.shape
        sec = times[name]
        flops = step_flops(models[name].cfg, b, t)
        figures[name] = {"step_s": sec, "mfu": flops / sec / peak, "loss": first[name]["loss"]}
        values = (
            f"{b} x {t}",
            micro[name],
            int(np.asarray(batch.lengths).sum()),
            b * t,
            f"{sec:.3f}",
            f"{flops / 1e9:.1f}",
            f"{flops / sec / peak:.1%}",
            f"{first[name]['loss']:.3e}",
            f"{first[name]['grad_norm']:.5e}",
        )
        print(f"{name:>8}" + "".join(f"{v:>12}" for v in values))
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="demo-qwen3")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256, help="system + tools + user tokens")
    ap.add_argument("--act-len", type=int, default=40)
    ap.add_argument("--rehearse-len", type=int, default=48)
    ap.add_argument("--glue-len", type=int, default=8, help="chat-template tokens per switch")
    ap.add_argument("--micro-rows", type=int, default=8, help="rows per micro-batch at most")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()

    mcfg = get_preset(args.preset)
    model = Decoder(mcfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    packed = synthetic.multi_turn_batch(
        rng,
        batch_size=args.trajectories,
        group_size=args.group_size,
        turns=args.turns,
        prompt_len=args.prompt_len,
        act_len=args.act_len,
        rehearse_len=args.rehearse_len,
        glue_len=args.glue_len,
        vocab_size=mcfg.vocab_size,
    )
    rows = synthetic.message_rows(packed)
    # Static shapes padded to a multiple of 128, as the trainer's buckets would.
    packed = pad(packed, seq_len=round_up(packed.shape[1], 128))
    rows = pad(rows, seq_len=packed.shape[1])
    validate(packed)
    validate(rows)

    # The same parameters with attention in one block (the whole T x T score matrix).
    whole = Decoder(mcfg.replace(query_block=packed.shape[1]), rngs=nnx.Rngs(0))
    models = {"packed": model, "rows": model, "1 block": whole}
    batches: dict[str, TrajectoryBatch] = {"packed": packed, "rows": rows, "1 block": packed}
    # Both accumulate over micro-batches of at most --micro-rows rows, so they run at the same
    # peak activation memory (the row batch would not fit at once).
    micro = {n: fewest_micro_batches(b.shape[0], args.micro_rows) for n, b in batches.items()}
    times, first = time_grpo_steps(models, batches, micro, args.repeats)
    peak = matmul_peak()

    print(
        f"policy {args.preset}: {mcfg.num_params / 1e6:.2f}M params; {args.trajectories} "
        f"trajectories of {args.turns} turns ({args.turns * 2 + 1} generated messages each)"
    )
    print(f"matmul peak (float32, {jax.devices()[0].platform}): {peak / 1e9:.1f} GFLOP/s")
    figures = print_table(models, batches, micro, times, first, peak)
    tp, tr = times["packed"], times["rows"]
    real_p = int(np.asarray(packed.lengths).sum())
    real_r = int(np.asarray(rows.lengths).sum())
    print(
        f"packed vs rows: {tr / tp:.2f}x faster; {real_r / real_p:.2f}x fewer real tokens, "
        f"{rows.shape[0] * rows.shape[1] / (packed.shape[0] * packed.shape[1]):.2f}x fewer "
        "padded tokens"
    )
    tw = times["1 block"]
    print(
        f"query blocks of {mcfg.query_block} vs one block of {packed.shape[1]}: "
        f"{tw / tp:.2f}x faster (the table's loss and grad norm columns should agree)"
    )
    if args.json:
        ratios = {"packed_over_rows": tr / tp, "query_blocks_over_one_block": tw / tp}
        machine.write_json(args.json, {"preset": args.preset, **ratios, "steps": figures}, indent=1)


if __name__ == "__main__":
    main()
