"""The tau2-bench harness (`envace_jax.eval.tau2`): the `tau2 run` command line it builds, how it
decides to resume a saved run, its progress and score summary (fast, no tau2 needed), and, with
`make tau2` installed, the mock domain end to end against the shipped demo policy, its scores
checked against tau2's own saved results."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from envace_jax.eval import tau2

REPO = Path(__file__).resolve().parents[1]
MODEL = str(REPO / "envace_jax" / "models" / "demo_base")
TOKENIZER = str(REPO / "envace_jax" / "text" / "demo_tokenizer")
URL, USER_URL = "http://127.0.0.1:4242/v1", "http://127.0.0.1:4343/v1"


def args_of(*argv, workdir="/tmp/tau2-test"):
    return tau2.parse_args(["--model", MODEL, "--workdir", str(workdir), *argv])


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_solo_runs_the_solo_agent_with_the_dummy_user():
    args = args_of("--domain", "mock", "--solo", "--max-steps", "5")
    cmd = tau2.tau2_command(args, URL)
    assert cmd[:4] == ["tau2", "run", "--domain", "mock"]
    assert flag(cmd, "--agent") == "llm_agent_solo" and flag(cmd, "--user") == "dummy_user"
    assert "--user-llm-args" not in cmd and "--user-api-key" not in cmd
    assert flag(cmd, "--agent-llm") == "openai/demo_base"
    agent = json.loads(flag(cmd, "--agent-llm-args"))
    assert agent == {"api_base": URL, "temperature": 0.0, "max_tokens": 1024}
    assert flag(cmd, "--agent-api-key") == tau2.KEY_ENV  # the variable's name, not the key
    assert flag(cmd, "--max-steps") == "5" and flag(cmd, "--max-retries") == "0"
    assert "--skip-failed-samples" in cmd  # a failed call fails its task, not the run
    assert flag(cmd, "--save-to") == "mock_solo_demo_base"
    assert flag(cmd, "--results-dir") == "/tmp/tau2-test/simulations"


def test_the_local_user_has_its_own_budget():
    args = args_of("--domain", "airline", "--user-llm", "local", "--max-tokens", "1024")
    cmd = tau2.tau2_command(args, URL)
    assert flag(cmd, "--user-llm") == "openai/demo_base"
    user = json.loads(flag(cmd, "--user-llm-args"))
    assert user == {"temperature": 0.0, "max_tokens": 256, "api_base": URL}
    assert json.loads(flag(cmd, "--agent-llm-args"))["max_tokens"] == 1024
    assert flag(cmd, "--user-api-key") == tau2.KEY_ENV
    assert "--agent" not in cmd and "--user" not in cmd  # tau2's defaults: LLM agent and user
    assert flag(cmd, "--save-to") == "airline_local-user_demo_base"
    args = args_of(
        "--user-llm", "local", "--user-max-tokens", "100", "--user-llm-args", '{"top_p": 0.5}'
    )
    user = json.loads(flag(tau2.tau2_command(args, URL), "--user-llm-args"))
    assert user["max_tokens"] == 100 and user["top_p"] == 0.5


def test_a_second_local_server_or_an_outside_service_plays_the_user():
    args = args_of("--user-model", "/models/smollm2", "--user-tokenizer", TOKENIZER)
    cmd = tau2.tau2_command(args, URL, USER_URL)
    assert flag(cmd, "--user-llm") == "openai/smollm2"
    assert json.loads(flag(cmd, "--user-llm-args"))["api_base"] == USER_URL
    assert flag(cmd, "--save-to") == "airline_user-smollm2_demo_base"
    cmd = tau2.tau2_command(args_of("--user-llm", "openai/gpt-4.1"), URL)
    assert flag(cmd, "--user-llm") == "openai/gpt-4.1"
    assert "api_base" not in json.loads(flag(cmd, "--user-llm-args"))
    assert "--user-api-key" not in cmd  # litellm reads the service's own key variable
    assert flag(cmd, "--save-to") == "airline_user-gpt-4.1_demo_base"


def test_one_user_simulator_must_be_chosen():
    with pytest.raises(SystemExit):
        args_of("--domain", "mock")
    with pytest.raises(SystemExit):
        args_of("--solo", "--user-llm", "local")
    with pytest.raises(SystemExit):
        args_of("--solo", "--user-tokenizer", TOKENIZER)


def test_task_selection_and_extra_tau2_flags_pass_through():
    args = tau2.parse_args(
        ["--model", MODEL, "--user-llm", "local", "--task-ids", "0", "3", "--num-tasks", "2"]
        + ["--seed", "7", "--save-to", "mine", "--results-dir", "/r", "--", "--max-errors", "3"]
    )
    cmd = tau2.tau2_command(args, URL)
    assert cmd[cmd.index("--task-ids") + 1 : cmd.index("--task-ids") + 3] == ["0", "3"]
    assert flag(cmd, "--num-tasks") == "2" and flag(cmd, "--seed") == "7"
    assert flag(cmd, "--save-to") == "mine" and flag(cmd, "--results-dir") == "/r"
    assert cmd[-2:] == ["--max-errors", "3"]


def test_the_launcher_runs_the_venvs_tau2_and_reports_calls():
    ast.parse(tau2._LAUNCHER)
    cmd = tau2.launch_command(Path("/v/bin/python"), ["tau2", "run", "--domain", "mock"])
    assert cmd[:2] == ["/v/bin/python", "-c"] and cmd[3:] == ["run", "--domain", "mock"]
    counts = {"agent": 3, "user": 2, "failed": 1}
    assert tau2.parse_calls(f"{tau2.CALLS} agent=3 user=2 failed=1\n") == (counts, "\n")
    # another thread's text on the same line is kept
    assert tau2.parse_calls(f"Running{tau2.CALLS} agent=3 user=2 failed=1\n") == (
        counts,
        "Running\n",
    )
    assert tau2.parse_calls("0/9 Running task\n") == (None, "0/9 Running task\n")


def test_tau2_runs_offline_with_our_key_variable():
    env = tau2.tau2_env(None, resume=False)
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env[tau2.KEY_ENV] == "EMPTY" and env[tau2.RESUME_ENV] == "0"
    env = tau2.tau2_env("secret", resume=True)
    assert env[tau2.KEY_ENV] == "secret" and env[tau2.RESUME_ENV] == "1"


def test_a_missing_tau2_venv_says_make_tau2(tmp_path, capsys):
    rc = tau2.main(["--model", MODEL, "--solo", "--tau2-venv", str(tmp_path / "none")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make tau2" in err


def test_the_saved_config_leaves_out_ports_and_concurrency():
    base = tau2.run_config(args_of("--solo", "--max-concurrency", "2"))
    assert base == tau2.run_config(args_of("--solo", "--max-concurrency", "8"))
    assert tau2.AGENT_URL in json.dumps(base) and "127.0.0.1" not in json.dumps(base)
    assert base != tau2.run_config(args_of("--solo", "--max-steps", "3"))
    assert base != tau2.run_config(args_of("--solo", "--server-arg=--max-model-len=8192"))


def test_reruns_resume_refuse_another_config_or_start_over(tmp_path):
    solo = ("--domain", "mock", "--solo", "--max-steps", "4")
    args = args_of(*solo, workdir=tmp_path)
    files = tau2.run_files(args)
    assert tau2.prepare(args) is False  # fresh: the config is recorded
    assert json.loads(files["envace"].read_text())["config"] == tau2.run_config(args)
    files["results"].write_text(json.dumps({"tasks": [], "simulations": []}))
    assert tau2.prepare(args_of(*solo, "--max-concurrency", "1", workdir=tmp_path)) is True
    other = args_of("--domain", "mock", "--solo", "--max-steps", "5", workdir=tmp_path)
    with pytest.raises(SystemExit, match="tau2 --max-steps: saved 4, now 5.*--restart"):
        tau2.prepare(other)
    other.restart = True
    assert tau2.prepare(other) is False and not files["results"].exists()
    files["results"].write_text("{}")
    files["envace"].unlink()  # a file that plain tau2 wrote
    with pytest.raises(SystemExit, match="not written by this script"):
        tau2.prepare(args)


def results_file(path: Path, sims, tasks=("a", "b", "c"), trials=2) -> Path:
    path.write_text(
        json.dumps(
            {
                "info": {"num_trials": trials, "environment_info": {"domain_name": "mock"}},
                "tasks": [{"id": t} for t in tasks],
                "simulations": [
                    {
                        "task_id": t,
                        "trial": k,
                        "reward_info": {"reward": r},
                        "termination_reason": "agent_error" if skipped else "user_stop",
                        "skipped": skipped,
                    }
                    for t, k, r, skipped in sims
                ],
            }
        )
    )
    return path


def test_the_summary_uses_tau2s_definitions(tmp_path):
    sims = [("b", 1, 0.0, True), ("a", 0, 1.0, False), ("b", 0, 1.0, False), ("a", 1, 0.5, False)]
    s = tau2.summarize(results_file(tmp_path / "r.json", sims))
    assert [(r["task_id"], r["trial"]) for r in s["simulations"]] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
    ]
    assert s["mean_reward"] == pytest.approx(2.5 / 4)
    assert s["pass^1"] == pytest.approx(0.5)  # a: 1 of 2 trials a success, b: 1 of 2
    assert s["failed"] == 1 and s["num_tasks"] == 3 and s["num_simulations"] == 4
    assert s["terminations"] == {"user_stop": 3, "agent_error": 1}


def test_progress_counts_tasks_and_calls_and_repairs_a_cut_file(tmp_path):
    path = results_file(tmp_path / "r.json", [("a", 0, 1.0, False), ("b", 0, 0.0, True)])
    progress = tau2.Progress(path, every=30)
    data = progress._read()
    progress.done0 = 0
    progress.calls = {"agent": 5, "user": 4, "failed": 1}
    line = progress.line(data)
    assert line.startswith("[tau2] 2/6 tasks done (1 failed with an error)")
    assert "9 model calls (agent 5, user 4, 1 failed)" in line and "s/task" in line
    good = path.read_text()
    path.write_text(good[: len(good) // 2])  # tau2 killed while rewriting it
    assert progress.repair() and path.read_text() == good
    assert not progress.repair()


# ---------------------------------------------------------------------------------------------
# End to end, with tau2 installed (`make tau2`)

TAU2_MISSING = tau2.find_tau2(tau2.tau2_venv(None)) is None
needs_tau2 = pytest.mark.skipif(TAU2_MISSING, reason="tau2-bench is not installed: `make tau2`")
# The mock tasks without a ticket, or with user messages in their history: tau2's solo agent
# cannot run them (`LLMSoloAgent.check_valid_task`).
NOT_SOLO = {
    "create_task_1_nl_eval",
    "update_task_with_message_history",
    "update_task_with_history_and_env_assertions",
}


def run_harness(tmp_path, *argv) -> tuple[int, dict, dict, dict]:
    """(exit code, the harness's summary, tau2's results, tau2's metrics)."""
    argv = ["--model", MODEL, "--tokenizer", TOKENIZER, "--domain", "mock", *argv]
    rc = tau2.main([*argv, "--workdir", str(tmp_path), "--max-concurrency", "3"])
    args = tau2.parse_args([*argv, "--workdir", str(tmp_path)])
    files = tau2.run_files(args)
    summary = json.loads(files["envace"].read_text())["summary"]
    results = json.loads(files["results"].read_text())
    metrics = json.loads(files["metrics"].read_text())
    return rc, summary, results, metrics


def check_scores(summary: dict, results: dict, metrics: dict) -> None:
    """The harness's scores are those of tau2's saved results, read here independently."""
    saved = {(s["task_id"], s["trial"]): s for s in results["simulations"]}
    assert {(r["task_id"], r["trial"]) for r in summary["simulations"]} == set(saved)
    for r in summary["simulations"]:
        s = saved[(r["task_id"], r["trial"])]
        assert r["reward"] == s["reward_info"]["reward"]
        assert r["termination"] == s["termination_reason"]
        assert r["failed"] == bool(s.get("skipped"))
    rewards = [s["reward_info"]["reward"] for s in results["simulations"]]
    assert summary["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert summary["mean_reward"] == pytest.approx(metrics["metrics"]["avg_reward"])
    assert summary["pass^1"] == pytest.approx(metrics["metrics"]["pass_at_k"]["1"])
    assert metrics["num_simulations"] == len(results["simulations"])


@pytest.mark.slow
@needs_tau2
def test_mock_solo_end_to_end_then_a_rerun_resumes(tmp_path, capsys):
    rc, summary, results, metrics = run_harness(tmp_path, "--solo", "--max-steps", "4")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    # Every mock task tau2's solo agent can run, once; the demo policy scores ~0.
    ids = {t["id"] for t in results["tasks"]}
    assert len(ids) == 6 and not ids & NOT_SOLO
    assert {s["task_id"] for s in results["simulations"]} == ids
    check_scores(summary, results, metrics)
    assert all(not math.isnan(r["reward"]) for r in summary["simulations"])
    assert "tasks done" in out and f"mean reward {summary['mean_reward']:.3f}" in out
    # The same command again: tau2 resumes the saved run (nothing left to do), no prompt.
    rc, again, results2, _ = run_harness(tmp_path, "--solo", "--max-steps", "4")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "resuming: " in out
    assert results2["simulations"] == results["simulations"]
    assert again["simulations"] == summary["simulations"]
    assert not (tmp_path / "server.log").read_text().count("Traceback")


@pytest.mark.slow
@needs_tau2
def test_mock_all_tasks_with_the_local_user_are_scored_by_tau2(tmp_path, capsys):
    rc, summary, results, metrics = run_harness(tmp_path, "--user-llm", "local", "--max-steps", "4")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert len(results["tasks"]) == 9
    assert {s["task_id"] for s in results["simulations"]} == {t["id"] for t in results["tasks"]}
    check_scores(summary, results, metrics)
    # tau2's evaluator scored the conversations that ran: its checks, or its note on why none
    # apply (the demo policy's conversations run out of steps).
    evaluated = [s["reward_info"] for s in results["simulations"] if not s.get("skipped")]
    assert evaluated and all(r.get("reward_basis") or r.get("info") for r in evaluated)
    assert "model calls (agent" in out
