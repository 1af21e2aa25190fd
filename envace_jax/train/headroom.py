"""Headroom of a trained workdir's policies: can RL move held-out success at all?

    python -m envace_jax.main --config configs/demo.py:headroom --workdir workdir/demo

Run on a train job's workdir (or `--config.rehearsal.checkpoint_dir=<its workdir>`). For the
warm-start policy and, when RL ran, the latest checkpoint's, on the held-out tasks the train
job evaluates (`data.eval_tasks` of `data.eval_split`, the job's seed): greedy success, and
sampled pass@1 and pass@k (`eval.pass_k` samples per task at the RL rollouts'
`rollout.temperature` and `rollout.top_p`), overall, per task family and per stratum. GRPO
learns only from groups whose rewards differ, so a family whose pass@k is 0 gives it nothing
to reinforce, and pass@k - greedy bounds what sharpening the sampled policy can add. Writes
`headroom.md` and `headroom.json`.
"""

from __future__ import annotations

import json
import os
import time

import jax

from envace_jax.configuration import JobConfig
from envace_jax.envs.registry import domain
from envace_jax.runtime.metrics import table
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.testtime.rehearsal_eval import workdir_policies
from envace_jax.train.evaluation import headroom


def headroom_table(by_policy: dict[str, dict[str, dict[str, float]]], k: int) -> str:
    """One row per (task family, policy): tasks, greedy, pass@1, pass@k, pass@k - greedy."""
    rows = []
    for name, result in by_policy.items():
        order = lambda kv: (kv[0] == "all", kv[0].startswith("stratum"), kv[0])
        for family, r in sorted(result.items(), key=order):
            gap = r["pass@k"] - r["greedy"]
            rows.append([family, name, r["tasks"], r["greedy"], r["pass@1"], r["pass@k"], gap])
    header = ["task family", "policy", "tasks", "greedy", "pass@1", f"pass@{k}", "gap"]
    return table(rows, header)


def run(config: JobConfig, workdir: str) -> dict:
    t0 = time.time()
    mesh, tokenizer, model, policies, info = workdir_policies(config, workdir)
    chosen = {"warm start": policies["warm-start"]}
    if info["trained_step"] != info["warm_start_step"]:
        chosen[f"step {info['trained_step']}"] = policies["EnvACE"]
    r = config.rollout
    spec = turn_spec(
        tokenizer, mode="host", max_turns=r.max_turns, max_message_tokens=r.max_message_tokens
    )
    sampler = Sampler(model, spec, pad_id=tokenizer.pad_token_id)
    env_domain = domain(config.data.env, config.data)
    tasks = env_domain.held_out_tasks(config)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p)
    k = config.eval.pass_k
    key = jax.random.fold_in(jax.random.key(config.seed), 7)
    by_policy = {}
    for name, p in chosen.items():
        print(f"[headroom] {name}: {len(tasks)} tasks, greedy + {k} samples each", flush=True)
        by_policy[name] = headroom(
            sampler.with_params(p),
            tokenizer,
            tasks,
            env_domain.make_env,
            mesh,
            key=key,
            sampling=sampling,
            samples=k,
            max_new_tokens=config.eval.max_new_tokens,
        )
    text = headroom_table(by_policy, k)
    note = (
        f"Held-out tasks: {len(tasks)} ({config.data.eval_split} split, seed {config.seed}); "
        f"sampled at temperature {r.temperature}, top_p {r.top_p}; gap = pass@{k} - greedy."
    )
    with open(os.path.join(workdir, "headroom.md"), "w") as f:
        f.write(f"{note}\n\n{text}\n")
    out = {"info": info, "pass_k": k, "temperature": r.temperature, "policies": by_policy}
    with open(os.path.join(workdir, "headroom.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{note}\n\n{text}\n\nwrote {workdir}/headroom.md, headroom.json")
    print(f"total time {time.time() - t0:.0f}s")
    return out
