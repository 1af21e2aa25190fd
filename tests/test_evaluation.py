"""The held-out evaluation protocol (`envace_jax.train.evaluation`) on the shipped demo base policy,
which solves some tasks and fails others: avg@4 is the mean of four seeded sampled evaluations
at the configured temperature and top_p, the standard errors follow the binomial formula
(greedy) and the per-task one (avg@4), and the headroom scores agree with the runs they
summarise."""

import functools
import math

import jax
import numpy as np
import pytest

from envace_jax.configuration import base_config
from envace_jax.envs.demo import DemoEnv, generate_tasks
from envace_jax.rollout.world_rehearsal import rehearsal_rollouts
from envace_jax.runtime.build import build_mesh, build_model
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.text import load_tokenizer
from envace_jax.train.evaluation import AVG_SAMPLES, committed_runs, evaluate, headroom

N_TASKS = 12


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer("demo")
    config = base_config()
    config.model.hf_path = "demo-base"
    config.eval.fidelity_tasks = 0
    config.eval.max_new_tokens = 256
    mesh = build_mesh(config)
    model = build_model(config, tok, mesh)
    spec = turn_spec(tok, mode="host", max_turns=6, max_message_tokens=128)
    sampler = Sampler(model, spec, pad_id=tok.pad_token_id)
    tasks = generate_tasks(5, N_TASKS, "validation")
    return tok, config, mesh, sampler, tasks


def _runs(setup, key, sampling):
    tok, config, mesh, sampler, tasks = setup
    results = committed_runs(
        sampler, tok, tasks, DemoEnv, mesh, key=key, sampling=sampling, max_new_tokens=256
    )
    return np.asarray([r.success for r in results], float)


@pytest.mark.slow  # five sampled evaluations of a random Qwen3 over the demo tasks
def test_avg4_is_the_mean_of_four_seeded_sampled_evaluations(setup):
    tok, config, mesh, sampler, tasks = setup
    key = jax.random.key(11)
    rehearse = functools.partial(rehearsal_rollouts, sampler, tok)
    ev = evaluate(sampler, rehearse, tok, tasks, DemoEnv, mesh, config.eval, (256, 512), key)
    sampling = SamplingParams(temperature=0.6, top_p=0.95)
    assert (config.eval.temperature, config.eval.top_p) == (0.6, 0.95)  # the reference's
    per_seed = [_runs(setup, jax.random.fold_in(key, 1 + s), sampling) for s in range(4)]
    assert AVG_SAMPLES == 4
    per_task = np.mean(per_seed, axis=0)
    assert ev.success_avg4 == pytest.approx(np.mean([p.mean() for p in per_seed]))
    # Standard error over tasks of the per-task mean success.
    mean = per_task.mean()
    want_se = math.sqrt(sum((x - mean) ** 2 for x in per_task) / N_TASKS / N_TASKS)
    assert ev.success_avg4_se == pytest.approx(want_se)
    greedy = _runs(setup, key, SamplingParams(greedy=True))
    p = greedy.mean()
    assert 0 < p < 1, "the fixture needs tasks the policy solves and tasks it fails"
    assert ev.success == pytest.approx(p)
    assert ev.success_se == pytest.approx(math.sqrt(p * (1 - p) / N_TASKS))  # binomial
    # Per-family scores average to the overall ones, weighted by family size.
    counts = {f: sum(t.metadata["family"] == f for t in tasks) for f in ev.by_family}
    total = sum(counts[f] * ev.by_family_avg4[f] for f in counts) / N_TASKS
    assert total == pytest.approx(ev.success_avg4)
    # So do the per-stratum ones.
    counts = {s: sum(t.metadata["stratum"] == s for t in tasks) for s in ev.by_stratum}
    assert set(counts) == {"hidden", "visible"}
    total = sum(counts[s] * ev.by_stratum[s] for s in counts) / N_TASKS
    assert total == pytest.approx(ev.success)
    # A greedy-only evaluation (a point of a learning curve) has the same greedy scores.
    curve = evaluate(
        sampler, rehearse, tok, tasks, DemoEnv, mesh, config.eval, (256, 512), key, greedy_only=True
    )
    assert curve.success == ev.success and curve.by_stratum == ev.by_stratum
    assert math.isnan(curve.success_avg4) and "success_avg4" not in curve.as_dict()


@pytest.mark.slow  # greedy and eight samples per task
def test_headroom_pass_at_k_bounds(setup):
    tok, config, mesh, sampler, tasks = setup
    key = jax.random.key(3)
    sampling = SamplingParams(temperature=1.0)
    out = headroom(
        sampler,
        tok,
        tasks,
        DemoEnv,
        mesh,
        key=key,
        sampling=sampling,
        samples=3,
        max_new_tokens=256,
    )
    runs = np.stack([_runs(setup, jax.random.fold_in(key, 1 + s), sampling) for s in range(3)])
    assert out["all"]["pass@1"] == pytest.approx(runs.mean())
    assert out["all"]["pass@k"] == pytest.approx(runs.max(axis=0).mean())
    assert out["all"]["greedy"] == pytest.approx(
        _runs(setup, key, SamplingParams(greedy=True)).mean()
    )
    for family, r in out.items():
        assert r["pass@1"] <= r["pass@k"] + 1e-9, family
    families = [r for f, r in out.items() if f != "all" and not f.startswith("stratum ")]
    strata = [r for f, r in out.items() if f.startswith("stratum ")]
    assert sum(r["tasks"] for r in families) == sum(r["tasks"] for r in strata) == N_TASKS
    assert len(strata) == 2


@pytest.mark.slow  # a smoke train job, then the headroom job on its workdir
def test_headroom_job_on_a_trained_workdir(tmp_path):
    """The headroom job reads a train job's workdir and writes its table and JSON: one row per
    (family, policy), the trained policy beside the warm start when RL ran."""
    import json

    from envace_jax.configuration import validate
    from envace_jax.jobs import run
    from tests.conftest import demo_config

    config = validate(demo_config("smoke"))
    run(config, str(tmp_path))
    config.job, config.eval.pass_k = "headroom", 2
    out = run(validate(config), str(tmp_path))
    assert set(out["policies"]) == {"warm start", "step 6"}
    saved = json.loads((tmp_path / "headroom.json").read_text())
    assert saved["pass_k"] == 2 and saved["policies"] == out["policies"]
    for result in out["policies"].values():
        assert result["all"]["tasks"] == config.data.eval_tasks
        r = result["all"]
        assert 0 <= r["greedy"] <= 1 and r["pass@1"] <= r["pass@k"]
    table = (tmp_path / "headroom.md").read_text()
    assert "| all | warm start |" in table and "pass@2" in table
