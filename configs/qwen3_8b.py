"""Qwen3-8B: EnvACE on Cloud TPU with the reference run's hyper-parameters.

The checkpoint is the HF `Qwen/Qwen3-8B` directory, staged on every worker by
`tpu_scripts/stage.sh` (override with --config.model.hf_path=DIR). Variants are TPU slices:

  python -m envace_jax.main --config configs/qwen3_8b.py:v5p-32 --workdir ~/envace/run \
      --config.schedule.checkpoint_dir=gs://BUCKET/run/checkpoints
  python -m envace_jax.plan --config configs/qwen3_8b.py:v5p-32 --topology v5p-32

A variant uses the slice's layout (`envace_jax.planner.layouts.tpu_layout`: tensor parallel
over 8 chips, FSDP over the rest, one row per device per micro-batch) and the longest context
the memory planner accepts on it (CONTEXTS; the reference's 20,000 tokens where it fits). No
variant: the reference context with the v5p-32 layout, FSDP over whatever devices there are;
check it with the planner before a run on another slice.
"""

from envace_jax.planner.layouts import qwen3_config

CHECKPOINT = "~/envace/models/Qwen3-8B"
HOME = "v5p-32"
CONTEXTS = {
    "v5p-16": 16384,
    "v5p-32": 20480,
    "v5p-64": 20480,
    "v6e-16": 8192,
    "v6e-32": 16384,
    "v5e-32": 8192,
    "v5e-64": 8192,
}  # slice -> context that fits (tokens)


def get_config(variant: str | None = None):
    return qwen3_config("qwen3-8b", CHECKPOINT, CONTEXTS, HOME, variant, "configs/qwen3_8b.py")
