"""The job configuration: defaults for every knob, and validation before anything is compiled.

Config files (`configs/*.py`) start from `base_config()` and change values; they never add keys.
`validate(config)` compares a config against the defaults' key tree and value rules and raises
`ConfigError` naming the key, so a typo or a bad value fails in milliseconds, not after a compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value outside its range."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # Seeds parameter init, data order and sampling.
    c.tokenizer = "demo"  # 'demo' (shipped byte-level BPE) or a local HF tokenizer directory.

    c.model = ml_collections.ConfigDict()
    c.model.preset = "demo-qwen3"  # Name in envace_jax.models.PRESETS, used when hf_path is empty.
    c.model.hf_path = ""  # Local HF checkpoint dir (config.json + *.safetensors); overrides preset.
    c.model.param_dtype = "float32"  # 'float32' on CPU; 'bfloat16' on TPU.
    c.model.dtype = "float32"  # Compute dtype.
    c.model.remat = "none"  # Per-layer rematerialisation: 'none', 'full' or 'dots'.

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # Data-parallel axis size; -1 takes the devices left over.
    c.mesh.fsdp = 1  # Parameter/optimizer-state sharding axis size.
    c.mesh.tensor = 1  # Tensor-parallel axis size.

    c.generate = ml_collections.ConfigDict()
    c.generate.max_new_tokens = 48  # Tokens decoded by the sample run at the end of the job.
    c.generate.instruction = "What is the balance of account A3?"  # Sample user message.
    return c


# Value rules: key path -> (predicate, description of what is allowed).
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "tokenizer": (lambda v: isinstance(v, str) and v != "", "'demo' or a tokenizer directory"),
    "model.preset": (lambda v: isinstance(v, str), "a preset name"),
    "model.hf_path": (lambda v: isinstance(v, str), "a directory path or ''"),
    "model.param_dtype": (lambda v: v in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    "model.dtype": (lambda v: v in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    "model.remat": (lambda v: v in ("none", "full", "dots"), "'none', 'full' or 'dots'"),
    "mesh.data": (lambda v: isinstance(v, int) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
    "mesh.fsdp": (lambda v: isinstance(v, int) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
    "mesh.tensor": (lambda v: isinstance(v, int) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
    "generate.max_new_tokens": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "generate.instruction": (lambda v: isinstance(v, str) and v.strip() != "", "non-empty text"),
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


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every key and value of `config`; returns it unchanged or raises ConfigError."""
    given = _flatten(config)
    known = _flatten(base_config())
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    missing = sorted(set(known) - set(given))
    if missing:
        raise ConfigError(f"config is missing key(s): {', '.join(missing)}")
    problems = []
    for path, value in given.items():
        rule = _RULES.get(path)
        if rule is not None and not rule[0](value):
            problems.append(f"config.{path} = {value!r}: expected {rule[1]}")
    if sum(config.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) > 1:
        problems.append("config.mesh: at most one of data/fsdp/tensor may be -1")
    if problems:
        raise ConfigError("; ".join(problems))
    return config
