"""BFCL-v4 multi-turn as a training world: the `bfcl-eval` package's entries, executable
backends and checker (`envace_jax.envs.bfcl_multi_turn`; the package gets a virtual environment
of its own on first use, a few minutes, then runs offline).

Usage:
  python -m envace_jax.main --config configs/bfcl_multi_turn.py:smoke --workdir /tmp/bfcl-smoke
      # minutes: warm start -> grounded EnvACE -> held-out evaluation, tiny policy
  make smollm2
  python -m envace_jax.main --config configs/bfcl_multi_turn.py:smollm2 --workdir DIR
      # the SmolLM2 study (an accelerator's job; add --config.mode=grpo_real_env for the control)
"""

from envace_jax.configuration import base_config, pick_variant, world_smoke

# Prompts are 3.5k-8.7k demo-tokenizer tokens (the entry's function docs); the smoke run keeps
# the entries under 4,000 (train 10, validation 4, test 6), whose reference conversations and
# grounded simulator prompts fit one train length.
SMOKE_PROMPT_TOKENS = 4000
SMOKE_TRAIN_LENGTH = 6144
STUDY_PROMPT_TOKENS = 3500  # SmolLM2 tokens: its 8,192 positions hold these conversations


def smoke():
    """The pipeline on BFCL multi-turn (`configuration.world_smoke`): imitation of the executed
    ground truth, one grounded EnvACE step (zero calls to the backends), then the real backends
    and the official checker on two validation entries."""
    config = world_smoke("bfcl_multi_turn", train_tasks=8, eval_tasks=2)
    config.data.max_prompt_tokens = SMOKE_PROMPT_TOKENS
    config.rollout.length_buckets = (SMOKE_TRAIN_LENGTH,)
    config.grpo.micro_batches = 4  # one row at a time: a row's attention at 6k positions is 0.6 GB
    return config


def smollm2():
    """The SmolLM2 study: SmolLM2-135M-Instruct (`make smollm2`) on the BFCL entries whose
    prompt fits 3,500 of its tokens (train 52, validation 18, test 17). The warm start imitates
    the executed ground truth; then grounded EnvACE (this config) or real-environment GRPO
    (`--config.mode=grpo_real_env`) at equal rollouts; held-out success is bfcl-eval's checker
    (validation here; `--config.data.eval_split=test` only to report). Meant for an
    accelerator: docs/worlds.md gives its cost on 2 CPU cores."""
    config = base_config()
    config.data.env = "bfcl_multi_turn"
    config.model.hf_path = config.tokenizer = "workdir/smollm2"
    config.model.remat = "full"
    config.rollout.rehearsal_view = "grounded"
    config.data.max_prompt_tokens = STUDY_PROMPT_TOKENS
    config.data.train_tasks = 52
    config.data.eval_tasks = 18
    config.data.failure_demos = 0.0
    config.schedule.sft_steps = 60
    config.schedule.sft_batch_size = 4
    config.sft.micro_batches = 4
    config.sft_optim.learning_rate = 1e-4
    config.sft_optim.warmup_steps = 6
    config.sft_optim.decay_steps = 54
    config.optim.learning_rate = 1e-5
    config.optim.warmup_steps = 2
    config.schedule.rl_steps = 12
    config.schedule.eval_every = 4
    config.schedule.checkpoint_every = 4
    config.rollout.group_size = 4
    config.rollout.tasks_per_step = 4
    config.rollout.max_turns = 24  # up to 7 user turns, each a few calls and a reply
    config.rollout.max_new_tokens = 768
    config.rollout.max_message_tokens = 96
    config.rollout.length_buckets = (4608, 6144)
    config.grpo.micro_batches = 16
    config.eval.max_new_tokens = 768
    config.eval.fidelity_tasks = 8
    config.eval.probe_tasks = 8
    return config


VARIANTS = {"smoke": smoke, "smollm2": smollm2}


def get_config(variant: str | None = None):
    return pick_variant(VARIANTS, variant, "configs/bfcl_multi_turn.py", default="smoke")
