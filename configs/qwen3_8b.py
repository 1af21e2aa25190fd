"""Qwen3-8B: EnvACE on Cloud TPU with the reference run's hyper-parameters
(`envace_jax.planner.tpu_configs`).

The checkpoint is the HF `Qwen/Qwen3-8B` directory. Variants are TPU slices (CONTEXTS), e.g.

  python -m envace_jax.main --config configs/qwen3_8b.py:v5p-32 --workdir ~/envace/run
"""

from envace_jax.planner.tpu_configs import qwen3_config

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
