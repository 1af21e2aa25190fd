"""CPU demo: the whole method on the shipped demo tokenizer and a tiny Qwen3-architecture policy.

Usage:
  python -m envace_jax.main --config configs/demo.py --workdir workdir/demo
  python -m envace_jax.main --config configs/demo.py:smoke --workdir /tmp/smoke   # seconds-long
  python -m envace_jax.main --config configs/demo.py --config.seed=1 --workdir ...  # overrides
"""

from envace_jax.configuration import base_config


def get_config(variant: str | None = None):
    config = base_config()
    if variant in (None, ""):
        return config
    if variant == "smoke":
        # Seconds-long run of the same pipeline, used by tests and CI.
        config.generate.max_new_tokens = 8
        return config
    raise ValueError(f"configs/demo.py: unknown variant {variant!r}; known: 'smoke'")
