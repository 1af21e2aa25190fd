"""Store a finished `configs/demo.py:base` run as the shipped demo base policy.

    python -m envace_jax.main --config configs/demo.py:base --workdir workdir/demo_base
    python scripts/ship_demo_base.py workdir/demo_base/export [--out DIR]

(`make demo-base` runs both.) The run's HF export is re-written in bfloat16 (~2 MB) without
tokenizer files: the shipped demo tokenizer goes with it (`tokenizer: 'demo'`).
"""

from __future__ import annotations

import argparse
import os
import sys

from envace_jax.models.hf_io import load_hf_model, save_hf_model
from envace_jax.models.shipped import DEMO_BASE_DIR
from envace_jax.text.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="the base run's export/ directory (HF safetensors)")
    ap.add_argument("--out", default=DEMO_BASE_DIR, help="where to write (default: the package)")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.export, "config.json")):
        print(f"{args.export}: no config.json (is it a run's export/ directory?)", file=sys.stderr)
        return 2
    model, cfg = load_hf_model(args.export)
    if cfg.vocab_size != len(load_tokenizer("demo")):
        print(
            f"{args.export}: vocabulary {cfg.vocab_size} is not the demo tokenizer's",
            file=sys.stderr,
        )
        return 2
    os.makedirs(args.out, exist_ok=True)
    files = save_hf_model(model, cfg, args.out, dtype="bfloat16")
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    print(f"wrote {', '.join(files)} to {args.out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
