"""BFCL-v4 multi-turn as a training world: the `bfcl-eval` package's entries, executable
backends and checker (`envace_jax.envs.bfcl_multi_turn`; the package gets a virtual environment
of its own on first use, a few minutes, then runs offline).

Usage:
  python -m envace_jax.main --config configs/bfcl_multi_turn.py:smoke --workdir /tmp/bfcl-smoke
      # minutes: warm start -> grounded EnvACE -> held-out evaluation, tiny policy
"""

from envace_jax.configuration import base_config

# Prompts are 3.5k-8.7k demo-tokenizer tokens (the entry's function docs); the smoke run keeps
# the entries under 4,000 (train 10, validation 4, test 6), whose reference conversations and
# grounded simulator prompts fit one train length.
SMOKE_PROMPT_TOKENS = 4000
SMOKE_TRAIN_LENGTH = 6144


def smoke():
    """The pipeline on BFCL multi-turn with a tiny random policy and the demo tokenizer:
    imitation of the executed ground truth, one grounded EnvACE step (zero calls to the
    backends), then the real backends and the official checker on two validation entries."""
    config = base_config()
    config.data.env = "bfcl_multi_turn"
    config.model.preset = "tiny-qwen3"
    config.rollout.rehearsal_view = "grounded"
    config.data.train_tasks = 8
    config.data.eval_tasks = 2
    config.data.max_prompt_tokens = SMOKE_PROMPT_TOKENS
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
    config.rollout.length_buckets = (SMOKE_TRAIN_LENGTH,)
    config.grpo.micro_batches = 4  # one row at a time: a row's attention at 6k positions is 0.6 GB
    config.eval.fidelity_tasks = 1
    config.eval.max_new_tokens = 48
    config.eval.probe_tasks = 2
    return config


VARIANTS = {"smoke": smoke}


def get_config(variant: str | None = None):
    make = VARIANTS.get(variant or "smoke")
    if make is None:
        known = ", ".join(repr(name) for name in VARIANTS)
        raise ValueError(f"configs/bfcl_multi_turn.py: unknown variant {variant!r}; known: {known}")
    return make()
