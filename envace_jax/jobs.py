"""What `envace_jax.main` runs once the config is validated."""

from __future__ import annotations

import os
import time

import jax
import ml_collections
from absl import logging

from envace_jax.build import build_mesh, build_model, build_tokenizer
from envace_jax.envs.demo import generate_tasks
from envace_jax.models.hf_io import save_hf_model
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.role_pieces import prompt_ids

_ROLE_MARKS = {0: " ", 1: "A", 2: "R"}


def run(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Sample run: world-rehearsal decoding of held-out demo tasks with the configured policy,
    then an HF export of the policy to `workdir/export`."""
    t0 = time.time()
    mesh = build_mesh(config)
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer, mesh)
    cfg = model.cfg
    logging.info("policy: %s, %.2fM params, mesh %s", cfg.family, cfg.num_params / 1e6, mesh.shape)

    tasks = generate_tasks(config.seed, 4, split="validation")
    prompts = [prompt_ids(tokenizer, t.messages, t.tools) for t in tasks]
    spec = turn_spec(tokenizer, mode="rehearse", max_turns=4, max_message_tokens=64)
    sampler = Sampler(model, spec, pad_id=tokenizer.pad_token_id)
    out = sampler.generate(
        prompts,
        key=jax.random.key(config.seed),
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=config.generate.max_new_tokens,
    )
    for b, task in enumerate(tasks):
        n, p = int(out.lengths[b]), len(prompts[b])
        text = tokenizer.decode(out.tokens[b, p:n].tolist())
        roles = "".join(_ROLE_MARKS[int(r)] for r in out.roles[b, p:n])
        print(f"[{task.task_id}] status={int(out.status[b])} new_tokens={n - p}")
        print(f"  roles (A=ACT, R=REHEARSE, blank=glue): {roles}")
        print(f"  text: {text!r}")

    export = os.path.join(workdir, "export")
    save_hf_model(model, cfg, export, tokenizer=tokenizer)
    print(f"exported the policy to {export} ({time.time() - t0:.1f}s in all)")
