"""EnvACE in the paper's setting, at CPU size: task files, an LLM checklist judge, no environment.

The training and validation tasks are files in the reference layout (the samples shipped in
envace_jax/data/samples: demo-world tasks exported by `python -m envace_jax.envs.export`, and
hand-written multi-turn tasks). Rollouts are world rehearsal, the reward is the checklist
score an LLM judge gives over HTTP, and held-out evaluation is the checklist score of
rehearsed episodes (avg@k, pass@k): no environment is ever called. The judge here is the
project's own server with the shipped demo policy, which shows the path works end to end; any
OpenAI-compatible endpoint can take its place (judge.base_url, judge.model, judge.api_key_env).

  python -m envace_jax.serve --model envace_jax/models/demo_base \
      --tokenizer envace_jax/text/demo_tokenizer --port 8011 &
  python -m envace_jax.main --config configs/checklist.py --workdir workdir/checklist

Variants:
  configs/checklist.py:rule      the same files scored by the items' machine-checkable rules
                                 (the exported demo tasks carry them; no judge server needed)
  configs/checklist.py:shared    the shared rehearsal view instead of the grounded one
"""

from envace_jax.configuration import base_config
from envace_jax.data.samples import sample_path

JUDGE_URL = "http://127.0.0.1:8011/v1"  # where the command above serves the judge


def checklist():
    c = base_config()
    c.model.hf_path = "demo-base-simulator"
    c.data.env = "files"
    c.data.train_files = ",".join(
        sample_path(n) for n in ("demo_train.parquet", "handwritten.jsonl")
    )
    c.data.eval_files = sample_path("demo_validation.parquet")
    c.data.train_tasks = 68
    c.data.eval_tasks = 8
    c.judge.kind = "llm"
    c.judge.base_url = JUDGE_URL
    c.judge.model = "demo_base"
    c.judge.max_tokens = 192  # a verdict of the tiny judge; a real judge keeps the default
    c.judge.concurrency = 16
    c.rehearsal.sft_memory_fraction = 0.0  # memory demonstrations need an environment
    c.rollout.rehearsal_view = "grounded"  # the reference's Tool Simulator view
    c.schedule.sft_steps = 0  # RL from the shipped base, as the paper starts from Qwen3
    c.schedule.rl_steps = 2
    c.schedule.eval_every = 0
    c.schedule.probe_every = 0
    c.rollout.group_size = 2
    c.rollout.tasks_per_step = 4
    c.rollout.temperature = 0.6
    c.rollout.top_p = 0.95
    c.rollout.max_new_tokens = 256
    c.eval.val_n = 2
    c.eval.max_new_tokens = 256
    c.optim.learning_rate = 3e-4
    c.grpo.micro_batches = 2
    c.rollout.length_buckets = (1024, 2048)
    return c


def rule():
    c = checklist()
    c.data.train_files = sample_path("demo_train.parquet")
    c.data.train_tasks = 64
    c.judge.kind = "rule"
    c.judge.base_url = ""
    c.judge.model = ""
    return c


def shared():
    c = checklist()
    c.rollout.rehearsal_view = "shared"
    return c


VARIANTS = {"": checklist, "rule": rule, "shared": shared}


def get_config(variant: str | None = None):
    make = VARIANTS.get(variant or "")
    if make is None:
        known = ", ".join(repr(name) for name in VARIANTS if name)
        raise ValueError(f"configs/checklist.py: unknown variant {variant!r}; known: {known}")
    return make()
