"""The paper's setting through the main job: task files, the judge as a config choice, and
held-out evaluation without an environment."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from envace_jax.configuration import validate
from envace_jax.data.export import export_tasks
from envace_jax.envs.registry import domain
from tests.conftest import REPO, demo_config

TIMING = ("rollout_s", "update_s", "time", "wall")  # keys that differ between any two runs


def _smoke_checklist():
    """The smoke job, evaluated by the checklist score of rehearsed episodes (no environment)."""
    c = demo_config("smoke")
    c.data.train_tasks = 16
    c.data.eval_tasks = 4
    c.data.failure_demos = 0.0  # demonstrations that replay calls in the world: none
    c.rehearsal.sft_memory_fraction = 0.0
    c.eval.kind = "checklist"
    c.eval.val_n = 2
    c.schedule.eval_every = 0
    c.schedule.probe_every = 0
    return c


def _rows(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


@pytest.mark.slow  # two smoke jobs, about two minutes on 2 cores
def test_exported_task_files_train_to_the_demo_domains_numbers(tmp_path):
    """The demo world's tasks, exported to the reference layout and read back as task files,
    give the numbers of the same tasks taken from the domain: to the last digit, warm start,
    RL rewards and losses, and the checklist evaluation."""
    from envace_jax.trainer import Trainer

    direct = _smoke_checklist()
    demo = domain("demo")
    train = tmp_path / "train.parquet"
    held_out = tmp_path / "validation.parquet"
    export_tasks(demo.generate_tasks(direct.seed, direct.data.train_tasks, "train"), train)
    export_tasks(demo.generate_tasks(direct.seed, direct.data.eval_tasks, "validation"), held_out)
    files = _smoke_checklist()
    files.data.env = "files"
    files.data.train_files = str(train)
    files.data.eval_files = str(held_out)
    runs = {}
    for name, config in (("domain", direct), ("files", files)):
        workdir = str(tmp_path / name)
        runs[name] = Trainer(validate(config), workdir).run()
        runs[name]["rows"] = _rows(workdir)
        with open(os.path.join(workdir, "summary.json")) as f:
            runs[name]["summary"] = json.load(f)
    a, b = runs["domain"], runs["files"]
    assert [r["phase"] for r in a["rows"]] == [r["phase"] for r in b["rows"]]
    assert {"sft", "rl", "eval"} <= {r["phase"] for r in a["rows"]}
    assert a["rows"] == b["rows"]
    assert a["final"] == b["final"] and a["sft"] == b["sft"]
    assert a["summary"]["final"] == b["summary"]["final"]
    assert "checklist_avg@2" in a["summary"]["final"]
    assert all(r.get("env_calls", 0) == 0 for r in b["rows"] if r["phase"] == "rl")


class _Refuses(http.server.BaseHTTPRequestHandler):
    """An endpoint that answers every request with HTTP 400 and an OpenAI-style error."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "model 'judge' is not served here"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _job(tmp_path, base_url: str) -> subprocess.CompletedProcess:
    from envace_jax.data.samples import sample_path

    args = [
        "--config",
        os.path.join(REPO, "configs", "checklist.py:rule"),
        "--workdir",
        str(tmp_path / "run"),
        "--config.judge.kind=llm",
        f"--config.judge.base_url={base_url}",
        "--config.judge.model=judge",
        "--config.judge.max_retries=1",
        "--config.judge.timeout_s=5",
        f"--config.data.train_files={sample_path('handwritten.jsonl')}",
        "--config.data.train_tasks=4",
    ]
    return subprocess.run(
        [sys.executable, "-m", "envace_jax.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_a_judge_that_is_down_stops_the_job_with_one_line(tmp_path):
    r = _job(tmp_path, "http://127.0.0.1:9/v1")  # the discard port: nothing listens
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert "http://127.0.0.1:9/v1/chat/completions" in lines[-1], r.stderr[-3000:]
    assert "Connection refused" in lines[-1] or "connection" in lines[-1].lower()
    assert "Traceback" not in r.stderr


def test_a_judge_that_refuses_every_request_stops_the_job_with_one_line(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        r = _job(tmp_path, url)
    finally:
        server.shutdown()
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert f"{url}/chat/completions" in last and "HTTP 400" in last, r.stderr[-3000:]
    assert "not served here" in last  # the server's own message
    assert "Traceback" not in r.stderr
