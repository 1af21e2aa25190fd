"""tpu_scripts: --dry-run prints well-formed gcloud commands (parsed by bash itself, checked
against gcloud's documented synopses), bad arguments fail naming the option, the scripts pass
shellcheck, and every command in docs/tpu.md is one the scripts accept."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from envace_jax import parallel
from envace_jax.planner.topology import parse_topology
from tests.conftest import config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tpu_scripts")
ALL = sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".sh") and f != "lib.sh")
ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")

# gcloud command -> (positional count, required flags, other allowed flags), from the
# synopses in the gcloud reference. Every command also allows the global --project/--quiet.
_TPU = {"--zone"}
GCLOUD = {
    ("compute", "tpus", "tpu-vm", "create"): (
        1,
        _TPU | {"--version", "--accelerator-type"},
        {"--spot", "--preemptible", "--network", "--subnetwork", "--service-account", "--scopes"},
    ),
    ("compute", "tpus", "queued-resources", "create"): (
        1,
        _TPU | {"--runtime-version", "--accelerator-type", "--node-id"},
        {
            "--spot",
            "--guaranteed",
            "--valid-until-duration",
            "--network",
            "--subnetwork",
            "--service-account",
            "--scopes",
        },
    ),
    ("compute", "tpus", "queued-resources", "describe"): (1, _TPU, {"--format"}),
    ("compute", "tpus", "queued-resources", "delete"): (1, _TPU, {"--force", "--async"}),
    ("compute", "tpus", "tpu-vm", "ssh"): (1, _TPU | {"--worker", "--command"}, {"--internal-ip"}),
    ("compute", "tpus", "tpu-vm", "scp"): (2, _TPU | {"--worker"}, {"--recurse"}),
    ("compute", "tpus", "tpu-vm", "delete"): (1, _TPU, set()),
    ("compute", "tpus", "tpu-vm", "stop"): (1, _TPU, set()),
    ("storage", "rsync"): (2, {"--recursive"}, {"--exclude"}),
}
GLOBAL = {"--project", "--quiet"}
VALUE_FLAGS = {
    "--zone",
    "--version",
    "--runtime-version",
    "--accelerator-type",
    "--node-id",
    "--worker",
    "--command",
    "--format",
    "--project",
    "--network",
    "--subnetwork",
    "--service-account",
    "--scopes",
    "--valid-until-duration",
    "--exclude",
}

# bash prints each command it would run as argv fields, so quoting is checked by bash itself.
STUBS = r"""
set -f
emit() { local a; for a in "$@"; do printf '%s\x1f' "$a"; done; printf '\x1e'; }
gcloud() { emit gcloud "$@"; }
tar() { emit tar "$@"; }
env() { emit env "$@"; }
command_not_found_handle() { emit UNKNOWN "$@"; }
"""


@pytest.fixture(autouse=True)
def no_real_gcloud(tmp_path, monkeypatch):
    """A gcloud on PATH that fails: a script that ran a command instead of printing it fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text("#!/bin/sh\necho 'gcloud ran during a dry run' >&2\nexit 99\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def dry_run(script, *args, check=True):
    """(argv lists of the printed commands, stderr, returncode)."""
    r = subprocess.run(
        [os.path.join(SCRIPTS, script), "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert r.returncode == 0, r.stderr
    if r.returncode:
        return [], r.stderr, r.returncode
    p = subprocess.run(["bash", "-c", STUBS + r.stdout], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (r.stdout, p.stderr)
    commands = [c.split("\x1f")[:-1] for c in p.stdout.split("\x1e")[:-1]]
    assert commands, r.stdout
    for c in commands:
        assert c[0] != "UNKNOWN", f"not a known command: {c}"
    return commands, r.stderr, r.returncode


def check_gcloud(argv):
    """Checks one gcloud argv against GCLOUD; returns (command path, {flag: value}, positionals)."""
    assert argv[0] == "gcloud"
    words = [w for w in argv[1:] if not w.startswith("--")]
    path = next((p for p in GCLOUD if tuple(words[: len(p)]) == p), None)
    assert path is not None, f"unknown gcloud command: {argv}"
    n_pos, required, allowed = GCLOUD[path]
    flags, positionals = {}, []
    for w in argv[1 + len(path) :]:
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            assert name in required | allowed | GLOBAL, f"{name} not accepted by {path}: {argv}"
            assert bool(eq) == (name in VALUE_FLAGS), f"{name} value form: {argv}"
            assert name not in flags, f"{name} twice: {argv}"
            flags[name] = value
        else:
            positionals.append(w)
    assert len(positionals) == n_pos, (path, positionals)
    missing = required - set(flags)
    assert not missing, f"{path} lacks {missing}: {argv}"
    if "--zone" in flags:
        assert ZONE.match(flags["--zone"]), flags["--zone"]
    if "--accelerator-type" in flags:
        t = parse_topology(flags["--accelerator-type"])
        assert t.name == flags["--accelerator-type"]
        version = flags.get("--version", flags.get("--runtime-version"))
        assert version == t.generation.runtime_version
    if "--worker" in flags:
        assert flags["--worker"] == "all" or flags["--worker"].isdigit()
    if "--command" in flags:
        r = subprocess.run(["bash", "-n"], input=flags["--command"], capture_output=True, text=True)
        assert r.returncode == 0, (flags["--command"], r.stderr)
    if path[0] == "storage":
        assert any(p.startswith("gs://") for p in positionals), positionals
    return path, flags, positionals


def gcloud_commands(commands):
    return [check_gcloud(c) for c in commands if c[0] == "gcloud"]


# ------------------------------------------------------------------------------- create


@pytest.mark.parametrize(
    "slice_name,hosts,queued",
    [("v5p-32", 4, True), ("v5e-8", 1, False), ("v5litepod-16", 4, True), ("v6e-8", 1, False)],
)
def test_create_queued_for_pod_slices_direct_for_one_host(slice_name, hosts, queued):
    args = ["--name", "envace-a", "--zone", "us-east5-a", "--accelerator", slice_name]
    commands, err, _ = dry_run("create.sh", *args, "--spot", "--project", "my-proj")
    checked = gcloud_commands(commands)
    (path, flags, pos) = checked[0]
    assert f"({hosts} host(s))" in err
    t = parse_topology(slice_name)
    assert flags["--accelerator-type"] == t.name and flags["--project"] == "my-proj"
    assert "--spot" in flags and pos == ["envace-a"]
    if queued:
        assert path[-2:] == ("queued-resources", "create") and flags["--node-id"] == "envace-a"
        assert checked[1][0][-1] == "describe" and flags.get("--version") is None
    else:
        assert path[-2:] == ("tpu-vm", "create") and len(checked) == 1


def test_create_options_and_errors():
    base = ["--name", "envace-b", "--zone", "us-central1-a", "--accelerator", "v6e-8"]
    commands, _, _ = dry_run("create.sh", *base, "--queued", "--valid-until-duration=6h")
    (path, flags, _), *_ = gcloud_commands(commands)
    assert path[-2] == "queued-resources" and flags["--valid-until-duration"] == "6h"
    cases = [
        (["--zone", "us-east5-a", "--accelerator", "v5p-32"], "--name is required"),
        (base[:4], "--accelerator is required"),
        (base[:2] + ["--zone", "useast5", "--accelerator", "v6e-8"], "--zone 'useast5'"),
        (base[:4] + ["--accelerator", "v4-8"], "--accelerator 'v4-8'"),
        (base + ["--valid-until-duration", "6h"], "queued resources only"),
        (base + ["--queued", "--direct"], "exclude each other"),
        (base + ["--colour", "red"], "unknown option --colour"),
        (["--name", "Bad_Name", *base[2:]], "--name 'Bad_Name'"),
    ]
    for args, message in cases:
        _, err, rc = dry_run("create.sh", *args, check=False)
        assert rc == 2 and message in err, (args, err)


# --------------------------------------------------------------------- setup and stage


def test_setup_copies_the_checkout_or_clones(tmp_path):
    commands, _, _ = dry_run("setup.sh", "--name", "envace-a", "--zone", "us-east5-a")
    assert commands[0][0] == "tar" and "--exclude=.venv" in commands[0]
    tarball = commands[0][commands[0].index("-czf") + 1]
    (scp, scp_flags, pos), (ssh, ssh_flags, _) = gcloud_commands(commands)
    assert scp[-1] == "scp" and pos == [tarball, "envace-a:envace_jax.tar.gz"]
    assert scp_flags["--worker"] == ssh_flags["--worker"] == "all"
    remote = ssh_flags["--command"]
    assert "jax[tpu]>=0.9,<0.11" in remote and 'pip" install -q -e "$HOME/envace/src"' in remote
    commands, _, _ = dry_run(
        "setup.sh", "--name", "envace-a", "--zone", "us-east5-a", "--git", "https://x/y.git"
    )
    ((path, flags, _),) = gcloud_commands(commands)
    assert (
        path[-1] == "ssh"
        and "git clone --depth 1 --branch main https://x/y.git" in (flags["--command"])
    )
    _, err, rc = dry_run(
        "setup.sh", "--name", "a", "--zone", "us-east5-a", "--source", str(tmp_path), check=False
    )
    assert rc == 2 and "no setup.py" in err


def test_stage_pulls_from_gcs_on_every_worker(tmp_path):
    base = ["--name", "envace-a", "--zone", "us-east5-a"]
    commands, _, _ = dry_run("stage.sh", *base, "--checkpoint", "gs://b/models/Qwen3-8B")
    ((path, flags, _),) = gcloud_commands(commands)
    assert flags["--worker"] == "all"
    assert (
        'rsync --recursive gs://b/models/Qwen3-8B "$HOME/envace/models/Qwen3-8B"'
        in (flags["--command"])
    )
    ckpt, data = tmp_path / "Qwen3-1.7B", tmp_path / "tasks"
    ckpt.mkdir()
    data.mkdir()
    args = ("--checkpoint", str(ckpt), "--data", str(data), "--bucket", "gs://b/s")
    _, err, rc = dry_run("stage.sh", *base, *args, check=False)
    assert rc == 2 and "no train/ directory" in err  # what the configs read is named
    (data / "train").mkdir()
    (data / "validation").mkdir()
    commands, _, _ = dry_run("stage.sh", *base, *args)
    (up1, _, pos1), (up2, _, pos2), (ssh, flags, _) = gcloud_commands(commands)
    assert up1 == up2 == ("storage", "rsync")
    assert pos1 == [str(ckpt), "gs://b/s/checkpoint/Qwen3-1.7B"]
    assert pos2 == [str(data), "gs://b/s/data/tasks"]
    assert 'rsync --recursive gs://b/s/data/tasks "$HOME/envace/data"' in flags["--command"]
    _, err, rc = dry_run("stage.sh", *base, "--checkpoint", str(ckpt), check=False)
    assert rc == 2 and "give --bucket" in err


@pytest.mark.parametrize("name", ["qwen3_1p7b", "qwen3_4b", "qwen3_8b"])
def test_tpu_configs_read_the_staged_task_files_with_the_llm_judge(name, monkeypatch, tmp_path):
    """Every shipped TPU config trains on task files in the directory stage.sh --data fills,
    scores with the LLM judge and evaluates without an environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = config_file(name)
    with open(os.path.join(SCRIPTS, "stage.sh")) as f:
        staged = re.search(r'local dest="\\\$HOME/([^"]+)"', f.read())
    data_dir = os.path.join(str(tmp_path), staged.group(1))  # where a worker's data lands
    assert config.data.env == "files"
    assert config.data.train_files == os.path.join(data_dir, "train")
    assert config.data.eval_files == os.path.join(data_dir, "validation")
    assert config.data.max_prompt_tokens == 3500  # the reference's prompt filter
    assert config.judge.kind == "llm" and config.judge.base_url.startswith("http")
    assert config.judge.model == "Qwen/Qwen3-30B-A3B"
    assert config.eval.kind == "checklist" and config.eval.val_n == 4
    assert config.rollout.max_message_tokens == 8000


# -------------------------------------------------------------------------------- launch


def test_launch_plans_then_starts_every_worker():
    args = [
        "--name",
        "envace-a",
        "--zone",
        "us-east5-a",
        "--accelerator",
        "v5p-32",
        "--config",
        "configs/qwen3_8b.py:v5p-32",
        "--run",
        "r1",
        "--bucket",
        "gs://b/runs",
        "--",
        "--config.seed=3",
    ]
    commands, _, _ = dry_run("launch.sh", *args)
    (plan, plan_flags, _), (start, start_flags, _) = gcloud_commands(commands)
    assert plan_flags["--worker"] == "0" and start_flags["--worker"] == "all"
    assert (
        "-m envace_jax.planner --config=configs/qwen3_8b.py:v5p-32 --topology=v5p-32 "
        "--config.seed=3" in plan_flags["--command"]
    )
    # The worker command: run it through worker_run.sh's own dry run as worker 1 of 4.
    line = next(x for x in start_flags["--command"].splitlines() if "worker_run.sh" in x)
    job = shlex.split(line.split("worker_run.sh -- ", 1)[1].split(" >", 1)[0])
    assert job == [
        "--config=configs/qwen3_8b.py:v5p-32",
        "--workdir=../runs/r1",
        "--config.schedule.checkpoint_dir=gs://b/runs/r1/checkpoints",
        "--config.seed=3",
    ]
    endpoints = "w-0:0:10.1.0.2,w-1:1:10.1.0.3,w-2:2:10.1.0.4,w-3:3:10.1.0.5"
    commands, _, _ = dry_run(
        "worker_run.sh", "--worker-id", "1", "--endpoints", endpoints, "--", *job
    )
    ((argv),) = commands
    assert argv[0] == "env"
    env = dict(a.split("=", 1) for a in argv[1:4])
    assert env == {
        "JAX_COORDINATOR_ADDRESS": "10.1.0.2:8476",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "1",
    }
    assert parallel._multi_process_env(env) == "explicit"
    assert argv[5:7] == ["-m", "envace_jax.main"] and argv[7:] == job

    commands, _, _ = dry_run("launch.sh", *args[:4], *args[6:10], "--skip-plan")
    ((path, flags, _),) = gcloud_commands(commands)
    assert flags["--worker"] == "all" and "--workdir=../runs/r1" in flags["--command"]


def test_worker_run_single_host_and_errors():
    commands, _, _ = dry_run("worker_run.sh", "--worker-id", "0", "--endpoints", "h0", "--", "-x")
    assert commands == [
        ["env", os.path.expanduser("~/envace/venv/bin/python"), "-m"] + ["envace_jax.main", "-x"]
    ]
    for args, message in [
        (["--worker-id", "0", "--endpoints", "h0"], "give the job's flags after --"),
        (["--worker-id", "2", "--endpoints", "h0,h1", "--", "-x"], "not below the 2 workers"),
        (["--worker-id", "0", "--endpoints", "a:b", "--", "-x"], "expected 'host' or"),
    ]:
        _, err, rc = dry_run("worker_run.sh", *args, check=False)
        assert rc == 2 and message in err, err


def test_launch_errors_name_the_option():
    base = ["--name", "envace-a", "--zone", "us-east5-a"]
    for args, message in [
        (base + ["--config", "configs/qwen3_8b.py"], "--run is required"),
        (base + ["--run", "r1"], "--config is required"),
        (base + ["--config", "configs/qwen3_8b.py", "--run", "r1"], "--accelerator is required"),
        (base + ["--config", "x.yaml", "--run", "r1", "--skip-plan"], "--config 'x.yaml'"),
        (base + ["--config", "c.py", "--run", "a b", "--skip-plan"], "--run 'a b'"),
        (base + ["--config", "c.py", "--run", "r", "--skip-plan", "--bucket", "b"], "--bucket"),
    ]:
        _, err, rc = dry_run("launch.sh", *args, check=False)
        assert rc == 2 and message in err, (args, err)


# ------------------------------------------------------------- logs, stop, delete, collect


def test_logs_stop_delete_collect():
    base = ["--name", "envace-a", "--zone", "us-east5-a"]
    commands, _, _ = dry_run("logs.sh", *base, "--run", "r1", "--follow", "--lines", "50")
    ((_, flags, _),) = gcloud_commands(commands)
    assert flags["--worker"] == "0"
    assert flags["--command"] == 'tail -n 50 -F "$HOME/envace/logs/r1.log"'

    commands, _, _ = dry_run("stop.sh", *base, "--run", "r1", "--vm")
    (ssh, flags, _), (stop, _, pos) = gcloud_commands(commands)
    assert (
        flags["--worker"] == "all"
        and 'kill -TERM "$(cat "$HOME/envace/logs/r1.pid")"' in (flags["--command"])
    )
    assert stop[-1] == "stop" and pos == ["envace-a"]

    commands, _, _ = dry_run("delete.sh", *base, "--queued")
    ((path, flags, _),) = gcloud_commands(commands)
    assert path[-2:] == ("queued-resources", "delete") and "--force" in flags
    commands, _, _ = dry_run("delete.sh", *base)
    ((path, flags, _),) = gcloud_commands(commands)
    assert path[-2:] == ("tpu-vm", "delete") and "--quiet" in flags

    commands, _, _ = dry_run("collect.sh", *base, "--run", "r1", "--bucket", "gs://b/runs/")
    ((_, flags, _),) = gcloud_commands(commands)
    assert "gs://b/runs/r1/results" in flags["--command"] and flags["--worker"] == "0"


@pytest.mark.parametrize("script", ALL)
def test_every_script_has_help(script):
    r = subprocess.run(
        [os.path.join(SCRIPTS, script), "--help"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and r.stdout.startswith(r.stdout.split("\n")[0])
    assert f"Usage: tpu_scripts/{script}" in r.stdout and "--dry-run" in r.stdout


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck") or os.path.join(
        os.path.dirname(sys.executable), "shellcheck"
    )
    assert os.path.exists(shellcheck), "shellcheck is missing: pip install -e '.[test]'"
    files = sorted(os.path.join("tpu_scripts", f) for f in os.listdir(SCRIPTS))
    r = subprocess.run(
        [shellcheck, "-x", *files], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout


# --------------------------------------------------------------------------- docs/tpu.md


def _doc_commands():
    """Shell lines of docs/tpu.md's ```bash blocks (continuations joined), and the exports."""
    with open(os.path.join(REPO, "docs", "tpu.md"), encoding="utf-8") as f:
        text = f.read()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n\s*", " ", block)
        lines += [x.strip() for x in block.splitlines() if x.strip() and not x.startswith("#")]
    exports = [x for x in lines if x.startswith("export ")]
    return lines, exports


def test_every_documented_script_command_is_accepted():
    lines, exports = _doc_commands()
    scripts = [x for x in lines if x.startswith("tpu_scripts/")]
    used = {x.split()[0].split("/")[1] for x in scripts}
    assert used >= set(ALL) - {"worker_run.sh"}, f"docs/tpu.md never shows {set(ALL) - used}"
    prelude = "; ".join(exports)
    for line in scripts:
        r = subprocess.run(
            ["bash", "-c", f"{prelude}; {line.replace('.sh ', '.sh --dry-run ', 1)}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, (line, r.stderr)


def test_every_documented_python_command_is_accepted():
    lines, exports = _doc_commands()
    prelude = "; ".join(exports)
    plans = [x for x in lines if x.startswith("python -m envace_jax.planner")]
    mains = [x for x in lines if x.startswith("python -m envace_jax.main")]
    assert plans and mains
    for line in plans:  # run for real: it touches no device
        r = subprocess.run(
            ["bash", "-c", f"{prelude}; {line.replace('python', sys.executable, 1)}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode in (0, 1) and "verdict:" in r.stdout, (line, r.stderr[-2000:])
    sys.path.insert(0, os.path.join(REPO, "configs"))
    from envace_jax.configuration import validate

    for line in mains:  # the config and its variant load and validate
        words = shlex.split(line)
        spec = next(w.split("=", 1)[1] for w in words if w.startswith("--config="))
        path, _, variant = spec.partition(":")
        module = __import__(os.path.basename(path)[:-3])
        validate(module.get_config(variant or None))
