"""Qwen3-1.7B: EnvACE on Cloud TPU with the reference run's hyper-parameters
(`envace_jax.planner.tpu_configs`).

The checkpoint is the HF `Qwen/Qwen3-1.7B` directory. Variants are TPU slices (CONTEXTS), e.g.

  python -m envace_jax.main --config configs/qwen3_1p7b.py:v5p-16 --workdir ~/envace/run
"""

from envace_jax.planner.tpu_configs import qwen3_config

CHECKPOINT = "~/envace/models/Qwen3-1.7B"
HOME = "v5p-16"
CONTEXTS = {
    "v5p-8": 16384,
    "v5p-16": 20480,
    "v5p-32": 20480,
    "v6e-8": 8192,
    "v6e-16": 16384,
    "v6e-32": 20480,
    "v5e-16": 8192,
    "v5e-32": 16384,
}  # slice -> context that fits (tokens)


def get_config(variant: str | None = None):
    return qwen3_config("qwen3-1.7b", CHECKPOINT, CONTEXTS, HOME, variant, "configs/qwen3_1p7b.py")
