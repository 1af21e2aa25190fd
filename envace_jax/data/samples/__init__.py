"""Task files shipped with the package, to try the file path (`config.data.env = 'files'`,
`python -m envace_jax.data.validate`) without data of one's own.

* `demo_train.parquet`: 64 demo-domain train tasks (seed 0) in the reference layout, made by

      python -m envace_jax.envs.export --domain demo --split train --tasks 64 --seed 0 \\
          envace_jax/data/samples/demo_train.parquet

* `demo_validation.parquet`: 32 demo-domain validation tasks (seed 0), made by

      python -m envace_jax.envs.export --domain demo --split validation --tasks 32 --seed 0 \\
          envace_jax/data/samples/demo_validation.parquet

  Both carry the demo's checklists (natural-language items plus machine-checkable `rule`s)
  and `ground_truth`; reading them back gives tasks equal to `generate_tasks(0, n, split)`'s
  (tests/test_data_export.py checks it), so regenerate them with the commands above whenever
  the demo domain's tasks change.

* `handwritten.jsonl`: 4 multi-turn tasks written by hand in the reference layout (flights,
  calendar, recipes and a cart, travel weather and currency): 2 or 3 user turns each, tools
  with JSON schemas (as a JSON string, as the reference stores them), the full reference
  conversation with tool calls and tool responses, and natural-language checklist items per
  turn (weights summing to 1 per turn, CM2-style evidence objects, no rules: an LLM judge
  scores them).
"""

from __future__ import annotations

from pathlib import Path

SAMPLES = ("demo_train.parquet", "demo_validation.parquet", "handwritten.jsonl")


def sample_path(name: str) -> str:
    """The path of a shipped sample task file (`SAMPLES`)."""
    if name not in SAMPLES:
        raise ValueError(f"no shipped sample {name!r}; expected one of {SAMPLES}")
    return str(Path(__file__).with_name(name))
