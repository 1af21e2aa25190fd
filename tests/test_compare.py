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


def test_plan_runs_every_arm_and_seed_with_the_warm_start_first():
    runs = compare.plan([0, 1, 2])
    assert set(runs) == {(m, s) for m in verdicts.ARMS for s in range(3)}
    assert runs[0] == ("sft_only", 0) and len(runs) == len(set(runs))
    # Seeds without 0 still start from the warm start (sft_only, seed 0).
    assert compare.plan([4], ("grpo_real_env",)) == [
        ("sft_only", 0),
        ("sft_only", 4),
        ("grpo_real_env", 4),
    ]


def test_every_arm_is_a_valid_config():
    base = compare.load_config(os.path.join(REPO, "configs", "demo.py"))
    for arm, keys in verdicts.ARMS.items():
        config = compare.run_config(base, {}, arm, 1, "")
        assert config.mode == keys["mode"] and config.seed == 1
        for key, value in keys.items():
            node = config
            for part in key.split("."):
                node = node[part]
            assert node == value, (arm, key)


def test_parse_overrides():
    got = compare.parse_overrides(["rollout.group_size=8", "model.preset=tiny-qwen3", "a.b=(1, 2)"])
    assert got == {"rollout.group_size": 8, "model.preset": "tiny-qwen3", "a.b": (1, 2)}
    with pytest.raises(ValueError, match="key=value"):
        compare.parse_overrides(["rollout.group_size"])


def _result(mode, seed, success, hidden=None):
    r = {k: 0.0 for k in (*verdicts.METRICS, "rl_tokens", "rl_seconds", "seconds")}
    r.update(success=success, success_avg4=success)  # the claims are judged on avg@4
    for k in ("success", "success_avg4"):
        r[verdicts.scoped(k, "hidden")] = success if hidden is None else hidden
        r[verdicts.scoped(k, "visible")] = success
    return {**r, "mode": mode, "seed": seed, "params": 10}


def test_summary_and_verdicts_against_hand_computed_numbers():
    succ = {
        "envace": [0.5, 0.6, 0.7],
        "grpo_real_env": [0.1, 0.3, 0.2],
        "external_simulator": [0.6, 0.6, 0.9],
        "envace_noshare": [0.45, 0.65, 0.7],
        "sft_only": [0.1, 0.1, 0.1],
    }
    results = [_result(m, i, v) for m, vs in succ.items() for i, v in enumerate(vs)]
    summary = verdicts.summarize(results)
    s = summary["envace"]
    assert s["success"] == pytest.approx(0.6) and s["success_std"] == pytest.approx(0.1)
    judged = {(c, scope): (m, v) for c, scope, m, v in verdicts.claims(summary)}
    # grpo_real_env - sft_only = (0.0, 0.2, 0.1): mean 0.1, s.e. 0.1/sqrt(3) = 0.0577 (paired;
    # unpaired it would be sqrt(0.01/3 + 0) = 0.0577 too) -> within twice its s.e.
    m, v = judged["RL in the real environment improves on the warm start", "all"]
    assert v == "not resolved" and "avg@4 +0.100 (s.e. 0.058)" in m
    # envace - envace_noshare = (0.05, -0.05, 0.0): mean 0.
    assert judged["sharing parameters between the roles helps", "hidden"][1] == "not resolved"
    # envace - sft_only = (0.4, 0.5, 0.6): mean 0.5, s.e. 0.0577 -> supported in every scope.
    for scope in verdicts.SCOPES:
        assert judged["RL by envace improves on the warm start", scope][1] == "supported"
    # external_simulator - envace = (0.1, 0.0, 0.2): the grounded claims need their arms.
    assert not any(c.startswith("grounded") for c, _ in judged)
    # sft_only - envace = (-0.4, -0.5, -0.6): mean -0.5, s.e. 0.1/sqrt(3).
    d, se, v = verdicts.compare_means(summary["sft_only"], summary["envace"])
    assert (
        v == "contradicted" and d == pytest.approx(-0.5) and se == pytest.approx(np.sqrt(0.01 / 3))
    )
    # Different seeds: nothing to pair, the two means' errors add.
    unpaired = dict(summary["grpo_real_env"], success_by_seed={5: 0.1, 6: 0.3, 7: 0.2})
    d, se, _ = verdicts.compare_means(summary["envace"], unpaired)
    assert d == pytest.approx(0.4) and se == pytest.approx(np.sqrt(0.01 / 3 + 0.01 / 3))


def test_sensitivity_bars_against_hand_computed_numbers():
    """The redrawn world's bar is judged on the hidden stratum apart: here it loses 12, 14 and
    10 points there (mean 12, s.e. 1.15: met), and 1, 3 and 2 overall (mean 2: below 5)."""
    real = [_result("grpo_real_env", i, 0.8, hidden=0.7) for i in range(3)]
    redrawn = [
        _result("redrawn", i, v, hidden=h)
        for i, (v, h) in enumerate(((0.79, 0.58), (0.77, 0.56), (0.78, 0.60)))
    ]
    warm = [_result("sft_only", i, 0.5) for i in range(3)]
    bars = {
        (a, b, scope): (d, se, met)
        for a, b, scope, d, se, met, _ in verdicts.sensitivity(
            verdicts.summarize(real + redrawn + warm)
        )
    }
    d, se, met = bars["grpo_real_env", "redrawn", "hidden"]
    assert d == pytest.approx(0.12) and se == pytest.approx(0.02 / np.sqrt(3)) and met
    d, se, met = bars["grpo_real_env", "redrawn", "all"]
    assert d == pytest.approx(0.02) and not met
    d, se, met = bars["grpo_real_env", "sft_only", "all"]
    assert d == pytest.approx(0.3) and se == pytest.approx(0.0) and met


def test_stability_command_line_shares_compare_flags():
    """The study imports compare; each flag is defined once, so it reaches its own checks."""
    out = subprocess.run(
        [sys.executable, "-m", "envace_jax.experiments.stability"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert "--workdir is required" in out.stderr, out.stderr[-2000:]
    assert "DuplicateFlagError" not in out.stderr


def test_stability_holds_against_hand_made_curves():
    from envace_jax.experiments import stability

    def curve(*points):
        return [(4 * i, {"success": v, "stratum_success/hidden": v}) for i, v in enumerate(points)]

    # The warm start (step 0) is not a point of the run: a drop from it does not count.
    assert stability.holds(curve(0.9, 0.80, 0.85, 0.84)) == (0.84, 0.85, True)
    assert stability.holds(curve(0.5, 0.90, 0.87, 0.85)) == (0.85, 0.90, False)
    text = stability.report({("grpo_real_env", 1): curve(0.5, 0.9, 0.85)}, 8, 4)
    assert "| grpo_real_env | 1 | 0: 0.500, 4: 0.900, 8: 0.850 |" in text and "| no |" in text
    assert "0 of 1 runs hold" in text and "* grpo_real_env: 0: 0.500, 4: 0.900, 8: 0.850" in text


@pytest.mark.slow
def test_compare_end_to_end_on_the_smoke_config(tmp_path):
    """One seed of every arm on the smoke config: the table, CSV and plot are written, and a
    second invocation reuses the finished runs."""
    cmd = [
        sys.executable,
        "-m",
        "envace_jax.experiments.compare",
        f"--workdir={tmp_path}",
        "--quick",
        f"--config={os.path.join(REPO, 'configs', 'demo.py')}:smoke",
        "--seeds=0",
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
    assert len(rows) == len(compare.plan([0]))
    assert {r["mode"] for r in rows} == set(verdicts.ARMS)
    for row in rows:
        assert int(row["rl_steps"]) == (0 if row["mode"] == "sft_only" else 1)
    md = (tmp_path / "results.md").read_text()
    assert "| envace_noshare |" in md and "| redrawn |" in md and "Sensitivity" in md
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "warm start loaded" not in again.stdout
