"""Checkpoint costs on this machine: how long `save` blocks (async) vs the full write, restore,
and the share of the content checksums (computed on device at save and again at restore).

    python benchmarks/checkpoint.py --mib 256 --json checkpoint.json
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np

from envace_jax.runtime import checkpoint as ckpt_lib
from envace_jax.runtime.checkpoint_integrity import describe, state_leaves


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (float32)")
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    n = args.mib * 2**20 // 4 // args.leaves
    rng = np.random.default_rng(0)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(n, np.float32)) for i in range(args.leaves)}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    leaves = state_leaves(state)
    describe(leaves)  # compile
    t = time.perf_counter()
    describe(leaves)
    checksum = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        with ckpt_lib.Checkpointer(d, keep=2) as ckpt:
            ckpt.save(0, state, {})  # warm-up (compiles, creates directories)
            ckpt.wait()
            t = time.perf_counter()
            ckpt.save(1, state, {})
            blocking = time.perf_counter() - t
            ckpt.wait()
            total = time.perf_counter() - t
            t = time.perf_counter()
            ckpt.restore(abstract)
            restore = time.perf_counter() - t
    print(f"state {args.mib} MiB in {args.leaves} leaves on {jax.devices()[0].platform}")
    print(f"save blocks {blocking:.2f}s of {total:.2f}s total ({blocking / total:.0%})")
    print(f"restore {restore:.2f}s")
    print(
        f"checksums {checksum:.3f}s = {checksum / total:.1%} of a save, "
        f"{checksum / restore:.1%} of a restore"
    )
    if args.json:
        figures = {"mib": args.mib, "save_blocks_s": blocking, "save_s": total}
        figures |= {"restore_s": restore, "checksum_s": checksum}
        figures |= {"blocking_share": blocking / total, "checksum_share": checksum / total}
        machine.write_json(args.json, figures, indent=1)


if __name__ == "__main__":
    main()
