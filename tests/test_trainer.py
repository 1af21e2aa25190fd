"""The whole pipeline on the smoke config: outputs, HF export, resume, divergence, corruption."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from envace_jax.configuration import load, validate
from envace_jax.train.phase import TrainingDiverged
from envace_jax.train.trainer import Hooks, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import demo as demo_config  # noqa: E402


def smoke(**overrides):
    config = demo_config.get_config("smoke")
    for path, value in overrides.items():
        section, key = path.split(".")
        config[section][key] = value
    return validate(config)


def params_of(trainer_or_dir):
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(trainer_or_dir).items()}


def _flat(state):
    return {
        ".".join(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for p, v in nnx.to_flat_state(state)
    }


class Stop(Exception):
    pass


def _run(config, workdir, stop_after_save=None):
    """Runs the trainer; with stop_after_save=s, raises Stop right after checkpoint s is saved
    (an interruption at a known point)."""
    captured = {}

    def stop_after(step, state, meta):
        if step == stop_after_save:
            trainer.run_dir.checkpointer.wait()
            raise Stop(step)

    def keep_state(state):
        captured["params"] = _flat(state.params)

    trainer = Trainer(
        load(config), str(workdir), Hooks(on_checkpoint=stop_after, on_finish=keep_state)
    )
    out = trainer.run()
    return out, captured["params"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    config = smoke(**{"schedule.checkpoint_every": 1})
    out, params = _run(config, workdir)
    return workdir, out, params


@pytest.mark.slow  # a smoke job with a checkpoint every step, then its export in transformers
def test_outputs_and_hf_export(uninterrupted):
    import torch
    from transformers import AutoModelForCausalLM

    workdir, out, params = uninterrupted
    for name in ("metrics.jsonl", "curves.png", "summary.md", "config.json"):
        if name == "config.json":
            continue  # written by the entry point, not the trainer
        assert (workdir / name).exists(), name
    assert any((workdir / "tensorboard").iterdir())
    assert os.listdir(workdir / "checkpoints")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    phases = {r["phase"] for r in rows}
    assert {"sft", "rl", "eval"} <= phases
    # The warm start's last row carries the copy probe, with the rehearser scored per tool.
    probe = [r for r in rows if r["phase"] == "sft" and "heldout/rehearse_digit_acc" in r][-1]
    per_tool = {k for k in probe if k.startswith("heldout/rehearse_digit_acc/")}
    assert "heldout/rehearse_digit_acc/find_customer" in per_tool, sorted(probe)
    headline = {"success", "success_se", "success_avg4", "success_avg4_se", "reward"}
    headline |= {"tool_error_rate", "invalid_rate", "fidelity"}
    families = {k for k in out["final"] if k.startswith("success/")}
    families_avg4 = {k for k in out["final"] if k.startswith("success_avg4/")}
    strata = {k for k in out["final"] if k.startswith("stratum_success")}
    assert strata and strata <= {
        f"stratum_success{a}/{s}" for a in ("", "_avg4") for s in ("hidden", "visible")
    }
    assert set(out["final"]) == headline | families | families_avg4 | strata and families
    summary_json = json.loads((workdir / "summary.json").read_text())
    for name, ev in (("warm_start", out["sft"]), ("final", out["final"])):
        assert summary_json[name]["success_greedy"] == ev["success"]
        assert summary_json[name]["success_avg4"] == ev["success_avg4"]
    # Per-family rates, weighted by each family's held-out task count, give the overall rate.
    summary = (workdir / "summary.md").read_text()
    assert "| RL (envace)" in summary and "no RL steps" not in summary
    rows = [line.split("|")[1:-1] for line in summary.split("by task family")[1].splitlines()]
    rows = [[c.strip() for c in r] for r in rows if r and r[0].strip() not in ("task family", "")]
    rows = [r for r in rows if not r[0].startswith("---")]
    assert {f"success/{r[0]}" for r in rows} == families
    columns = ((2, out["sft"], "success"), (3, out["sft"], "success_avg4"))
    columns += ((4, out["final"], "success"), (5, out["final"], "success_avg4"))
    for column, result, key in columns:
        tasks = sum(int(r[1]) for r in rows)
        weighted = sum(int(r[1]) * float(r[column]) for r in rows) / tasks
        assert weighted == pytest.approx(result[key], abs=1e-3)
    # The export loads in transformers and computes the same logits as the trained params.
    hf = AutoModelForCausalLM.from_pretrained(workdir / "export").eval()
    from envace_jax.models.hf_io import load_hf_model

    ours, _ = load_hf_model(workdir / "export")
    loaded = _flat(nnx.state(ours, nnx.Param))
    for k, v in params.items():
        np.testing.assert_array_equal(loaded[k], v)
    ids = np.asarray([[1, 5, 9, 200, 33, 7]], np.int32)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    got, _ = ours(jax.numpy.asarray(ids), jax.numpy.arange(6)[None])
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)


@pytest.mark.slow  # two interrupted smoke jobs and their reruns
@pytest.mark.parametrize("stop_at", [3, 5])  # inside the warm start; inside RL
def test_interrupted_and_resumed_equals_uninterrupted(uninterrupted, tmp_path, stop_at):
    _, _, reference = uninterrupted
    config = smoke(**{"schedule.checkpoint_every": 1})
    with pytest.raises(Stop):
        _run(config, tmp_path, stop_after_save=stop_at)
    out, params = _run(config, tmp_path)
    assert params.keys() == reference.keys()
    for k in reference:
        np.testing.assert_allclose(params[k], reference[k], atol=1e-6, err_msg=k)


@pytest.mark.slow  # a smoke job driven to a NaN
def test_nan_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    config = smoke(**{"schedule.checkpoint_every": 1})
    trainer = Trainer(load(config), str(tmp_path))
    step = trainer.grpo_step

    def poisoned(state, batch):
        state, metrics = step(state, batch)
        if int(state.step) >= 2:  # the second RL update
            metrics = dict(metrics, loss=jax.numpy.nan)
        return state, metrics

    trainer.grpo_step = poisoned
    with pytest.raises(
        TrainingDiverged, match=r"RL step 6: loss=nan.*last good checkpoint is step 5"
    ):
        trainer.run()
    trainer.run_dir.checkpointer.wait()
    assert max(trainer.run_dir.checkpointer.all_steps()) == 5


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(tmp_path, capsys, caplog):
    config = smoke(**{"schedule.checkpoint_every": 1})
    with pytest.raises(Stop):
        _run(config, tmp_path, stop_after_save=3)
    # Garble every data file of checkpoint 3.
    step_dir = tmp_path / "checkpoints" / "3"
    garbled = 0
    for root, _, files in os.walk(step_dir):
        for f in files:
            path = os.path.join(root, f)
            if os.path.getsize(path) > 64 and "metadata" not in f:
                with open(path, "r+b") as fh:
                    fh.seek(32)
                    fh.write(b"\xff" * 16)
                garbled += 1
    assert garbled
    trainer = Trainer(load(config), str(tmp_path))
    step, state, meta = trainer.restore()
    assert step == 2
    warnings = caplog.text + capsys.readouterr().out
    assert "3" in warnings and (
        "unreadable" in warnings or "corrupt" in warnings or "checksum" in warnings
    )


@pytest.mark.slow
def test_sigkill_mid_training_then_rerun_finishes(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "envace_jax.main",
        f"--config={os.path.join(REPO, 'configs', 'demo.py')}:smoke",
        f"--workdir={tmp_path}",
        "--config.schedule.checkpoint_every=1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline:
        if ckpts.exists() and any(p.name.isdigit() and int(p.name) >= 3 for p in ckpts.iterdir()):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from checkpoint" in r.stdout
    assert "Held-out real-environment evaluation" in r.stdout


def test_family_success_is_a_rate_per_family_of_tasks_that_name_one():
    import types

    from envace_jax.train.evaluation import by_family

    def task(family):
        return types.SimpleNamespace(metadata={"family": family} if family else {})

    tasks = [task("a"), task("a"), task("a"), task("b"), task(None), task("c")]
    success = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    got = by_family(success, tasks, ["a", "b", "c", "unseen"], everywhere=False)
    # 'unseen' has no task here: no rate rather than a 0 that reads as "always fails".
    assert got == {"a": pytest.approx(2 / 3), "b": 0.0, "c": 1.0}


@pytest.mark.slow  # a smoke job of its own, with a GRPO step compiled for the KL term
def test_kl_penalty_to_the_warm_start_is_applied_and_logged(tmp_path):
    """grpo.use_kl trains against a frozen copy of the warm start: every RL step logs a finite,
    non-negative k3 KL, and it is 0 at the first step (the policy is still the reference)."""
    config = smoke(**{"grpo.use_kl": True, "grpo.kl_coef": 1e-3})
    Trainer(load(config), str(tmp_path)).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl"] for r in rows if r["phase"] == "rl"]
    assert len(kl) == config.schedule.rl_steps
    assert all(np.isfinite(k) and k >= 0 for k in kl)
    assert kl[0] == pytest.approx(0.0, abs=1e-6)


def test_without_the_warm_start_evaluation_only_the_final_policy_is_evaluated(tmp_path):
    config = smoke(**{"schedule.eval_warm_start": False, "schedule.eval_every": 0})
    trainer = Trainer(load(config), str(tmp_path))
    evaluated = []
    evaluate = trainer.evaluate
    trainer.evaluate = lambda *a: evaluated.append(1) or evaluate(*a)
    out = trainer.run()
    assert len(evaluated) == 1 and out["sft"] is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["warm_start"] is None
    assert summary["final"]["success_avg4"] == out["final"]["success_avg4"]
    text = (tmp_path / "summary.md").read_text()
    assert "| RL (envace)" in text and "warm start" not in text
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["phase"] == "eval"]) == 1


def test_an_evaluation_between_rl_steps_leaves_the_next_rollouts_bit_identical(tmp_path):
    """Evaluations sample from parameter views of their own: evaluating other parameters (the
    policy's, halved) after every RL step changes no later rollout, loss or parameter."""
    quiet = {"schedule.eval_warm_start": False, "schedule.eval_every": 0}
    plain = Trainer(load(smoke(**quiet)), str(tmp_path / "plain")).run()
    config = smoke(**{**quiet, "schedule.eval_every": 1})
    trainer = Trainer(load(config), str(tmp_path / "evaluated"))
    evaluate, halved = trainer.evaluate, []

    def evaluate_other(params, *args, **kwargs):
        halved.append(1)
        return evaluate(jax.tree.map(lambda x: x * 0.5, params), *args, **kwargs)

    trainer.evaluate = evaluate_other
    trainer.run()
    assert len(halved) == config.schedule.rl_steps  # after each step but the last, and the final

    def rl_rows(name):
        rows = [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().split("\n")[:-1]
        ]
        timing = ("time", "rollout_s", "update_s")
        return [{k: v for k, v in r.items() if k not in timing} for r in rows if r["phase"] == "rl"]

    assert rl_rows("evaluated") == rl_rows("plain") and len(rl_rows("plain")) >= 2
    assert plain["sft"] is None


def test_summary_gives_the_seconds_of_each_part(tmp_path):
    """summary.json times the build, the warm start, the RL steps and every evaluation; the
    parts add up to no more than the total."""
    config = smoke(**{"schedule.eval_every": 1})
    out = Trainer(load(config), str(tmp_path)).run()
    seconds = json.loads((tmp_path / "summary.json").read_text())["seconds"]
    steps = config.schedule.rl_steps
    evals = {f"eval_rl_step_{i}" for i in range(1, steps)}
    assert {"total", "build", "warm_start", "rl", "eval_warm_start", "eval_final"} | evals == set(
        seconds
    )
    assert all(v >= 0 for v in seconds.values())
    parts = sum(v for k, v in seconds.items() if k not in ("total", "build"))
    assert parts <= seconds["total"] + 1 and seconds["total"] == round(out["seconds"], 1)
