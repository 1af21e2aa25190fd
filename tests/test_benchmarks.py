"""Every script in benchmarks/ runs at a tiny size and writes its --json figures, and the checks
the scripts make side by side hold there: the same greedy tokens as transformers (and between
the two decode steps, the two attention-window schedules), the same losses from the packed and
the one-row-per-message train steps. The scripts are the only source of the README's speed
figures, so a change that breaks one is caught here, not on the next measuring day."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about five minutes in all on 2 cores

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MACHINE_FIELDS = {"cpu", "cores_usable", "caches", "copy_bandwidth_gb_per_s", "versions"}
MACHINE_FIELDS |= {"load_average_at_start", "load_average_at_end"}


def run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    cmd = [sys.executable, str(BENCHMARKS / f"{script}.py"), *args, "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert MACHINE_FIELDS <= set(got["machine"]), script  # every figure names its machine
    return got


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The tiny random Qwen3 that sampler.py benchmarks, saved by transformers."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    code = "import sys; from sampler import make_checkpoint; make_checkpoint(sys.argv[1], 2048)"
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=BENCHMARKS, check=True, timeout=300)
    return str(path)


def test_sampler_tiny(tmp_path):
    got = run("sampler", "--batch", "4", "--new-tokens", "16", "--repeats", "1", tmp_path=tmp_path)
    assert got["greedy_tokens_identical"] == 1.0
    assert got["window_tokens_identical"] == 1.0
    for key in ("generate_ratio", "rehearsal_ratio", "window_ratio"):
        assert got[key] > 0, key


def test_sampler_at_a_checkpoint_reports_the_roofline(tiny_checkpoint, tmp_path):
    args = ["--model", tiny_checkpoint, "--batches", "1,2", "--prompt", "16"]
    got = run("sampler", *args, "--new-tokens", "8", "--repeats", "1", tmp_path=tmp_path)
    assert [r["batch"] for r in got["rows"]] == [1, 2]
    assert got["bandwidth_bytes_per_s"] > 0
    for row in got["rows"]:
        assert row["greedy_tokens_identical"] == 1.0
        assert row["ratio"] > 0 and 0 < row["roofline_fraction"]


def test_decode_layouts(tiny_checkpoint, tmp_path):
    args = ["--model", tiny_checkpoint, "--batches", "1,2", "--window", "128", "--repeats", "2"]
    got = run("decode_layouts", *args, tmp_path=tmp_path)
    assert [r["same_greedy_tokens"] for r in got["rows"]] == [True, True]


def test_serve(tmp_path):
    args = ["--max-tokens", "8", "--per-client", "1", "--clients", "1,4", "--burst-pairs", "1"]
    got = run("serve", *args, tmp_path=tmp_path)
    assert [r["clients"] for r in got["clients"]] == [1, 4]
    assert got["peak_rss_mb"] > 0 and got["full_context_tokens"] > 0
    assert len(got["batched_over_sequential_16_pairs"]) == 1


def test_train_step_formulations_agree(tmp_path):
    args = ["--trajectories", "4", "--group-size", "2", "--turns", "2", "--prompt-len", "64"]
    got = run("train_step", *args, "--repeats", "1", tmp_path=tmp_path)
    losses = [step["loss"] for step in got["steps"].values()]
    assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), got["steps"]
    assert got["packed_over_rows"] > 0


def test_checkpoint(tmp_path):
    got = run("checkpoint", "--mib", "4", "--leaves", "4", tmp_path=tmp_path)
    assert 0 < got["save_blocks_s"] <= got["save_s"] and got["restore_s"] > 0


def test_task_files_memory(tmp_path):
    got = run("task_files", "--tasks", "200", "--mb", "3", tmp_path=tmp_path)
    assert got["under_1gb"]


def test_structured_output_cost(tmp_path):
    args = ("--batch", "4", "--new-tokens", "16", "--repeats", "1")
    got = run("structured_output", *args, tmp_path=tmp_path)
    assert 0 < got["constrained_over_unconstrained"] < 2
    assert got["constrained"]["mask_us_per_token"] > 0


def test_device_script_smoke_run_on_cpu(tmp_path):
    """benchmarks/device.py, the script for a lent GPU or TPU, at its --tiny size; the demo job
    is stopped by its time limit after a few seconds."""
    got = run("device", "--tiny", "--demo", "--demo-timeout", "3", tmp_path=tmp_path)
    assert got["device"]["platform"] and got["device"]["kind"] and got["device"]["count"] >= 1
    assert got["bandwidth_bytes_per_s"] > 0
    assert [r["batch"] for r in got["decode"]["rows"]] == [1, 2]
    for row in got["decode"]["rows"]:
        for key in ("tokens_per_s", "decode_steps_per_s", "roofline_fraction"):
            assert 0 < row[key] < float("inf"), (key, row)
    train = got["train_step"]
    for key in ("step_s", "model_flops_per_s", "matmul_flops_per_s", "fraction_of_matmul"):
        assert 0 < train[key] < float("inf"), key
    assert math.isfinite(train["loss"])
    # MFU needs the device's spec-sheet peak, which a CPU has none of: null, and said why.
    assert (train["mfu"] is None) == (train["peak_flops_per_s"] is None) and train["peak_source"]
    demo = got["demo"]
    assert demo["timed_out"] and demo["returncode"] != 0 and demo["wall_s"] >= 3
    assert Path(got["log"]).exists()
