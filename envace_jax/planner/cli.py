"""Memory planner: will this job fit on this TPU slice? Answered before anything is allocated.

    python -m envace_jax.planner --config configs/qwen3_8b.py --topology v5p-32
    python -m envace_jax.planner --config configs/qwen3_1p7b.py:v5e-8 --topology v5e-8 \
        --config.grpo.micro_batches=64

Prints, per device, the bytes of the parameters, optimizer state, gradients, activations (with
the config's remat policy) and the sampler's KV cache for every phase of the job (warm-start
step, RL step, rollouts, evaluation), then a verdict. Exit status: 0 fits, 1 does not fit (the
message names the largest component and what to change), 2 the config or topology is invalid.

The config is read and validated exactly as `envace_jax.main` reads it (same flags and
overrides); the model's architecture comes from `model.hf_path/config.json` when that directory
exists here, else from `model.preset`. No JAX device is touched: shapes and shardings are
computed on an abstract mesh (see `envace_jax.planner.estimate` for the memory model).
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from envace_jax import parallel
from envace_jax.configuration import ConfigError, validate
from envace_jax.planner import estimate
from envace_jax.planner.topology import GIB, parse_topology

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Job config file (`path.py` or `path.py:variant`).", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-32, v5e-8, v6e-8.")
_HBM = flags.DEFINE_float("hbm_gib", None, "Override the HBM per chip (GiB).")
_USABLE = flags.DEFINE_float(
    "usable", 0.9, "Fraction of HBM the job may plan to use (the rest: runtime, fragmentation)."
)
_PROMPT = flags.DEFINE_integer(
    "prompt_tokens",
    None,
    "Longest prompt in tokens (default: the largest length bucket minus rollout.max_new_tokens).",
)


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def report(config, topology, *, usable: float = 0.9, prompt_tokens: int | None = None):
    """(text, fits): the breakdown of every phase and the verdict for `config` on `topology`."""
    sizes = parallel.mesh_sizes(config.mesh, topology.devices)
    mesh = estimate.abstract_mesh(sizes)
    cfg = estimate.model_config(config)
    phases = estimate.plan_phases(config, cfg, mesh, prompt_tokens=prompt_tokens)
    budget = usable * topology.hbm_bytes
    out = [
        f"model: {cfg.family} {cfg.num_params / 1e9:.2f}B parameters ({cfg.num_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), params {cfg.param_dtype}, "
        f"compute {cfg.dtype}, remat {cfg.remat}",
        f"topology: {topology.describe()}",
        "mesh: " + " x ".join(f"{a}={n}" for a, n in sizes.items()),
        "",
    ]
    for phase in phases:
        shown = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in phase.shapes.items())
        out.append(f"{phase.name} ({shown})")
        for line in phase.lines:
            note = f"  {line.note}" if line.note else ""
            out.append(f"  {line.name:<26}{_gib(line.bytes)}{note}")
        out.append(f"  {'= total per device':<26}{_gib(phase.total)}")
        out.append("")
    peak = max(phases, key=lambda p: p.total)
    biggest = max(peak.lines, key=lambda line: line.bytes)
    fits = peak.total <= budget
    share = f"{peak.total / topology.hbm_bytes:.0%} of {topology.hbm_bytes / GIB:.0f} GiB HBM"
    if fits:
        out.append(
            f"verdict: FITS. Peak {peak.total / GIB:.2f} GiB per device in the {peak.name} "
            f"phase ({share}; the plan allows {usable:.0%})."
        )
    else:
        out.append(
            f"verdict: DOES NOT FIT. The {peak.name} phase needs {peak.total / GIB:.2f} GiB per "
            "device "
            f"({share}; the plan allows {usable:.0%} = {budget / GIB:.2f} GiB). Largest "
            f"component: {biggest.name} {biggest.bytes / GIB:.2f} GiB. {_advice(biggest.name)}"
        )
    return "\n".join(out), fits


def _advice(component: str) -> str:
    if component.startswith("activations"):
        return (
            "Raise grpo.micro_batches / sft.micro_batches (fewer rows per device at once), use "
            "model.remat='full', shard heads over mesh.tensor, or shorten "
            "rollout.length_buckets."
        )
    if component in ("KV cache", "working set", "token buffers"):
        return (
            "Fewer rows per sampler call (rollout.tasks_per_step, data.eval_tasks), shorter "
            "rollout/eval max_new_tokens, or a larger slice (the cache splits over data x fsdp "
            "rows and tensor KV heads)."
        )
    return "Use a larger slice or more mesh.fsdp (parameters and optimizer state split over it)."


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _CONFIG.value is None or not _TOPOLOGY.value:
        raise app.UsageError("--config and --topology are required")
    try:
        config = validate(_CONFIG.value)
        topology = parse_topology(_TOPOLOGY.value, _HBM.value)
        if not 0 < _USABLE.value <= 1:
            raise ValueError(f"--usable={_USABLE.value}: expected a fraction in (0, 1]")
        text, fits = report(config, topology, usable=_USABLE.value, prompt_tokens=_PROMPT.value)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)
    sys.exit(0 if fits else 1)


def cli():
    app.run(main)


if __name__ == "__main__":
    cli()
