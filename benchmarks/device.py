"""Accelerator figures in one run, for the day a GPU or TPU is lent to the project.

1. Decode: our compiled greedy generation of SmolLM2-135M (prompts of 256 random tokens, 128 new
   tokens) at batch 1, 8 and 64: tokens/s, decode steps/s (prefill timed apart and taken out)
   and the fraction of the HBM roofline they reach: the bytes one decode step must read (every
   weight, plus the live KV cache at the mean context) times decode steps/s, over the device's
   memory bandwidth, measured on the spot as `sampler.py` measures it on CPU: a large array
   rewritten on the device (`a + 1`), read + write bytes over the best time.
2. Train step: the jitted GRPO step on demo-like trajectories of a real length (64 rows of 1,024
   tokens in 8 micro-batches, the demo's RL update). MFU = the step's model FLOPs
   (`train_step.py`'s analytic count; backward = 2 x forward) per second over the device's peak
   bf16 FLOP/s, from `--peak-tflops` or a table of public spec sheets; for a kind the table
   does not hold, MFU is null and the JSON says why. Also the share of a matmul measured on
   the spot in the compute dtype.
3. With `--demo`: the demo job's wall time, `python -m envace_jax.main --config configs/demo.py
   --workdir DIR`, stopped by SIGINT after `--demo-timeout` seconds if given. It runs first,
   before this process touches the device (a TPU admits one process; on a GPU this process
   would hold most of the memory).

    make smollm2 && python benchmarks/device.py --model workdir/smollm2 --demo \\
        --json docs/device_<kind>.json
    python benchmarks/device.py --tiny --json F    # CPU smoke run: tiny random Qwen3

Weights and compute are bfloat16 for decoding on an accelerator (float32 on CPU, `--dtype`);
the train step keeps float32 parameters (RL) and computes in the same dtype. Library output
(Python logging and warnings, what XLA's C++ writes to stderr, the demo job's own lines) goes
to `--log` (default: beside the JSON, `.log` for `.json`); tracebacks and this script's lines
stay on the console. Compile time is excluded throughout (one warm-up call each).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import machine
import numpy as np
import sampler
import train_step
from flax import nnx

from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.models.hf_io import load_hf_model
from envace_jax.rl import synthetic
from envace_jax.rl.batch import pad, validate

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 TFLOP/s (no sparsity) from the vendors' public spec sheets, matched as lower-case
# substrings of `device_kind`, most specific first.
PEAK_BF16_TFLOPS = (
    ("h100 pcie", 756.0),  # NVIDIA H100 PCIe
    ("h100 nvl", 835.0),  # NVIDIA H100 NVL
    ("h100", 989.0),  # NVIDIA H100 SXM ('NVIDIA H100 80GB HBM3')
    ("h200", 989.0),  # NVIDIA H200 SXM (the H100's compute, more HBM)
    ("a100", 312.0),  # NVIDIA A100
    ("tpu v4", 275.0),  # Google Cloud TPU v4
    ("tpu v5 lite", 197.0),  # TPU v5e (its device_kind)
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),  # TPU v5p (its device_kind)
    ("tpu v6 lite", 918.0),  # TPU v6e, Trillium (its device_kind)
    ("tpu v6e", 918.0),
)

# Sizes: a real run, and the CPU smoke run (--tiny). Flags given on the command line win.
SIZES = {
    "full": {
        "batches": "1,8,64",
        "prompt": 256,
        "new_tokens": 128,
        "seq_len": 1024,
        "rows": 64,
        "micro_batches": 8,
        "repeats": 3,
        "copy_mb": 2048,
        "demo_config": "configs/demo.py",
    },
    "tiny": {
        "batches": "1,2",
        "prompt": 16,
        "new_tokens": 8,
        "seq_len": 128,
        "rows": 4,
        "micro_batches": 2,
        "repeats": 1,
        "copy_mb": 64,
        "demo_config": "configs/demo.py:smoke",
    },
}


def quiet_libraries(log_path: str) -> None:
    """Python logging and warnings, and whatever the libraries write to file descriptor 2
    (XLA's C++ lines), go to `log_path`; Python's own stderr (tracebacks) stays on the console."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    console = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(console, "w", buffering=1)
    logging.basicConfig(
        filename=log_path, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    logging.captureWarnings(True)


def device_info() -> dict:
    dev = jax.devices()[0]
    try:
        memory = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # not every backend has memory stats
        memory = None
    return {
        "kind": dev.device_kind,
        "platform": dev.platform,
        "count": jax.device_count(),
        "memory_bytes": memory,
    }


def device_copy_bandwidth(megabytes: int, repeats: int = 10) -> float:
    """Bytes/s of rewriting a large float32 array on the default device (`a + 1`: every byte
    read and written once), best of `repeats`: the bandwidth a decode step streams weights at."""
    a = jnp.ones(megabytes * 2**20 // 4, jnp.float32)
    bump = jax.jit(lambda x: x + 1)
    jax.block_until_ready(bump(a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(bump(a))
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def peak_flops(kind: str, given_tflops: float | None) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s or None, where it came from)."""
    if given_tflops:
        return given_tflops * 1e12, "--peak-tflops"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in kind.lower():
            return tflops * 1e12, f"public spec sheet, dense bf16 ('{key}' in the device kind)"
    return None, f"device kind {kind!r} is not in the spec-sheet table: pass --peak-tflops"


def load_model(args, **overrides):
    """(model, cfg, name): the checkpoint at --model, or with --tiny a random tiny Qwen3."""
    if args.tiny:
        cfg = get_preset("tiny-qwen3", **overrides)
        return Decoder(cfg, rngs=nnx.Rngs(0)), cfg, "tiny-qwen3 (random)"
    model, cfg = load_hf_model(args.model, **overrides)
    return model, cfg, args.model


def bench_decode(args, dtype: str, bandwidth: float) -> dict:
    model, cfg, name = load_model(args, param_dtype=dtype, dtype=dtype)
    weights = sampler.weight_bytes(model)
    print(
        f"decode, {name}: {cfg.num_params / 1e6:.1f}M params, {weights / 2**20:.0f} MiB "
        f"weights ({dtype}); prompt {args.prompt}, {args.new_tokens} new tokens, greedy"
    )
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ours = sampler.our_generate(model, batch, args.prompt)
        rate, steps, _ = sampler.time_decode(ours, batch, args.new_tokens, args.repeats)
        roofline = sampler.roofline_fraction(
            cfg, weights, batch, args.prompt, args.new_tokens, steps, bandwidth
        )
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": rate,
                "decode_steps_per_s": steps,
                "roofline_fraction": roofline,
            }
        )
        print(
            f"  batch {batch:>3}: {rate:,.1f} tokens/s, {steps:,.1f} decode steps/s, "
            f"{roofline:.3f} of the memory-bandwidth roofline"
        )
    return {
        "model": name,
        "params": cfg.num_params,
        "weight_bytes": weights,
        "prompt_len": args.prompt,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def train_batch(rows: int, seq_len: int, vocab: int, turns: int = 4):
    """Demo-like trajectories (`synthetic.multi_turn_batch`) that fill about `seq_len` tokens,
    padded to it: a prompt, `turns` x (ACT, REHEARSE) and a final ACT of ~seq_len/20 each."""
    n, glue = max(2, seq_len // 20), 4
    longest = (2 * turns + 1) * (math.ceil(1.25 * n) + 1) + 2 * turns * glue
    if seq_len - longest < 1:
        raise SystemExit(f"--seq-len {seq_len} is too short for {turns}-turn trajectories")
    batch = synthetic.multi_turn_batch(
        np.random.default_rng(0),
        batch_size=rows,
        group_size=math.gcd(rows, 8),
        turns=turns,
        prompt_len=seq_len - longest,
        act_len=n,
        rehearse_len=n,
        glue_len=glue,
        vocab_size=vocab,
    )
    batch = pad(batch, seq_len=seq_len)
    validate(batch)
    return batch


def bench_train(args, dtype: str, kind: str) -> dict:
    model, cfg, _ = load_model(args, param_dtype="float32", dtype=dtype)
    batch = train_batch(args.rows, args.seq_len, cfg.vocab_size)
    micro = {"grpo": args.micro_batches}
    times, first = train_step.time_grpo_steps({"grpo": model}, {"grpo": batch}, micro, args.repeats)
    sec = times["grpo"]
    flops = train_step.step_flops(cfg, args.rows, args.seq_len)
    peak, source = peak_flops(kind, args.peak_tflops)
    n = 256 if args.tiny else (2048 if jax.default_backend() == "cpu" else 8192)
    matmul = train_step.matmul_peak(n, dtype=jnp.dtype(dtype))
    mfu = flops / sec / peak if peak else None
    shown = f"MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s" if peak else f"MFU unknown ({source})"
    print(
        f"train step, GRPO, {args.rows} rows x {args.seq_len} tokens in {args.micro_batches} "
        f"micro-batches, {dtype} compute: {sec:.3f} s, {flops / sec / 1e12:.3f} TFLOP/s of model "
        f"FLOPs; {shown}; {flops / sec / matmul:.1%} of a {n}x{n} {dtype} matmul "
        f"({matmul / 1e12:.3f} TFLOP/s)"
    )
    return {
        "rows": args.rows,
        "seq_len": args.seq_len,
        "real_tokens": int(np.asarray(batch.lengths).sum()),
        "micro_batches": args.micro_batches,
        "compute_dtype": dtype,
        "step_s": sec,
        "model_flops": flops,
        "model_flops_per_s": flops / sec,
        "peak_flops_per_s": peak,
        "peak_source": source,
        "mfu": mfu,
        "matmul_flops_per_s": matmul,
        "fraction_of_matmul": flops / sec / matmul,
        "loss": first["grpo"]["loss"],
    }


def time_demo(config: str, workdir: str | None, timeout: float | None, log: str) -> dict:
    """Wall time of the demo job in a fresh process, its output appended to `log`; after
    `timeout` seconds it gets SIGINT (the job stops cleanly), then SIGKILL a minute later."""
    keep = workdir is not None
    workdir = workdir or os.path.join(tempfile.mkdtemp(prefix="device-demo-"), "demo")
    cmd = [sys.executable, "-m", "envace_jax.main", "--config", config, "--workdir", workdir]
    timed_out = False
    with open(log, "a") as out:
        out.write(f"\n--- {' '.join(cmd)}\n")
        out.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        wall = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(os.path.dirname(workdir), ignore_errors=True)
    stop = f", stopped after the {timeout:g} s limit" if timed_out else ""
    print(f"demo job ({config}): {wall:.1f} s wall, exit status {rc}{stop}")
    return {
        "config": config,
        "wall_s": wall,
        "returncode": rc,
        "limit_s": timeout,
        "timed_out": timed_out,
    }


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="workdir/smollm2", help="an HF checkpoint directory")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny random Qwen3")
    ap.add_argument("--batches", help="decode batch sizes (default 1,8,64)")
    ap.add_argument("--prompt", type=int, help="decode prompt tokens (default 256)")
    ap.add_argument("--new-tokens", type=int, help="decode new tokens (default 128)")
    ap.add_argument("--seq-len", type=int, help="train-step sequence length (default 1024)")
    ap.add_argument("--rows", type=int, help="train-step rows (default 64)")
    ap.add_argument("--micro-batches", type=int, help="train-step micro-batches (default 8)")
    ap.add_argument("--repeats", type=int, help="timed calls, best / median (default 3)")
    ap.add_argument("--copy-mb", type=int, help="MiB of the bandwidth array (default 2048)")
    ap.add_argument("--dtype", help="compute dtype (default bfloat16; float32 on CPU)")
    ap.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s for MFU")
    ap.add_argument("--demo", action="store_true", help="also time the demo job")
    ap.add_argument("--demo-config", help="default configs/demo.py (--tiny: :smoke)")
    ap.add_argument("--demo-timeout", type=float, help="stop the demo job after S seconds")
    ap.add_argument("--demo-workdir", help="keep the demo's workdir here (default: temporary)")
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--log", help="library output (default: beside --json, else device.log)")
    args = ap.parse_args()
    for key, value in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.log is None:
        args.log = str(Path(args.json).with_suffix(".log")) if args.json else "device.log"
    return args


def main():
    args = parse_args()
    quiet_libraries(args.log)
    demo = {}
    if args.demo:  # before this process holds the device
        demo["demo"] = time_demo(args.demo_config, args.demo_workdir, args.demo_timeout, args.log)
    info = device_info()
    dtype = args.dtype or ("float32" if info["platform"] == "cpu" else "bfloat16")
    memory = f", {info['memory_bytes'] / 2**30:.0f} GiB" if info["memory_bytes"] else ""
    print(f"device: {info['count']} x {info['kind']} ({info['platform']}{memory})")
    bandwidth = device_copy_bandwidth(args.copy_mb)
    print(f"memory bandwidth (a + 1 over {args.copy_mb} MiB): {bandwidth / 1e9:,.1f} GB/s")
    figures = {
        "device": info,
        "bandwidth_bytes_per_s": bandwidth,
        "decode": bench_decode(args, dtype, bandwidth),
        "train_step": bench_train(args, dtype, info["kind"]),
        **demo,
        "log": args.log,
    }
    if args.json:
        machine.write_json(args.json, figures, indent=1)
    print(f"library output: {args.log}" + (f"; figures: {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
