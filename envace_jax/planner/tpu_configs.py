"""The paper's Qwen3 policies on Cloud TPU: reference hyper-parameters and one layout per slice.

The `configs/qwen3_*.py` files build their configs with it. Each of them names an HF checkpoint
directory, staged on every worker by `tpu_scripts/stage.sh` (override with
--config.model.hf_path=DIR), and the slices it fits (CONTEXTS); its variants are TPU slices:

  python -m envace_jax.main --config configs/qwen3_8b.py:v5p-32 --workdir ~/envace/run \
      --config.schedule.checkpoint_dir=gs://BUCKET/run/checkpoints
  python -m envace_jax.planner --config configs/qwen3_8b.py:v5p-32 --topology v5p-32

The data and the reward are the paper's: task files in the reference layout (`data.env =
'files'`, the training and validation directories `tpu_scripts/stage.sh --data` stages on every
worker, DATA_DIR; or gs:// paths given with --config.data.train_files= / eval_files=), the
LLM checklist judge (the reference's Qwen3-30B-A3B behind an OpenAI-compatible server at
JUDGE_URL; --config.judge.base_url= to use another) and held-out evaluation by the checklist
score of rehearsed episodes (avg@4, pass@4), with no environment anywhere.

`reference_config` sets what the reference run uses (EnvACE `run_checklist_share.sh`): K = 4
rollouts of 16 instructions per step, AdamW lr 1e-6 (constant) with weight decay 0.01 and
gradient clipping 1.0, PPO clip 0.2 / 0.2 with dual clip 3, no KL term, up to 8,000 new tokens
per message and a 20,000-token context (20480, the largest length bucket), float32 master
weights with bfloat16 compute and full rematerialisation. `tpu_layout` then fits a mesh and
gradient accumulation to a slice:

* tensor parallelism over 8 chips (Qwen3's 8 KV heads), which splits the attention heads,
  the MLP and the vocabulary: the [T, T] attention scores and [T, V] logits of a 20k-token row
  are the largest arrays of the step, and heads are the only axis that splits them;
* FSDP over the remaining chips (parameters and AdamW moments split, rows split for the step
  and the sampler);
* micro-batches such that every device holds one row at a time.

A variant's context is the largest the memory planner (`python -m envace_jax.planner`) accepts
on its slice (the reference's 20,000 tokens where it fits); `tests/test_plan.py` checks that every
listed layout fits. No variant: the reference context with the layout of the file's home slice,
FSDP over whatever devices there are; check it with the planner before a run on another slice.
"""

from __future__ import annotations

import os

import ml_collections

from envace_jax.configuration import base_config
from envace_jax.planner.topology import parse_topology

REFERENCE_CONTEXT = 20480  # the reference's 20,000-token budget, as a length bucket
# Tokens kept for the opening prompt, tools rendered: the reference drops tasks above 3,500
# (data.max_prompt_tokens), and its messages may then take up to 8,000 tokens each.
PROMPT_BUDGET = 3500
DATA_DIR = "~/envace/data"  # where tpu_scripts/stage.sh --data puts the task files
TRAIN_DIR, EVAL_DIR = "train", "validation"  # the staged directory's two subdirectories
JUDGE_URL = "http://localhost:30000/v1"  # an sglang / vLLM server of the judge model
JUDGE_MODEL = "Qwen/Qwen3-30B-A3B"  # the reference's judge
TENSOR = 8  # Qwen3's KV heads: the most chips the heads split over evenly
_BUCKETS = (1024, 2048, 4096, 8192, 12288, 16384, 20480)


def reference_config(preset: str, checkpoint: str) -> ml_collections.ConfigDict:
    """The reference run's hyper-parameters for a Qwen3 policy loaded from an HF checkpoint.

    checkpoint: the checkpoint's directory on every worker (`tpu_scripts/stage.sh` puts it
    there); `~` is expanded. The architecture is also given by `preset`, so the job can be
    planned where the checkpoint is not present.
    """
    c = base_config()
    hf = os.path.expanduser(checkpoint)
    c.model.preset = preset
    c.model.hf_path = hf
    c.tokenizer = hf
    c.model.param_dtype = "float32"  # master weights: lr 1e-6 updates vanish in bfloat16
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.rollout.group_size = 4
    c.rollout.tasks_per_step = 16
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.max_message_tokens = 8000
    c.rollout.max_turns = 30
    c.optim.learning_rate = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.grpo.clip_low = 0.2
    c.grpo.clip_high = 0.2
    c.grpo.dual_clip = 3.0
    c.grpo.use_kl = False
    c.grpo.norm_adv_by_std = False
    c.grpo.epochs = 1
    c.grpo.mini_batches = 1
    c.schedule.sft_steps = 0  # the reference starts RL from the instruct checkpoint
    c.schedule.rl_steps = 470  # the reference run's length
    c.schedule.eval_every = 10
    c.schedule.checkpoint_every = 50
    c.schedule.keep_checkpoints = 3
    data = os.path.expanduser(DATA_DIR)
    c.data.env = "files"
    c.data.train_files = os.path.join(data, TRAIN_DIR)
    c.data.eval_files = os.path.join(data, EVAL_DIR)
    c.data.train_tasks = 1 << 30  # every task in the files
    c.data.eval_tasks = 64
    c.data.max_prompt_tokens = PROMPT_BUDGET
    c.judge.kind = "llm"
    c.judge.base_url = JUDGE_URL
    c.judge.model = JUDGE_MODEL
    c.judge.temperature = 0.6
    c.judge.max_tokens = 6000
    c.judge.max_retries = 5
    c.judge.concurrency = 256
    c.eval.kind = "checklist"
    c.eval.val_n = 4  # the reference's validation: avg@4 and pass@4 at T=0.6, top_p=0.95
    c.rehearsal.sft_memory_fraction = 0.0
    c.schedule.probe_every = 0
    set_context(c, REFERENCE_CONTEXT)
    return c


def set_context(c: ml_collections.ConfigDict, context: int) -> ml_collections.ConfigDict:
    """Token budgets for a `context`-token trajectory: length buckets up to it, and the new
    tokens after a prompt of up to PROMPT_BUDGET tokens."""
    if context <= PROMPT_BUDGET:
        raise ValueError(f"context {context} leaves no room after a {PROMPT_BUDGET}-token prompt")
    c.rollout.length_buckets = tuple(b for b in _BUCKETS if b < context) + (context,)
    c.rollout.max_new_tokens = context - PROMPT_BUDGET
    c.rollout.max_message_tokens = min(8000, context - PROMPT_BUDGET)
    c.eval.max_new_tokens = context - PROMPT_BUDGET
    return c


def tpu_layout(
    c: ml_collections.ConfigDict, topology: str, context: int
) -> ml_collections.ConfigDict:
    """Mesh (tensor over up to 8 chips, FSDP over the rest) and micro-batches (one row per device
    at a time) for `topology`, with a `context`-token budget."""
    t = parse_topology(topology)
    tensor = min(TENSOR, t.devices)
    fsdp = t.devices // tensor
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, fsdp, tensor
    rows = c.rollout.group_size * c.rollout.tasks_per_step
    if rows % fsdp:
        raise ValueError(f"{topology}: {rows} rows per RL step do not split over fsdp={fsdp}")
    c.grpo.micro_batches = rows // (fsdp * c.grpo.mini_batches)
    c.sft.micro_batches = max(1, c.schedule.sft_batch_size // fsdp)
    return set_context(c, context)


def qwen3_config(
    preset: str,
    checkpoint: str,
    contexts: dict[str, int],
    home: str,
    variant: str | None,
    source: str,
) -> ml_collections.ConfigDict:
    """The config of one Qwen3 policy file: `variant` names a slice in `contexts` (its layout and
    the largest context that fits it); None gives the reference context with the layout of the
    `home` slice, with the FSDP axis taking whatever devices there are."""
    c = reference_config(preset, checkpoint)
    if variant in (None, ""):
        tpu_layout(c, home, REFERENCE_CONTEXT)
        c.mesh.fsdp = -1
        return c
    names = {parse_topology(k).short_name: k for k in contexts}
    try:
        key = names.get(parse_topology(variant).short_name)
    except ValueError:
        key = None
    if key is None:
        raise ValueError(f"{source}: unknown variant {variant!r}; known: {sorted(contexts)}")
    return tpu_layout(c, key, contexts[key])
