"""The comparison command: its plan, statistics and verdicts (hand-computed), and one end-to-end
run on the smoke config."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

from envace_jax.experiments import compare, verdicts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_runs_every_mode_and_seed_with_the_warm_start_first():
    runs = compare.plan(3)
    main, small = list(verdicts.SIZES)
    assert {(m, s) for size, m, s in runs if size == main} == {
        (m, s) for m in verdicts.ARMS for s in range(3)
    }
    assert {m for size, m, _ in runs if size == small} == set(verdicts.SCALE_MODES)
    for size in verdicts.SIZES:
        assert [r for r in runs if r[0] == size][0] == (size, "sft_only", 0)


def test_parse_overrides():
    got = compare.parse_overrides(["rollout.group_size=8", "model.preset=tiny-qwen3", "a.b=(1, 2)"])
    assert got == {"rollout.group_size": 8, "model.preset": "tiny-qwen3", "a.b": (1, 2)}
    with pytest.raises(ValueError, match="key=value"):
        compare.parse_overrides(["rollout.group_size"])


def _result(size, mode, seed, success):
    r = {k: 0.0 for k in (*verdicts.METRICS, "rl_tokens", "rl_seconds", "seconds")}
    r.update(success=success, success_avg4=success)  # the claims are judged on avg@4
    return {**r, "size": size, "mode": mode, "seed": seed, "params": 10}


def test_summary_and_verdicts_against_hand_computed_numbers():
    main, small = list(verdicts.SIZES)
    succ = {
        (main, "envace"): [0.5, 0.6, 0.7],
        (main, "grpo_real_env"): [0.1, 0.3, 0.2],
        (main, "external_simulator"): [0.6, 0.6, 0.9],
        (main, "envace_noshare"): [0.45, 0.65, 0.7],
        (main, "sft_only"): [0.1, 0.1, 0.1],
        (small, "envace"): [0.2, 0.3, 0.4],
        (small, "grpo_real_env"): [0.1, 0.3, 0.2],
    }
    results = [_result(sz, m, i, v) for (sz, m), vs in succ.items() for i, v in enumerate(vs)]
    summary = verdicts.summarize(results)
    s = summary[(main, "envace")]
    assert s["success"] == pytest.approx(0.6) and s["success_std"] == pytest.approx(0.1)
    judged = {c: (m, v) for c, m, v in verdicts.claims(summary)}
    # Paired by seed: envace - grpo_real_env = (0.4, 0.3, 0.5), mean 0.4, std 0.1, s.e. 0.1/sqrt(3)
    # = 0.0577 -> supported. Unpaired, the s.e. would be sqrt(0.01/3 + 0.01/3) = 0.0816.
    m, v = judged["world rehearsal beats standard RL in the real environment"]
    assert v == "supported" and "+0.400" in m and "0.058" in m
    # grpo_real_env - sft_only = (0.0, 0.2, 0.1): mean 0.1, s.e. 0.0577 < half of it.
    m, v = judged["RL in the real environment improves on the warm start"]
    assert v == "not resolved" and "avg@4 +0.100 (s.e. 0.058)" in m
    # envace - external_simulator = (-0.1, 0.0, -0.2): mean -0.1, s.e. 0.0577 -> within noise.
    m, v = judged["world rehearsal beats training against an external simulator"]
    assert v == "not resolved" and "-0.100" in m and "0.058" in m
    # envace - envace_noshare = (0.05, -0.05, 0.0): mean 0.
    assert judged["sharing parameters between the roles helps"][1] == "not resolved"
    assert judged["RL by world rehearsal improves on the warm start"][1] == "supported"
    # Gains 0.4 (main) and 0.1 (small, per seed (0.1, 0.0, 0.2)), each with s.e. 0.0577; the
    # sizes are independent: difference 0.3, s.e. sqrt(2 * 0.0577^2) = 0.0816.
    m, v = judged["the gain of world rehearsal grows with model size"]
    assert v == "supported" and "+0.300" in m and "0.082" in m
    # sft_only - envace = (-0.4, -0.5, -0.6): mean -0.5, s.e. 0.1/sqrt(3).
    d, se, v = verdicts.compare_means(summary[(main, "sft_only")], summary[(main, "envace")])
    assert (
        v == "contradicted" and d == pytest.approx(-0.5) and se == pytest.approx(np.sqrt(0.01 / 3))
    )
    # A size whose warm start solves nothing cannot show a gain: the scale claim is untestable.
    floor = [_result(small, "sft_only", i, 0.0) for i in range(3)]
    judged = dict((c, v) for c, _, v in verdicts.claims(verdicts.summarize(results + floor)))
    assert judged["the gain of world rehearsal grows with model size"].startswith("not testable")
    # Grounded rehearsal: its gain over sft_only (0.4, 0.5, 0.6) against 0.7 x real-env GRPO's
    # (0.0, 0.2, 0.1): per seed 0.4, 0.36, 0.53, mean 0.43, std 0.0874, s.e. 0.0504.
    grounded = [_result(main, "envace_grounded", i, v) for i, v in enumerate((0.5, 0.6, 0.7))]
    judged = {c: (m, v) for c, m, v in verdicts.claims(verdicts.summarize(results + grounded))}
    m, v = judged["grounded rehearsal gains at least 0.7 x what RL in the real environment gains"]
    per_seed = np.asarray([0.4 - 0.0, 0.5 - 0.14, 0.6 - 0.07])
    assert v == "supported" and f"{per_seed.mean():+.3f}" in m and "ratio 5.00" in m
    assert f"(s.e. {per_seed.std(ddof=1) / np.sqrt(3):.3f})" in m
    # Grounded vs shared: (0.5, 0.6, 0.7) - (0.5, 0.6, 0.7) = 0.
    assert judged["grounded rehearsal beats shared rehearsal"][1] == "not resolved"
    assert judged["RL by grounded world rehearsal improves on the warm start"][1] == "supported"
    # Different seeds: nothing to pair, the two means' errors add.
    unpaired = dict(summary[(main, "grpo_real_env")], success_by_seed={5: 0.1, 6: 0.3, 7: 0.2})
    d, se, _ = verdicts.compare_means(summary[(main, "envace")], unpaired)
    assert d == pytest.approx(0.4) and se == pytest.approx(np.sqrt(0.01 / 3 + 0.01 / 3))


@pytest.mark.slow
def test_compare_end_to_end_on_the_smoke_config(tmp_path):
    """One seed of every mode and of the scale study on the smoke config: the table, CSV and
    plot are written, and a second invocation reuses the finished runs."""
    cmd = [
        sys.executable,
        "-m",
        "envace_jax.experiments.compare",
        f"--workdir={tmp_path}",
        "--quick",
        f"--config={os.path.join(REPO, 'configs', 'demo.py')}:smoke",
        "--seeds=1",
        "--presets=tiny-qwen3,tiny-qwen3",
        "--set=schedule.sft_steps=4",
        "--set=sft_optim.warmup_steps=1",
        "--set=sft_optim.decay_steps=3",
        "--set=schedule.rl_steps=1",
        "--set=data.eval_tasks=2",
        "--set=eval.fidelity_tasks=1",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("results.md", "results.csv", "results.png"):
        assert (tmp_path / name).exists(), name
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(compare.plan(1))
    assert {r["mode"] for r in rows} == set(verdicts.ARMS)
    for row in rows:
        assert int(row["rl_steps"]) == (0 if row["mode"] == "sft_only" else 1)
    md = (tmp_path / "results.md").read_text()
    assert "| envace_noshare |" in md and "Model-scale study" in md
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "warm start loaded" not in again.stdout
