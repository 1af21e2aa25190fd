"""The training job as an unlucky operator runs it: config mistakes, a disk that fills up
during the run, and a finished workdir run again. Each mistake is one line naming it, never a
traceback; a finished run is not redone."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "demo.py")
_ABSL = re.compile(r"[IWEF]\d{4} ")  # the start of an absl log line


def _main(*args, cwd, preexec_fn=None, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "envace_jax.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": REPO},
        preexec_fn=preexec_fn,
    )


def _messages(stderr: str) -> list[str]:
    """What the job said on stderr, without absl's log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not _ABSL.match(line)]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--config.rl.nope=1"], ["config.rl.nope", "config has no key 'rl'", "schedule"]),
        (
            ["--config.schedule.nope=1"],
            ["config.schedule.nope", "config.schedule has no key 'nope'", "sft_steps"],
        ),
        (["--config.model=1"], ["config.model is a section", "hf_path"]),
        (["--config.model.hf_path=no/such/dir"], ["config.model.hf_path", "no such directory"]),
    ],
)
def test_config_mistakes_are_one_line_and_nothing_is_written(tmp_path, args, needles):
    workdir = tmp_path / "work"
    r = _main(f"--config={DEMO}:smoke", f"--workdir={workdir}", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    (line,) = _messages(r.stderr)
    assert line.startswith("error: ") and all(n in line for n in needles), line
    assert not workdir.exists()


def test_a_missing_config_file_is_one_line(tmp_path):
    r = _main("--config", "configs/nope.py:smoke", f"--workdir={tmp_path}/w", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert _messages(r.stderr) == ["error: --config: no config file 'configs/nope.py'"]


@contextlib.contextmanager
def _small_disk(tmp_path):
    """A directory on a 1 MiB tmpfs (ENOSPC when full) where mounting is allowed, else None."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True
    )
    try:
        yield str(path) if mounted.returncode == 0 else None
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(path)], check=True)


def _file_size_limit():
    """In the job's process: files over 512 KiB fail to write (EFBIG), as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.RLIM_INFINITY))


@pytest.mark.slow
def test_a_disk_that_fills_up_stops_the_run_with_one_message(tmp_path):
    """The warm start's first checkpoint cannot be written (its background write fails): the
    run stops with one line naming the step and the OS error. Which save reports the failure
    first depends on how fast the steps run: the step-2 checkpoint's background write, found at
    a later step boundary, or the warm start's copy at its last step (4), which no longer fits."""
    with _small_disk(tmp_path) as small:
        args = [f"--config={DEMO}:smoke", f"--workdir={tmp_path}/work"]
        if small:
            args.append(f"--config.schedule.checkpoint_dir={small}/checkpoints")
            r = _main(*args, cwd=tmp_path)
            cause = "No space left on device"
        else:
            r = _main(*args, cwd=tmp_path, preexec_fn=_file_size_limit)
            cause = "File too large"
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-6000:]
    messages = _messages(r.stderr)
    assert len(messages) == 1, "\n".join(messages)
    (line,) = messages
    assert re.match(r"error: saving checkpoint step [24] ", line) and cause in line, line
    assert not (tmp_path / "work" / "summary.md").exists()


@pytest.mark.slow
def test_rerunning_a_finished_workdir_redoes_nothing(tmp_path):
    workdir = tmp_path / "work"
    args = [f"--config={DEMO}:smoke", f"--workdir={workdir}"]
    first = _main(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = workdir / "checkpoints"

    def listing():
        return {p: os.stat(checkpoints / p).st_mtime_ns for p in sorted(os.listdir(checkpoints))}

    before, metrics = listing(), (workdir / "metrics.jsonl").read_text()
    again = _main(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run is complete" in again.stdout and "--force" in again.stdout
    assert "Held-out real-environment evaluation" in again.stdout  # the summary, printed
    assert "[eval]" not in again.stdout  # no evaluation redone
    assert listing() == before and not (checkpoints / "superseded").exists()
    assert (workdir / "metrics.jsonl").read_text() == metrics

    forced = _main(*args, "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "the run is complete" not in forced.stdout
    last = max(int(p) for p in before if p.isdigit())
    assert os.listdir(checkpoints / "superseded") == [str(last)]  # the old final checkpoint


def _start_main(*args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "envace_jax.main", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def _wait_for(predicate, what: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_job_per_workdir_and_a_killed_holder_is_taken_over(tmp_path):
    """Two jobs on one workdir used to both run: 14 metric lines instead of 7, and each removed
    the other's checkpoints. The second now exits at once naming the first; a workdir whose job
    was SIGKILLed (no chance to release the lock) is taken over with a warning."""
    workdir = tmp_path / "work"
    args = [f"--config={DEMO}:smoke", f"--workdir={workdir}"]
    lock = workdir / "job.lock"
    first = _start_main(*args, cwd=tmp_path)
    try:
        _wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.pid), "lock")
        t0 = time.monotonic()
        second = _main(*args, cwd=tmp_path, timeout=120)
        assert time.monotonic() - t0 < 60  # at once: before JAX or the model
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
        (line,) = _messages(second.stderr)
        assert line.startswith("error: workdir") and f"process {first.pid}" in line, line
        assert first.poll() is None  # the holder runs on, undisturbed
    finally:
        first.kill()
        first.communicate(timeout=60)
    (workdir / "config.json").unlink()  # the third job writes it again once it holds the lock
    third = _start_main(*args, cwd=tmp_path)
    try:
        line = third.stderr.readline()
        while line and "taking over" not in line:
            line = third.stderr.readline()
        assert f"taking over the lock of process {first.pid}" in line, line
        assert line.startswith("warning: workdir")
        # A SIGINT before the job gets far is one line and status 130, like one mid-RL.
        _wait_for(lambda: (workdir / "config.json").exists(), "config.json")
        third.send_signal(signal.SIGINT)
        _, err = third.communicate(timeout=120)
    finally:
        third.kill()
    assert third.returncode == 130, err[-3000:]
    assert "Traceback" not in err and _messages(err)[-1].startswith("error: interrupted"), err
    assert not lock.exists()  # released at exit


@pytest.mark.slow
def test_sigint_during_rl_is_always_honoured(tmp_path):
    """SIGINT at a few moments of the RL phase: each run stops with one line and status 130,
    and a rerun resumes. (One SIGINT in five used to be swallowed by Orbax, the job running
    on to the end with status 0.) The moments are progress lines, not delays: a run resumed
    late in RL ended before a signal sent seconds after its first RL line. The last one comes
    before the final evaluation, save and export."""
    workdir = tmp_path / "work"
    args = [f"--config={DEMO}:smoke", f"--workdir={workdir}"]
    for moment in ("[RL envace] 1/2", "[eval] RL step 1", "[RL envace] 2/2"):
        job = _start_main(*args, cwd=tmp_path)
        try:
            line = job.stdout.readline()
            while line and not line.startswith(moment):
                line = job.stdout.readline()
            assert line, f"the run ended without a line {moment!r}"
            job.send_signal(signal.SIGINT)
            out, err = job.communicate(timeout=300)
        finally:
            job.kill()
        assert job.returncode == 130, (moment, out[-2000:], err[-3000:])
        assert "Traceback" not in err and _messages(err)[-1].startswith("error: interrupted")
    final = _main(*args, cwd=tmp_path)
    assert final.returncode == 0 and "resuming from checkpoint" in final.stdout, final.stderr


# Root ignores permissions (CAP_DAC_OVERRIDE): a job that must meet a read-only directory runs
# without that capability.
_NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def _prefix():
    """The command prefix under which permissions stop this user's jobs."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot stop the job")
    return _NO_OVERRIDE


def _protect(path):
    for d, _, _ in os.walk(path):
        os.chmod(d, 0o555)


def test_a_read_only_workdir_is_one_line(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    _protect(workdir)
    try:
        r = subprocess.run(
            [*_prefix(), sys.executable, "-m", "envace_jax.main", f"--config={DEMO}:smoke"]
            + [f"--workdir={workdir}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": REPO},
        )
    finally:
        os.chmod(workdir, 0o755)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = _messages(r.stderr)
    assert line.startswith(f"error: workdir {workdir}: cannot write there"), line


@pytest.mark.slow
def test_a_workdir_made_read_only_mid_run_stops_with_one_line(tmp_path):
    workdir = tmp_path / "work"
    job = subprocess.Popen(
        [*_prefix(), sys.executable, "-m", "envace_jax.main", f"--config={DEMO}:smoke"]
        + [f"--workdir={workdir}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        _wait_for(lambda: (workdir / "metrics.jsonl").exists(), "the first metrics")
        _protect(workdir)
        out, err = job.communicate(timeout=600)
    finally:
        job.kill()
        for d, _, _ in os.walk(workdir):
            os.chmod(d, 0o755)
    assert job.returncode == 1 and "Traceback" not in err, err[-6000:]
    messages = _messages(err)
    assert len(messages) == 1, messages
    assert messages[0].startswith("error: ") and "Permission denied" in messages[0], messages


@pytest.mark.slow
def test_a_truncated_checkpoint_is_one_warning_and_the_run_recovers(tmp_path):
    """A truncated data file in the newest checkpoint: the run falls back to the one before in
    one warning line naming the step, with no Orbax traceback on the console."""
    workdir = tmp_path / "work"
    args = [f"--config={DEMO}:smoke", f"--workdir={workdir}"]
    assert _main(*args, cwd=tmp_path).returncode == 0
    checkpoints = workdir / "checkpoints"
    newest = max(int(p) for p in os.listdir(checkpoints) if p.isdigit())
    data = [p for p in (checkpoints / str(newest)).rglob("d/*") if p.is_file()]
    biggest = max(data, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    again = _main(*args, cwd=tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-6000:]
    skipped = [line for line in again.stderr.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and f"checkpoint step {newest}" in skipped[0], again.stderr
    assert len(again.stderr.splitlines()) <= 3, again.stderr
