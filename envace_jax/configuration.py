"""The job configuration: every knob declared once, with its default, rule and comment.

Each section is a frozen dataclass (`envace_jax.knobs`); `JobConfig` holds them all. The
ml_collections tree that config files (`configs/*.py`) start from is generated from it by
`base_config()`; config files change values, never add keys. `validate(config)` reads the tree
back into the dataclasses and raises `ConfigError` naming the key, so a typo or a bad value
fails in milliseconds, not after a compile. Importing this module imports no JAX.

The sections `grpo`, `sft`, `optim` and `sft_optim` are the step dataclasses of
`envace_jax.rl.config` (`GRPOConfig`, `SFTConfig`, `OptimConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from envace_jax import knobs, modes
from envace_jax.envs.base import CORRUPTIONS
from envace_jax.envs.registry import DOMAINS
from envace_jax.knobs import BOOL, Section, integer, knob, nested, number, one_of, text
from envace_jax.rl.config import GRPOConfig, OptimConfig, SFTConfig, chunking_problem
from envace_jax.text import memory_slot

JOBS = ("train", "rehearsal_eval", "headroom")  # What envace_jax.main runs (envace_jax.jobs).
JUDGES = ("rule", "llm")  # judge.kind (envace_jax.rewards.judges)
# eval.kind: held-out evaluation in the domain's executable environment, or the judge's
# checklist score of world-rehearsal episodes (tasks without an environment); 'auto' picks
# the environment when the domain has one.
EVAL_KINDS = ("auto", "environment", "checklist")


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value outside its range."""


_DTYPE = one_of("float32", "bfloat16")
_MESH_AXIS = (lambda v: integer(1)[0](v) or v == -1, "-1 or an integer >= 1")
_TEMPERATURE = number(1e-6)
_TOP_P = number(1e-6, 1.0)


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    preset: str = knob("demo-qwen3", text("a preset name"))  # Name in models.PRESETS (no hf_path).
    # Local HF checkpoint dir (config.json + *.safetensors), or a shipped one by name
    # ('demo-base', 'demo-base-simulator': envace_jax.models.shipped); overrides preset.
    hf_path: str = knob("", text("a directory path, a shipped name or ''"))
    param_dtype: str = knob("float32", _DTYPE)  # Storage/update dtype; float32 for RL (lr 1e-6).
    dtype: str = knob("float32", _DTYPE)  # Compute dtype.
    remat: str = knob("none", one_of("none", "full", "dots"))  # Per-layer rematerialisation.


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    data: int = knob(-1, _MESH_AXIS)  # Data-parallel axis size; -1 takes the devices left over.
    fsdp: int = knob(1, _MESH_AXIS)  # Parameter/optimizer-state sharding axis size.
    tensor: int = knob(1, _MESH_AXIS)  # Tensor-parallel axis size.

    def __post_init__(self):
        super().__post_init__()
        if sum(v == -1 for v in (self.data, self.fsdp, self.tensor)) > 1:
            raise ValueError("data/fsdp/tensor: at most one of them may be -1")


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    env: str = knob("demo", one_of(*DOMAINS))  # Task domain and executable environment.
    # Generated training tasks (SFT demonstrations and RL prompts).
    train_tasks: int = knob(4096, integer(1))
    # Held-out tasks (a split never used in training) for evaluation.
    eval_tasks: int = knob(128, integer(1))
    # The split the train job evaluates on: 'validation', where every choice (step counts,
    # learning rates, shares) is made, or 'test', whose numbers are only reported.
    eval_split: str = knob("validation", one_of("validation", "test"))
    # Warm-start demonstrations that show a failing call (the environment's real error
    # response) and the recovery, so that both roles see what a failure looks like.
    failure_demos: float = knob(0.25, number(0.0, 1.0))
    # Warm-start demonstrations that stop one call short and reply as if done: an imperfect
    # demonstrator, whose mistake the warm start learns and RL can undo.
    unfinished_demos: float = knob(0.0, number(0.0, 1.0))
    # Warm-start demonstrations whose agent makes the lookups, then takes its task family's
    # default action whatever the lookup said (refusals included): the imperfect demonstrator
    # whose mistake RL has to undo by following what the tool answered.
    default_action_demos: float = knob(0.0, number(0.0, 1.0))
    # Share of the training tasks whose demonstration also gives the warm start one simulator
    # row per tool turn (`rollout.grounded`): the prompt of the grounded rehearsal view, the
    # environment's real responses as its REHEARSE target.
    simulator_demos: float = knob(0.0, number(0.0, 1.0))
    # Domain 'files' (no executable environment, the paper's setting): the training and the
    # held-out tasks, each a comma-separated list of task files (.parquet, .jsonl, .json in
    # the reference layout or ours), directories of them or globs; local paths or gs://.
    # `train_tasks` / `eval_tasks` cap how many of them are used (file order).
    train_files: str = knob("", text("task files, directories or globs, comma-separated"))
    eval_files: str = knob("", text("task files, directories or globs, comma-separated"))
    # Skip (and report) invalid task records instead of stopping at them.
    skip_invalid: bool = knob(False, BOOL)
    # Drop tasks whose opening prompt, tools rendered, is longer (0 = keep all; the reference
    # keeps 3,500 tokens). Domains 'files', 'bfcl_multi_turn' and 'tau2_*'.
    max_prompt_tokens: int = knob(0, integer(0))
    # Where every prompt carries test-time rehearsal's memory ('Rehearsal memory: none' when
    # there is none): 'system' (end of the system turn), 'user' (end of the instruction) or
    # 'off' (no slot; a memory is appended to the instruction). See text.memory_slot.
    memory_slot: str = knob("off", one_of(*memory_slot.PLACES))


@dataclasses.dataclass(frozen=True)
class JudgeSection(Section):
    """The trajectory reward (envace_jax.rewards.judges): the weighted checklist score of each
    episode, by machine-checkable rules or by an LLM over an OpenAI-compatible endpoint."""

    # 'rule': the items' `rule`s (tasks that carry them, e.g. the demo's); 'llm': an LLM judge
    # over HTTP, the paper's reward.
    kind: str = knob("rule", one_of(*JUDGES))
    base_url: str = knob("", text("an http(s) URL ending in /v1, or ''"))  # LLM judge's server.
    model: str = knob("", text("a model name, or ''"))  # The model name sent to it.
    # Name of the environment variable that holds the API key ('' = none); the key itself is
    # never in a config, a log or the workdir.
    api_key_env: str = knob("", text("an environment variable name, or ''"))
    # 'json_schema' sends the verdict schema as `response_format`; 'text' parses free text;
    # 'auto' sends the schema and falls back to text when the server refuses it.
    structured_output: str = knob("auto", one_of("auto", "json_schema", "text"))
    temperature: float = knob(0.6, _TEMPERATURE)  # Sampling of a verdict (the reference's).
    max_tokens: int = knob(2048, integer(1))  # Tokens of one verdict.
    concurrency: int = knob(64, integer(1))  # Requests in flight at once.
    timeout_s: float = knob(120.0, number(0.0, lo_open=True))  # Deadline of one request.
    max_retries: int = knob(4, integer(0))  # Attempts after the first one, with backoff.
    # A batch in which a larger share of the requested verdicts failed (server down, errors,
    # unparseable answers) stops the run: a broken judge must never read as a reward of 0.
    max_error_share: float = knob(0.2, number(0.0, 1.0))


@dataclasses.dataclass(frozen=True)
class RolloutSection(Section):
    group_size: int = knob(8, integer(1))  # K rollouts per task (one GRPO group).
    # Tasks per RL step; a step trains on group_size x this rows.
    tasks_per_step: int = knob(8, integer(1))
    # Sampling temperature of training rollouts, and of the train step's log-probs (they must
    # match for the importance ratios to be right).
    temperature: float = knob(1.0, _TEMPERATURE)
    top_p: float = knob(1.0, _TOP_P)  # Nucleus sampling of rollouts (1.0 = off, as the reference).
    max_new_tokens: int = knob(384, integer(1))  # Token budget of one trajectory after its prompt.
    max_turns: int = knob(6, integer(1))  # ACT messages per trajectory.
    max_message_tokens: int = knob(128, integer(1))  # Tokens of one generated message.
    length_buckets: tuple[int, ...] = knob(  # Train lengths.
        (256, 384, 512, 640, 768, 1024, 1536, 2048), knobs.positive_ints()
    )
    # Who writes world rehearsal's tool responses, and from what (mode 'envace'): 'shared', the
    # policy in the trajectory's own sequence (the paper's formulation); 'grounded', the policy
    # from a simulator prompt with the task's logged tool responses (the reference's Tool
    # Simulator, `rollout.grounded`).
    rehearsal_view: str = knob("shared", one_of(*modes.VIEWS))
    # Mode 'corrupted_world': how the copy of the world RL acts in is wrong ('redrawn': hidden
    # state redrawn from its distribution over tasks; 'optimist': no change is ever refused;
    # 'guesser': both; 'blind': every task's state redrawn, the shown state included; 'liar':
    # every task's state mapped to a fixed wrong one) and the share of episodes it is wrong in
    # (0 = the real world).
    corruption: str = knob("redrawn", one_of(*CORRUPTIONS))
    corruption_rate: float = knob(1.0, number(0.0, 1.0))


@dataclasses.dataclass(frozen=True)
class ScheduleSection(Section):
    sft_steps: int = knob(400, integer(0))  # Warm-start optimizer steps.
    sft_batch_size: int = knob(8, integer(1))  # Demonstrations per warm-start step.
    # Warm-start batches come `sft_length_window` at a time, sorted by length inside the window
    # so that each is padded little (1 = plain shuffled batches).
    sft_length_window: int = knob(16, integer(1))
    rl_steps: int = knob(16, integer(0))  # RL steps after the warm start.
    # RL steps between real-environment evaluations (0 = end only).
    eval_every: int = knob(8, integer(0))
    # Evaluate the warm start before RL (the summary's baseline row). `compare` turns it off:
    # its `sft_only` arm evaluates the warm start on the same held-out tasks.
    eval_warm_start: bool = knob(True, BOOL)
    checkpoint_every: int = knob(25, integer(1))  # Steps (SFT and RL) between checkpoints.
    keep_checkpoints: int = knob(3, integer(1))  # Checkpoints kept on disk.
    # Checkpoints: a path (relative: to the workdir) or gs:// URL; '' = workdir/checkpoints.
    checkpoint_dir: str = knob("", text("a directory, gs:// path, or ''"))
    log_every: int = knob(10, integer(1))  # SFT steps between metric lines.
    # SFT steps between held-out copy diagnostics (envace_jax.train.diagnostics; 0 = off): greedy
    # accuracy on ACT tokens and on their digits (ids, amounts) of held-out demonstrations, and
    # on the digits of tool responses (REHEARSE), overall and per tool.
    probe_every: int = knob(50, integer(0))
    # Workdir whose warm start RL starts from, or '': a run with rl_steps=0 / mode 'sft_only',
    # or a train job (the warm start it keeps in its checkpoints' warm_start/).
    warm_start_dir: str = knob("", text("a workdir path or ''"))


@dataclasses.dataclass(frozen=True)
class EvalSection(Section):
    """Held-out evaluation (envace_jax.train.evaluation): greedy, and avg@4 sampled at this setting
    (the reference's validation sampling)."""

    temperature: float = knob(0.6, _TEMPERATURE)  # Sampling temperature of the avg@4 executions.
    top_p: float = knob(0.95, _TOP_P)  # Nucleus sampling of the avg@4 executions.
    # Samples per task of the headroom job (pass@k), at rollout.temperature.
    pass_k: int = knob(8, integer(1))
    # Held-out tasks whose rehearsals are checked against the env.
    fidelity_tasks: int = knob(32, integer(0))
    max_new_tokens: int = knob(384, integer(1))  # Token budget of one evaluation episode.
    # Held-out tasks whose demonstrations the copy diagnostics score.
    probe_tasks: int = knob(32, integer(1))
    # The evaluations every `schedule.eval_every` RL steps (the learning curve) also run avg@4,
    # five times the cost of their greedy run; the warm start's and the final run it always.
    curve_avg4: bool = knob(False, BOOL)
    kind: str = knob("auto", one_of(*EVAL_KINDS))  # Environment or checklist (EVAL_KINDS).
    # Checklist evaluation: sampled episodes per task (k of avg@k and pass@k, the reference's
    # val_n), at `temperature` / `top_p`.
    val_n: int = knob(4, integer(1))


@dataclasses.dataclass(frozen=True)
class RehearsalSection(Section):
    """Test-time rehearsal (envace_jax.testtime.rehearsal) and what the train job keeps for it."""

    # Warm-start demos whose prompt carries a memory (testtime.demonstrations).
    sft_memory_fraction: float = knob(0.25, number(0.0, 1.0))
    # Of those, the share whose demonstration's last call names another id that a response
    # listed, with a plan that names it too: rows where the plan is the only source of the
    # target's id (testtime.demonstrations).
    sft_memory_swaps: float = knob(0.0, number(0.0, 1.0))
    # RL rollout tasks whose prompt carries a memory of the same kind, so that RL does not
    # unlearn reading one.
    rl_memory_fraction: float = knob(0.0, number(0.0, 1.0))
    # Train job: save warm-start params in the checkpoint directory's warm_start/.
    keep_warm_start: bool = knob(True, BOOL)
    # Eval: main job's workdir (or its checkpoints/); '' = workdir.
    checkpoint_dir: str = knob("", text("a workdir path or ''"))
    # Memory format: 'structured' or 'summary' (policy-written).
    memory: str = knob("structured", one_of("structured", "summary"))
    # Assessment after each attempt: 'rules' or 'policy' (prompted).
    assessor: str = knob("rules", one_of("rules", "policy"))
    # Rehearsal budgets N evaluated (success-vs-N plot).
    budgets: tuple[int, ...] = knob((1, 2, 4, 8), knobs.positive_ints())
    table_budget: int = knob(4, integer(1))  # The N of the summary table (one of budgets).
    temperature: float = knob(1.0, _TEMPERATURE)  # Sampling temperature of rehearsal attempts.
    top_p: float = knob(1.0, _TOP_P)  # Nucleus sampling of rehearsal attempts (1.0 = off).
    max_memory_tokens: int = knob(160, integer(1))  # Tokens of a policy-written memory.
    # Structured memory: the committed run reads a plan (and the refusals the rehearsals
    # expected) only when at least this many attempts made that plan, else `plan: none`.
    min_support: int = knob(1, integer(1))
    # Committed runs decoded at once: prefill attention grows with rows x prompt x buffer, and
    # memory-conditioned prompts are long (256 demo rows at once ask for ~25 GB).
    commit_rows: int = knob(64, integer(1))
    tasks: int = knob(32, integer(1))  # Held-out tasks per evaluation seed.
    # Only the rows without rehearsal: none, the empty memory, the exact memory (the gate that
    # shows whether the policy can read a memory at all).
    gate_only: bool = knob(False, BOOL)
    seeds: int = knob(3, integer(1))  # Evaluation seeds (task sets, keys); tables: mean and std.
    # Task split evaluated ('test' is never used by the train job).
    split: str = knob("test", one_of("validation", "test"))

    def __post_init__(self):
        super().__post_init__()
        if self.table_budget not in self.budgets:
            raise ValueError(
                f"table_budget = {self.table_budget}: expected one of budgets {tuple(self.budgets)}"
            )


@dataclasses.dataclass(frozen=True)
class JobConfig(Section):
    """The whole job: its top-level knobs and one field per section."""

    seed: int = knob(0, integer(0))  # Seeds parameter init, task generation order, sampling.
    mode: str = knob("envace", modes.RULE)  # Training mode: a row of envace_jax.modes.
    # What main runs: 'train' (the EnvACE job), 'rehearsal_eval' (see rehearsal) or 'headroom'
    # (greedy, pass@1 and pass@k of a trained workdir's policies).
    job: str = knob("train", one_of(*JOBS))
    # 'demo' (shipped byte-level BPE) or a local HF tokenizer directory.
    tokenizer: str = knob("demo", text("'demo' or a tokenizer directory", empty=False))
    model: ModelSection = nested(ModelSection)  # The policy: architecture, weights, dtypes.
    mesh: MeshSection = nested(MeshSection)  # Device mesh axes (envace_jax.parallel).
    data: DataSection = nested(DataSection)  # Tasks: domain, split sizes, demonstrations.
    sft: SFTConfig = nested(SFTConfig)  # Warm-start step.
    sft_optim: OptimConfig = nested(  # Optimizer of the warm start.
        OptimConfig,
        learning_rate=3e-3,
        schedule="cosine",
        warmup_steps=30,
        decay_steps=370,
        end_lr_ratio=0.1,
    )
    # Role-wise GRPO step; its temperature is rollout.temperature (one temperature for the
    # sampler and the step's log-probs).
    grpo: GRPOConfig = nested(GRPOConfig, linked={"temperature": "rollout.temperature"})
    optim: OptimConfig = nested(OptimConfig, learning_rate=1e-4)  # Optimizer of the RL phase.
    rollout: RolloutSection = nested(RolloutSection)  # Training rollouts (GRPO groups).
    schedule: ScheduleSection = nested(ScheduleSection)  # Steps, evaluations, checkpoints.
    judge: JudgeSection = nested(JudgeSection)  # The reward: rule or LLM checklist judge.
    eval: EvalSection = nested(EvalSection)  # Held-out evaluation.
    rehearsal: RehearsalSection = nested(RehearsalSection)  # Test-time rehearsal.

    def __post_init__(self):
        super().__post_init__()
        # Each update splits its rows into mini_batches x micro_batches equal chunks; a count
        # that does not divide would otherwise fail at the first step of its phase, after the
        # work before it (a whole warm start, for the RL step).
        r = self.rollout
        modes.lookup(self.mode, r.rehearsal_view)  # the pair must be a row of the mode table
        self._check_data()
        batches = (
            (self.sft, self.schedule.sft_batch_size, "schedule.sft_batch_size"),
            (self.grpo, r.group_size * r.tasks_per_step, "rollout.group_size x tasks_per_step"),
        )
        for step, rows, what in batches:
            mini, micro, key = step.mini_batches, step.micro_batches, step.config_key
            if problem := chunking_problem(rows, mini, micro, key):
                raise ValueError(f"{what} = {rows} rows {problem}")

    def _check_data(self) -> None:
        """Task files, judge and evaluation that fit together (checked before any work)."""
        d, j = self.data, self.judge
        if j.kind == "llm":
            for key in ("base_url", "model"):
                if not getattr(j, key):
                    raise ValueError(f"judge.{key}: judge.kind = 'llm' needs it")
            if not j.base_url.startswith(("http://", "https://")):
                raise ValueError(f"judge.base_url = {j.base_url!r}: expected an http(s) URL")
        files = d.env == "files"
        for key in ("train_files", "eval_files"):
            if files and not getattr(d, key):
                raise ValueError(f"data.{key}: data.env = 'files' needs task files")
            if not files and getattr(d, key):
                raise ValueError(f"data.{key}: set data.env = 'files' to train on task files")
        if not files:
            return
        # Without an executable environment: nothing may need one.
        no_env = "data.env = 'files' has no executable environment"
        if modes.lookup(self.mode).batch in ("environment", "corrupted"):
            raise ValueError(f"mode = {self.mode!r}: {no_env}")
        if self.job != "train":
            raise ValueError(f"job = {self.job!r}: {no_env}")
        if self.eval.kind == "environment":
            raise ValueError(f"eval.kind = 'environment': {no_env}; use 'checklist'")
        if self.data.memory_slot != "off":
            raise ValueError(
                f"data.memory_slot = {self.data.memory_slot!r}: a slot holds memories of "
                f"test-time rehearsal, which commits in an environment; {no_env} (set 'off')"
            )
        for key in ("sft_memory_fraction", "rl_memory_fraction"):
            if value := getattr(self.rehearsal, key):
                raise ValueError(
                    f"rehearsal.{key} = {value}: memories are built by replaying the reference "
                    f"plan's alternatives in the environment; {no_env} (set 0)"
                )


def base_config() -> ml_collections.ConfigDict:
    """Every knob at its default, as the tree config files and --config.x.y= overrides edit."""
    return ml_collections.ConfigDict(knobs.as_dict(JobConfig()))


def world_smoke(env: str, train_tasks: int, eval_tasks: int) -> ml_collections.ConfigDict:
    """A minutes-long run of the whole pipeline in world `env` (`data.env`) with a tiny random
    policy and the demo tokenizer: two warm-start steps on the world's demonstrations, one
    grounded EnvACE step, and evaluation in the real world at the warm start and at the end.
    It shows the plumbing, not learning."""
    config = base_config()
    config.data.env = env
    config.model.preset = "tiny-qwen3"
    config.rollout.rehearsal_view = "grounded"
    config.data.train_tasks = train_tasks
    config.data.eval_tasks = eval_tasks
    config.data.failure_demos = 0.0  # the demo world's augmentation
    config.schedule.sft_steps = 2
    config.schedule.sft_batch_size = 2
    config.sft_optim.warmup_steps = 1
    config.sft_optim.decay_steps = 1
    config.schedule.rl_steps = 1
    config.schedule.eval_every = 1
    config.schedule.checkpoint_every = 1
    config.schedule.log_every = 1
    config.rollout.group_size = 2
    config.rollout.tasks_per_step = 2
    config.rollout.max_new_tokens = 48
    config.rollout.max_message_tokens = 24
    config.eval.max_new_tokens = 48
    config.eval.fidelity_tasks = 1
    config.eval.probe_tasks = eval_tasks
    return config


def pick_variant(variants: dict, variant: str | None, where: str, default: str = ""):
    """`variants[variant or default]()`: a config file's `get_config`, which names the file and
    the variants it knows when `variant` is not one of them."""
    make = variants.get(variant or default)
    if make is None:
        known = ", ".join(repr(name) for name in variants if name)
        raise ValueError(f"{where}: unknown variant {variant!r}; known: {known}")
    return make()


def key_problem(path: str) -> str | None:
    """Why `config.<path>` is not a key of the config tree, naming the keys of the section it
    falls in; None if it is one."""
    return knobs.key_problem(JobConfig, path)


def load(config: ml_collections.ConfigDict) -> JobConfig:
    """`config` read into the section dataclasses; raises ConfigError naming each bad key."""
    try:
        return knobs.build(JobConfig, config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def step_configs(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The step dataclasses of `config`, keyed by section name (raises naming bad keys)."""
    job = load(config)
    return {name: getattr(job, name) for name in ("sft", "sft_optim", "grpo", "optim")}


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every key and value of `config`; returns it unchanged or raises ConfigError."""
    load(config)
    return config
