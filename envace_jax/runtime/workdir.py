"""A run's directory: what the train job writes there and what other jobs read back from it.

    <workdir>/
      checkpoints/<step>/         train state, rotating (`schedule.checkpoint_dir` when set; a
                                  relative one is relative to the workdir)
      checkpoints/warm_start/<S>/ the warm start's params, kept apart from the rotation
      export/, export_rehearse/   HF safetensors of the acting policy (and of a trained rehearser)
      metrics.jsonl, tensorboard/, curves.png, summary.md, summary.json   (`metrics`, `report`)

`RunDir` is the train job's side (save, resume, keep the warm start, export). The readers, a
train job that starts from another run's warm start and the jobs that evaluate a trained
workdir (`rehearsal_eval`, `headroom`), find a warm start with `find_warm_start`, restore a
checkpoint with `checkpoint_target`, and refuse an incompatible run with `config_differences`.

The kept warm start lives inside the run's checkpoint directory, which belongs to one run: runs
whose checkpoint directories share a parent never touch each other's copy. Runs written before
this layout kept it in `<workdir>/warm_start/`, where readers still look.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from envace_jax import knobs, modes
from envace_jax.configuration import JobConfig
from envace_jax.models.hf_io import save_hf_model
from envace_jax.rl.optim import OptimConfig, make_optimizer
from envace_jax.rl.steps import TrainState, make_shardings
from envace_jax.runtime import checkpoint as ckpt_lib

CHECKPOINTS = "checkpoints"
WARM_START_DIR = "warm_start"
_READ_ONLY_KEEP = 1_000_000  # a reader never rotates another run's checkpoints away

ARCH_KEYS = ("tokenizer", "model")  # what makes a run's params load into this config's model
# What makes two warm starts the same computation (the seed may differ: it then seeds the RL
# phase and the held-out tasks only).
_DEMOS = ("env", "train_tasks", "failure_demos", "unfinished_demos", "default_action_demos")
_DEMOS += ("train_files", "skip_invalid", "max_prompt_tokens")  # which tasks, from files
WARM_START_KEYS = (*ARCH_KEYS, "sft", "sft_optim", "rehearsal.sft_memory_fraction")
WARM_START_KEYS += ("rehearsal.sft_memory_swaps",)
WARM_START_KEYS += ("schedule.sft_steps", "schedule.sft_batch_size", "data.simulator_demos")
WARM_START_KEYS += tuple(f"data.{k}" for k in _DEMOS)
# What makes two evaluations of the same params the same (fidelity is measured in the run's
# rehearsal view).
EVAL_KEYS = ("seed", "eval", "rollout.rehearsal_view", "data.env", "data.eval_tasks")
EVAL_KEYS += ("data.eval_split", "data.eval_files", "judge")


def use_compile_cache(root: str) -> None:
    """Keeps compiled programs in `root`/jax_cache, so a rerun on the same directory (a resumed
    job, another job on a train workdir, the runs of a comparison) loads them instead of
    compiling again. Programs that compile in under a second are not kept."""
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    # A program the cache cannot keep (a full disk, a workdir made read-only) still runs; the
    # job's own writes name such a workdir.
    warnings.filterwarnings("ignore", "Error writing persistent compilation cache", UserWarning)


def config_json(config: JobConfig) -> dict[str, Any]:
    """The config as checkpoint meta saves it (tuples become lists, as JSON has them)."""
    return json.loads(json.dumps(knobs.as_dict(config)))


def config_differences(ours: dict, theirs: dict, keys: Sequence[str]) -> list[str]:
    """`key=their value` for every dotted key in `keys` whose value differs between two saved
    configs; a section that differs is named entry by entry (`model.hidden_size=64`). A key
    their config lacks is at its default: it was saved before the knob existed, and a new
    knob's default is the behaviour from before it."""

    def get(d: dict, key: str):
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    theirs = _with_defaults(theirs, config_json(JobConfig()))
    differ = []
    for key in keys:
        a, b = get(ours, key), get(theirs, key)
        if isinstance(a, dict) and isinstance(b, dict):
            differ += [f"{key}.{k}={b.get(k)!r}" for k in {**a, **b} if a.get(k) != b.get(k)]
        elif a != b:
            differ.append(f"{key}={b!r}")
    return differ


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved`, with each key it lacks (at any depth) taken from `defaults`."""
    out = dict(defaults)
    for k, v in saved.items():
        nested = isinstance(v, dict) and isinstance(defaults.get(k), dict)
        out[k] = _with_defaults(v, defaults[k]) if nested else v
    return out


# ------------------------------------------------------------------------ restore targets


def abstract_train_state(params: Any, tx, shardings: TrainState) -> TrainState:
    """The restore target of a TrainState of `params` with optimizer `tx`: ShapeDtypeStructs
    placed by `shardings` (a TrainState of shardings, `StepShardings.state`)."""
    shapes = jax.eval_shape(
        lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p)),
        params,
    )
    return jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x), shapes, shardings
    )


def phase_at(step: int, sft_steps: int, rl_steps: int) -> str:
    """The phase whose optimizer a train job's state at global `step` carries: 'sft' or 'rl'
    (step sft_steps opens the RL phase; a run without RL keeps the warm start's to the end)."""
    return "sft" if step < sft_steps or rl_steps == 0 else "rl"


def checkpoint_target(params: Any, mesh) -> Callable[[int, dict], TrainState]:
    """A restore target for a single-policy train-job checkpoint: a TrainState of `params`'s
    layout with the optimizer of its phase, built from the config saved with it."""

    def target(step: int, meta: dict) -> TrainState:
        cfg = meta.get("config") or {}
        s = cfg.get("schedule", {})
        trains = modes.lookup(cfg.get("mode", "envace")).has_rl
        phase = phase_at(step, s.get("sft_steps", 0), s.get("rl_steps", 0) if trains else 0)
        section = "sft_optim" if phase == "sft" else "optim"
        try:
            tx = make_optimizer(OptimConfig.from_config(cfg.get(section, {}), section))
        except ValueError as e:
            raise ValueError(f"checkpoint step {step}: its config.{section}: {e}") from e
        return abstract_train_state(params, tx, make_shardings(mesh, params, tx, (1, 8)).state)

    return target


def params_target(params: Any, mesh) -> Any:
    """A restore target for params alone (the kept warm start), placed as the train step's."""
    tx = make_optimizer(OptimConfig())
    return abstract_train_state(params, tx, make_shardings(mesh, params, tx, (1, 8)).state).params


# ------------------------------------------------------------------- another run's output


def run_dirs(path: str) -> tuple[str, str] | None:
    """(checkpoints directory, workdir) of `path`, a run's workdir or its checkpoint directory
    (checkpoints/, or a `schedule.checkpoint_dir` of another name holding steps or a kept warm
    start); None when it is neither."""
    root = os.path.abspath(path)
    if os.path.isdir(os.path.join(root, CHECKPOINTS)):
        return os.path.join(root, CHECKPOINTS), root
    if not os.path.isdir(root):
        return None
    names = os.listdir(root)
    if os.path.basename(root) == CHECKPOINTS or WARM_START_DIR in names:
        return root, os.path.dirname(root)
    if any(n.isdigit() and os.path.isdir(os.path.join(root, n)) for n in names):
        return root, os.path.dirname(root)
    return None


@dataclasses.dataclass(frozen=True)
class WarmStart:
    step: int  # the global step it ended on
    params: Any
    meta: dict  # as saved: the run's `config` and its evaluation `sft_eval`
    source: str  # the directory and step it was read from


def find_warm_start(path: str, sft_steps: int | None, params: Any, mesh, where: str) -> WarmStart:
    """The warm start of the run at `path` (a workdir or its checkpoints/), at global step
    `sft_steps` (None: the kept copy's step). `params` gives the layout, `where` prefixes errors.

    Precedence: the copy in warm_start/ first, as it is exactly the warm start's params and
    never rotated away; then the checkpoint at step sft_steps. An unreadable candidate is
    skipped with a warning; ValueError names every candidate when none gives a warm start."""
    dirs = run_dirs(path)
    if dirs is None:
        raise ValueError(
            f"{where}: no checkpoint at the end of a {sft_steps}-step warm start: {path} is "
            f"neither a train job's workdir nor its {CHECKPOINTS}/ directory"
        )
    checkpoints, root = dirs
    problems = []
    kept = kept_warm_start_dir(checkpoints, root)
    candidates = [(kept, lambda: params_target(params, mesh))]
    candidates.append((checkpoints, lambda: checkpoint_target(params, mesh)))
    for directory, target in candidates:
        if not os.path.isdir(directory):
            problems.append(f"no {kept} (a train job keeps its warm start there)")
            continue
        with ckpt_lib.Checkpointer(directory, keep=_READ_ONLY_KEEP) as ckpt:
            step, steps = sft_steps, ckpt.all_steps()
            if step is None and directory == kept:
                step = ckpt.latest_step()
            if step is None or step not in steps:
                problems.append(f"{directory} has no step {step} (found steps {steps})")
                continue
            try:
                _, restored, meta = ckpt.restore(target(), step=step)
            except ckpt_lib.CheckpointError as e:
                problems.append(f"the checkpoint there is unreadable: {e}")
                print(f"warning: {where}: {problems[-1]}; trying the next candidate")
                continue
        got = restored if directory == kept else restored.params
        return WarmStart(step, got, meta, f"{directory}/{step}")
    raise ValueError(
        f"{where}: no checkpoint at the end of a {sft_steps}-step warm start "
        f"({'; '.join(problems)}; a run with rl_steps=0 or mode='sft_only' ends on one, and "
        "schedule.keep_checkpoints keeps it)"
    )


def kept_warm_start_dir(checkpoints: str, root: str) -> str:
    """Where the run with `checkpoints` (workdir `root`) kept its warm start: inside its
    checkpoint directory, or `<root>/warm_start/` for a run written before that layout."""
    path = os.path.join(checkpoints, WARM_START_DIR)
    older = os.path.join(root, WARM_START_DIR)
    return older if not os.path.isdir(path) and os.path.isdir(older) else path


def checkpoint_dir(config: JobConfig, workdir: str) -> str:
    """The run's checkpoint directory: `schedule.checkpoint_dir` (a relative path is taken
    relative to the workdir, never to the current directory, so that a rerun from elsewhere
    resumes the same run), or `<workdir>/checkpoints`."""
    path = config.schedule.checkpoint_dir.rstrip("/")
    if not path:
        return os.path.join(workdir, CHECKPOINTS)
    return path if "://" in path else os.path.join(workdir, path)


# ------------------------------------------------------------------------ the train job's


class RunDir:
    """The train job's checkpoints, kept warm start and exports."""

    def __init__(self, config: JobConfig, workdir: str):
        s = config.schedule
        self.path = workdir
        self.config = config_json(config)
        # Checkpoints (and the kept warm start inside them) go where every process can write:
        # schedule.checkpoint_dir (e.g. gs://...) when the processes have a workdir each.
        checkpoints = checkpoint_dir(config, workdir)
        self.warm_start_dir = kept_warm_start_dir(checkpoints, workdir)
        self.checkpointer = ckpt_lib.Checkpointer(checkpoints, keep=s.keep_checkpoints)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.checkpointer.save(step, state, dict(meta, global_step=step, config=self.config))

    def latest(self, target) -> tuple[int, Any, dict[str, Any]]:
        """The newest readable checkpoint (a corrupt one is skipped with a warning, in step
        with every process of a multi-host run), or (0, None, {}) when there is none."""
        if self.checkpointer.latest_step() is None:
            return 0, None, {}
        return self.checkpointer.restore(target)

    def warm_start_of(
        self, workdir: str, sft_steps: int, params: Any, mesh
    ) -> tuple[WarmStart, dict[str, Any]]:
        """The finished warm start of the run at `workdir` (`find_warm_start`) and the meta
        this run starts from: its evaluation is reused when this run evaluates the same way
        (same seed and eval settings). Raises naming what does not match this run's config."""
        where = f"config.schedule.warm_start_dir={workdir!r}"
        if not os.path.isdir(workdir):
            raise ValueError(f"{where}: no such directory")
        found = find_warm_start(workdir, sft_steps, params, mesh, where)
        theirs = found.meta.get("config", {})
        if differ := config_differences(self.config, theirs, WARM_START_KEYS):
            raise ValueError(f"{where}: that warm start was run with other {', '.join(differ)}")
        meta = {"warm_start_dir": workdir}
        if not config_differences(self.config, theirs, EVAL_KEYS):
            meta["warm_start_eval"] = found.meta["sft_eval"]
        return found, meta

    def keep_warm_start(self, step: int, params: Any, meta: dict[str, Any]) -> None:
        """Saves the warm-start params (global step `step`) in the checkpoint directory's
        warm_start/, apart from the rotating checkpoints: test-time rehearsal evaluates them as
        a rehearser, and other runs start from them."""
        keeper = ckpt_lib.Checkpointer(self.warm_start_dir, keep=1, async_save=False)
        try:
            keeper.save(step, params, {**meta, "phase": "warm_start", "config": self.config})
        finally:
            keeper.close()

    def kept_warm_start(self, step: int, target: Any, why: str) -> Any:
        """The params kept by `keep_warm_start` at `step`; `why` names who needs them."""
        if not os.path.isdir(self.warm_start_dir):
            raise ValueError(
                f"{why} needs the warm start kept in {self.warm_start_dir} "
                "(config.rehearsal.keep_warm_start=True)"
            )
        with ckpt_lib.Checkpointer(self.warm_start_dir, keep=1) as keeper:
            return keeper.restore(target, step=step)[1]

    def export(self, name: str, model, tokenizer) -> None:
        """HF safetensors of `model` (an nnx module) in `<workdir>/<name>/`."""
        save_hf_model(model, model.cfg, os.path.join(self.path, name), tokenizer=tokenizer)

    def close(self) -> None:
        self.checkpointer.close()
