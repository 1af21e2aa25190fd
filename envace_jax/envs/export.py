"""Write a registered domain's tasks as a task file in the reference layout.

    python -m envace_jax.envs.export --domain demo --split train --tasks 64 --seed 0 OUT.parquet

writes `envs.registry.domain(name).generate_tasks(seed, n, split)` with
`data.export.export_tasks` (`.parquet` or `.jsonl`, by suffix).
"""

from __future__ import annotations

import argparse
import sys

from envace_jax.data.export import export_tasks
from envace_jax.envs.registry import domain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envace_jax.envs.export",
        description="Write a registered domain's tasks as a task file in the reference layout.",
    )
    parser.add_argument("--domain", default="demo", help="a registered domain (config.data.env)")
    parser.add_argument("--split", default="train", help="train, validation or test")
    parser.add_argument("--tasks", type=int, default=64, help="how many tasks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-source", help="data_source of tasks that name none (the domain)")
    parser.add_argument("out", help="the file to write: .parquet or .jsonl")
    args = parser.parse_args(argv)
    if not args.out.endswith((".parquet", ".jsonl")):
        parser.error(f"{args.out}: expected a .parquet or .jsonl file name")
    try:
        dom = domain(args.domain)
        tasks = dom.generate_tasks(args.seed, args.tasks, args.split)
    except ValueError as e:
        parser.error(str(e))
    n = export_tasks(tasks, args.out, data_source=args.data_source or args.domain)
    print(f"wrote {n} {args.domain} {args.split} tasks (seed {args.seed}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
