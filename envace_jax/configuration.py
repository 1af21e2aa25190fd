"""The job configuration: defaults for every knob, and validation before anything is compiled.

Config files (`configs/*.py`) start from `base_config()` and change values; they never add keys.
`validate(config)` compares a config against the defaults' key tree and value rules and raises
`ConfigError` naming the key, so a typo or a bad value fails in milliseconds, not after a compile.

The sections `grpo`, `sft`, `optim` and `sft_optim` mirror the step dataclasses of `envace_jax.rl`
(`GRPOConfig`, `SFTConfig`, `OptimConfig`), whose field comments document each knob; their
defaults come from those dataclasses, so there is one source of truth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ml_collections

from envace_jax.rl.config import GRPOConfig, SFTConfig
from envace_jax.rl.optim import OptimConfig
from envace_jax.rl.steps import chunking_problem

# Training modes (envace_jax.rollout.modes): 'envace' = shared-parameter world rehearsal; the
# baselines 'envace_noshare', 'grpo_real_env', 'external_simulator' and 'sft_only'.
MODES = ("envace", "envace_noshare", "grpo_real_env", "external_simulator", "sft_only")


JOBS = ("train", "rehearsal_eval", "headroom")  # What envace_jax.main runs (envace_jax.jobs).


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value outside its range."""


def _section(cls, exclude: tuple[str, ...] = (), **overrides) -> ml_collections.ConfigDict:
    fields = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
    values = {name: getattr(cls(), name) for name in fields}
    values.update(overrides)
    return ml_collections.ConfigDict(values)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # Seeds parameter init, task generation order, sampling.
    c.mode = "envace"  # Training mode, one of MODES.
    # What main runs: 'train' (the EnvACE job), 'rehearsal_eval' (see rehearsal) or 'headroom'
    # (greedy, pass@1 and pass@k of a trained workdir's policies).
    c.job = "train"
    c.tokenizer = "demo"  # 'demo' (shipped byte-level BPE) or a local HF tokenizer directory.

    c.model = ml_collections.ConfigDict()
    c.model.preset = "demo-qwen3"  # Name in envace_jax.models.PRESETS, used when hf_path is empty.
    # Local HF checkpoint dir (config.json + *.safetensors), or a shipped one by name
    # ('demo-base', envace_jax.models.shipped); overrides preset.
    c.model.hf_path = ""
    c.model.param_dtype = "float32"  # Storage and update dtype; keep float32 for RL (lr 1e-6).
    c.model.dtype = "float32"  # Compute dtype.
    c.model.remat = "none"  # Per-layer rematerialisation: 'none', 'full' or 'dots'.

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # Data-parallel axis size; -1 takes the devices left over.
    c.mesh.fsdp = 1  # Parameter/optimizer-state sharding axis size.
    c.mesh.tensor = 1  # Tensor-parallel axis size.

    c.data = ml_collections.ConfigDict()
    c.data.env = "demo"  # Task domain and executable environment ('demo').
    c.data.train_tasks = 4096  # Generated training tasks (SFT demonstrations and RL prompts).
    c.data.eval_tasks = 128  # Held-out tasks (a split never used in training) for evaluation.
    # Warm-start demonstrations that show a failing call (the environment's real error
    # response) and the recovery, so that both roles see what a failure looks like.
    c.data.failure_demos = 0.25

    c.sft = _section(SFTConfig)  # Warm-start step (envace_jax.rl.config.SFTConfig).
    c.sft_optim = _section(
        OptimConfig,
        learning_rate=3e-3,
        schedule="cosine",
        warmup_steps=30,
        decay_steps=370,
        end_lr_ratio=0.1,
    )  # Optimizer of the warm start (envace_jax.rl.optim.OptimConfig).
    # Role-wise GRPO step (envace_jax.rl.config.GRPOConfig); its temperature is
    # rollout.temperature.
    c.grpo = _section(GRPOConfig, exclude=("temperature",))
    c.optim = _section(OptimConfig, learning_rate=1e-4)  # Optimizer of the RL phase.

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # K rollouts per task (one GRPO group).
    c.rollout.tasks_per_step = 8  # Tasks per RL step; a step trains on group_size x this rows.
    # Sampling temperature of training rollouts, and of the train step's log-probs (they must
    # match for the importance ratios to be right).
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0  # Nucleus sampling of training rollouts (1.0 = off, as the reference).
    c.rollout.max_new_tokens = 384  # Token budget of one trajectory after its prompt.
    c.rollout.max_turns = 6  # ACT messages per trajectory.
    c.rollout.max_message_tokens = 128  # Tokens of one generated message.
    c.rollout.length_buckets = (256, 384, 512, 640, 768, 1024, 1536, 2048)  # Train lengths.

    c.schedule = ml_collections.ConfigDict()
    c.schedule.sft_steps = 400  # Warm-start optimizer steps.
    c.schedule.sft_batch_size = 8  # Demonstrations per warm-start step.
    # Warm-start batches come `sft_length_window` at a time, sorted by length inside the window
    # so that each is padded little (1 = plain shuffled batches).
    c.schedule.sft_length_window = 16
    c.schedule.rl_steps = 16  # RL steps after the warm start.
    c.schedule.eval_every = 8  # RL steps between real-environment evaluations (0 = end only).
    c.schedule.checkpoint_every = 25  # Steps (SFT and RL) between checkpoints.
    c.schedule.keep_checkpoints = 3  # Checkpoints kept on disk.
    c.schedule.checkpoint_dir = ""  # Checkpoints: a path or gs:// URL; '' = workdir/checkpoints.
    c.schedule.log_every = 10  # SFT steps between metric lines.
    # SFT steps between held-out copy diagnostics (envace_jax.diagnostics; 0 = off): greedy
    # accuracy on ACT tokens and on their digits (ids, amounts) of held-out demonstrations, and
    # on the digits of tool responses (REHEARSE), overall and per tool.
    c.schedule.probe_every = 50
    # Workdir whose warm start RL starts from, or '': a run with rl_steps=0 / mode 'sft_only',
    # or a train job (the warm start it keeps in warm_start/).
    c.schedule.warm_start_dir = ""

    c.eval = ml_collections.ConfigDict()
    # Held-out evaluation (envace_jax.evaluation): greedy, and avg@4 sampled at this setting
    # (the reference's validation sampling).
    c.eval.temperature = 0.6  # Sampling temperature of the avg@4 executions.
    c.eval.top_p = 0.95  # Nucleus sampling of the avg@4 executions.
    c.eval.pass_k = 8  # Samples per task of the headroom job (pass@k), at rollout.temperature.
    c.eval.fidelity_tasks = 32  # Held-out tasks whose rehearsals are checked against the env.
    c.eval.max_new_tokens = 384  # Token budget of one evaluation episode.
    c.eval.probe_tasks = 32  # Held-out tasks whose demonstrations the copy diagnostics score.

    c.rehearsal = ml_collections.ConfigDict()  # Test-time rehearsal (envace_jax.rollout.test_time).
    c.rehearsal.sft_memory_fraction = 0.25  # Warm-start demos whose prompt carries a memory.
    c.rehearsal.keep_warm_start = True  # Train job: save warm-start params in workdir/warm_start/.
    c.rehearsal.checkpoint_dir = ""  # Eval: main job's workdir (or its checkpoints/); '' = workdir.
    c.rehearsal.memory = "structured"  # Memory format: 'structured' or 'summary' (policy-written).
    c.rehearsal.assessor = "rules"  # Assessment after each attempt: 'rules' or 'policy' (prompted).
    c.rehearsal.budgets = (1, 2, 4, 8)  # Rehearsal budgets N evaluated (success-vs-N plot).
    c.rehearsal.table_budget = 4  # The N of the summary table (one of budgets).
    c.rehearsal.temperature = 1.0  # Sampling temperature of rehearsal attempts.
    c.rehearsal.top_p = 1.0  # Nucleus sampling of rehearsal attempts (1.0 = off).
    c.rehearsal.max_memory_tokens = 160  # Tokens of a policy-written assessment or summary.
    # Committed runs decoded at once: prefill attention grows with rows x prompt x buffer, and
    # memory-conditioned prompts are long (256 demo rows at once asked for ~25 GB).
    c.rehearsal.commit_rows = 64
    c.rehearsal.tasks = 32  # Held-out tasks per evaluation seed.
    c.rehearsal.seeds = 3  # Evaluation seeds (task sets, keys); tables give mean and std.
    c.rehearsal.split = "test"  # Task split evaluated ('test' is never used by the train job).

    c.generate = ml_collections.ConfigDict()
    c.generate.max_new_tokens = 48  # Tokens decoded by the sample run (`schedule` all zero).
    return c


def _int(lo: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo), (
        f"an integer >= {lo}"
    )


def _float(lo: float, hi: float | None = None) -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and lo <= v
        and (hi is None or v <= hi)
    )
    return ok, f"a number in [{lo}, {hi if hi is not None else 'inf'}]"


def _choice(*options: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in options), f"one of {options}"


_MESH_AXIS = (lambda v: isinstance(v, int) and (v == -1 or v >= 1), "-1 or an integer >= 1")
_DTYPE = _choice("float32", "bfloat16")

# Value rules of the sections that are not step dataclasses: key path -> (predicate, allowed).
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": _int(0),
    "mode": _choice(*MODES),
    "job": _choice(*JOBS),
    "tokenizer": (lambda v: isinstance(v, str) and v != "", "'demo' or a tokenizer directory"),
    "model.preset": (lambda v: isinstance(v, str), "a preset name"),
    "model.hf_path": (lambda v: isinstance(v, str), "a directory path, 'demo-base' or ''"),
    "model.param_dtype": _DTYPE,
    "model.dtype": _DTYPE,
    "model.remat": _choice("none", "full", "dots"),
    "mesh.data": _MESH_AXIS,
    "mesh.fsdp": _MESH_AXIS,
    "mesh.tensor": _MESH_AXIS,
    "data.env": _choice("demo"),
    "data.train_tasks": _int(1),
    "data.eval_tasks": _int(1),
    "data.failure_demos": _float(0.0, 1.0),
    "rollout.group_size": _int(1),
    "rollout.tasks_per_step": _int(1),
    "rollout.temperature": _float(1e-6),
    "rollout.top_p": _float(1e-6, 1.0),
    "rollout.max_new_tokens": _int(1),
    "rollout.max_turns": _int(1),
    "rollout.max_message_tokens": _int(1),
    "rollout.length_buckets": (
        lambda v: (
            isinstance(v, (tuple, list))
            and len(v) > 0
            and all(isinstance(x, int) and x > 0 for x in v)
        ),
        "a non-empty tuple of positive integers",
    ),
    "schedule.sft_steps": _int(0),
    "schedule.sft_batch_size": _int(1),
    "schedule.sft_length_window": _int(1),
    "schedule.rl_steps": _int(0),
    "schedule.eval_every": _int(0),
    "schedule.checkpoint_every": _int(1),
    "schedule.keep_checkpoints": _int(1),
    "schedule.checkpoint_dir": (lambda v: isinstance(v, str), "a directory, gs:// path, or ''"),
    "schedule.log_every": _int(1),
    "schedule.probe_every": _int(0),
    "eval.probe_tasks": _int(1),
    "schedule.warm_start_dir": (lambda v: isinstance(v, str), "a workdir path or ''"),
    "eval.temperature": _float(1e-6),
    "eval.top_p": _float(1e-6, 1.0),
    "eval.pass_k": _int(1),
    "eval.fidelity_tasks": _int(0),
    "eval.max_new_tokens": _int(1),
    "generate.max_new_tokens": _int(1),
    "rehearsal.sft_memory_fraction": _float(0.0, 1.0),
    "rehearsal.keep_warm_start": (lambda v: isinstance(v, bool), "a bool"),
    "rehearsal.checkpoint_dir": (lambda v: isinstance(v, str), "a workdir path or ''"),
    "rehearsal.memory": _choice("structured", "summary"),
    "rehearsal.assessor": _choice("rules", "policy"),
    "rehearsal.budgets": (
        lambda v: (
            isinstance(v, (tuple, list))
            and len(v) > 0
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
        ),
        "a non-empty tuple of positive integers",
    ),
    "rehearsal.table_budget": _int(1),
    "rehearsal.temperature": _float(1e-6),
    "rehearsal.top_p": _float(1e-6, 1.0),
    "rehearsal.max_memory_tokens": _int(1),
    "rehearsal.commit_rows": _int(1),
    "rehearsal.tasks": _int(1),
    "rehearsal.seeds": _int(1),
    "rehearsal.split": _choice("validation", "test"),
}
_DATACLASS_SECTIONS = {
    "sft": SFTConfig,
    "sft_optim": OptimConfig,
    "grpo": GRPOConfig,
    "optim": OptimConfig,
}


def _flatten(cfg: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def step_configs(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The step dataclasses of `config`, keyed by section name (raises naming bad keys)."""
    out = {}
    for section, cls in _DATACLASS_SECTIONS.items():
        values = config[section].to_dict()
        if section == "grpo":  # one temperature for the sampler and the step's log-probs
            values["temperature"] = config.rollout.temperature
        try:
            out[section] = cls.from_config(values, section)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return out


def key_problem(path: str) -> str | None:
    """Why `config.<path>` is not a key of the config tree, naming the keys of the section it
    falls in; None if it is one."""
    node, where = base_config(), "config"
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"unknown config key config.{path}: {where} is a value, not a section"
        if part not in node:
            keys = ", ".join(sorted(node.keys()))
            return f"unknown config key config.{path}: {where} has no key {part!r} (keys: {keys})"
        node, where = node[part], f"{where}.{part}"
    if isinstance(node, ml_collections.ConfigDict):
        return f"config.{path} is a section (keys: {', '.join(sorted(node.keys()))}), not a value"
    return None


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every key and value of `config`; returns it unchanged or raises ConfigError."""
    given = _flatten(config)
    known = _flatten(base_config())
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError("; ".join(key_problem(k) for k in unknown))
    missing = sorted(set(known) - set(given))
    if missing:
        raise ConfigError(f"config is missing key(s): {', '.join('config.' + k for k in missing)}")
    problems = []
    for path, value in given.items():
        rule = _RULES.get(path)
        if rule is not None and not rule[0](value):
            problems.append(f"config.{path} = {value!r}: expected {rule[1]}")
    budgets = config.rehearsal.budgets
    if isinstance(budgets, (tuple, list)) and config.rehearsal.table_budget not in budgets:
        problems.append(
            f"config.rehearsal.table_budget = {config.rehearsal.table_budget}: expected one of "
            f"config.rehearsal.budgets {tuple(budgets)}"
        )
    if sum(config.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) > 1:
        problems.append("config.mesh: at most one of data/fsdp/tensor may be -1")
    if problems:
        raise ConfigError("; ".join(problems))
    step_configs(config)
    _check_update_chunks(config)
    return config


def _check_update_chunks(config: ml_collections.ConfigDict) -> None:
    """Each update splits its rows into mini_batches x micro_batches equal chunks; a count
    that does not divide would otherwise fail at the first step of its phase, after the work
    before it (a whole warm start, for the RL step)."""
    r, s = config.rollout, config.schedule
    batches = (
        ("sft", s.sft_batch_size, "config.schedule.sft_batch_size"),
        ("grpo", r.group_size * r.tasks_per_step, "config.rollout.group_size x tasks_per_step"),
    )
    problems = []
    for section, rows, what in batches:
        mini, micro = config[section].mini_batches, config[section].micro_batches
        if problem := chunking_problem(rows, mini, micro, section):
            problems.append(f"{what} = {rows} rows {problem}")
    if problems:
        raise ConfigError("; ".join(problems))
