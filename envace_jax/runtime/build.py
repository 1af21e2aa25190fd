"""Builds the job's pieces from a validated config: mesh, tokenizer, policy model."""

from __future__ import annotations

import os

import jax
from flax import nnx

from envace_jax import parallel
from envace_jax.configuration import JobConfig
from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.models.hf_io import load_hf_model
from envace_jax.models.shipped import resolve_hf_path
from envace_jax.text.tokenizer import load_tokenizer


def build_mesh(config: JobConfig) -> jax.sharding.Mesh:
    return parallel.make_mesh(
        {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}
    )


def build_tokenizer(config: JobConfig):
    return load_tokenizer(config.tokenizer)


def build_model(config: JobConfig, tokenizer, mesh=None) -> Decoder:
    """The policy: an HF checkpoint (`model.hf_path`) or a freshly initialised preset whose
    vocabulary is sized to the tokenizer. Parameters are placed by the logical-axis rules."""
    m = config.model
    numerics = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
    if m.hf_path:
        path = resolve_hf_path(m.hf_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"config.model.hf_path: no directory {m.hf_path!r}")
        model, cfg = load_hf_model(path, mesh=mesh, **numerics)
        if cfg.vocab_size < len(tokenizer):
            raise ValueError(
                f"config.model.hf_path: the checkpoint's vocab_size {cfg.vocab_size} is smaller "
                f"than the tokenizer's {len(tokenizer)} ids"
            )
        return model
    cfg = get_preset(
        m.preset,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **numerics,
    )
    model = Decoder(cfg, rngs=nnx.Rngs(config.seed))
    if mesh is not None:
        parallel.shard_model(model, mesh)
    return model
