"""A run's directory: one job per workdir (`locks`), the kept warm start per run, a relative
checkpoint_dir taken relative to the workdir, and SIGINT that a library swallows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.configuration import base_config, load
from envace_jax.runtime import interrupts
from envace_jax.runtime.locks import LockHeld, PidLock
from envace_jax.runtime.workdir import RunDir, run_dirs

HOLD = textwrap.dedent(
    """
    import sys, time
    from envace_jax.runtime.locks import PidLock
    PidLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def _holder(path):
    """A process holding the lock on `path` (started, and holding, when this returns)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_names_its_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    path = tmp_path / "job.lock"
    holder = _holder(path)
    try:
        with pytest.raises(LockHeld) as held:
            PidLock(str(path)).acquire()
        assert held.value.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert path.read_text().strip() == str(holder.pid)  # SIGKILL leaves the file behind
    with PidLock(str(path)) as lock:
        assert lock.previous_pid == holder.pid  # the caller warns with it
        assert path.read_text().strip() == str(os.getpid())
    assert not path.exists()
    with PidLock(str(path)) as lock:  # released cleanly: nothing to warn about
        assert lock.previous_pid is None


def _run_dir(workdir, checkpoint_dir: str) -> RunDir:
    config = base_config()
    config.schedule.checkpoint_dir = checkpoint_dir
    return RunDir(load(config), str(workdir))


def _files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def test_runs_whose_checkpoint_dirs_share_a_parent_keep_their_own_warm_starts(tmp_path):
    """The kept warm start used to go to dirname(checkpoint_dir)/warm_start: runs with
    checkpoint directories side by side displaced each other's copy."""
    shared = tmp_path / "ckpts"
    runs = {}
    for name, value in (("a", 1.0), ("b", 2.0)):
        run = _run_dir(tmp_path / f"work_{name}", str(shared / name))
        params = {"w": jnp.full((4,), value)}
        run.keep_warm_start(3, params, {"sft_eval": None})
        runs[name] = (run, params)
    assert sorted(os.listdir(shared)) == ["a", "b"]  # no shared warm_start/ beside them
    files = {name: _files(shared / name) for name in runs}
    assert files["a"] and files["b"] and not files["a"] & files["b"]
    for name, (run, params) in runs.items():
        got = run.kept_warm_start(3, params, "test")
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(params["w"]))
        assert run_dirs(str(shared / name)) == (str(shared / name), str(shared))
        run.close()


def test_a_relative_checkpoint_dir_is_relative_to_the_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a current directory that is not the workdir
    workdir = tmp_path / "runs" / "one"
    run = _run_dir(workdir, "ckpt")
    run.keep_warm_start(1, {"w": jnp.zeros(2)}, {})
    run.close()
    assert (workdir / "ckpt" / "warm_start").is_dir()
    assert not (tmp_path / "ckpt").exists()


def test_a_swallowed_sigint_is_raised_again_at_the_next_check():
    """Orbax's wait_until_finished catches BaseException while it joins its save thread: a
    SIGINT that lands there is logged and dropped, and the job used to run on to its end."""
    previous, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        interrupts.install()
        interrupts.check()  # nothing received yet
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        except BaseException:  # what the library does
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.check()  # raised once
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook


CUT_IMPORT = textwrap.dedent(
    """
    import os, signal, sys
    from absl import flags, logging
    from envace_jax import main

    def cut_short(config, workdir, lock):  # a SIGINT inside an import fails it as ImportError
        logging.get_absl_handler().use_absl_log_file("job", workdir)  # as the job does first
        flags.FLAGS.stderrthreshold = "warning"
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        except KeyboardInterrupt as e:
            raise ImportError("initialization failed") from e

    main._run = cut_short
    sys.argv = ["main", "--config", "configs/demo.py:smoke", "--workdir", sys.argv[1]]
    main.cli()
    """
)


def test_a_sigint_that_surfaces_as_another_error_is_still_an_interrupt(tmp_path):
    """A SIGINT that lands while a module initialises turns into an ImportError: the job still
    exits 130 with its one line, and the traceback goes to the log only."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", CUT_IMPORT, str(tmp_path / "w")],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=300,
    )
    assert out.returncode == 130, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: interrupted (SIGINT); run the same command again to resume"
    )
    assert "ImportError: initialization failed" in (tmp_path / "w" / "job.INFO").read_text()


def test_a_config_saved_before_a_knob_existed_matches_at_its_default():
    """A warm start saved before `rehearsal.sft_memory_swaps` existed lacks the key; it was made
    without swaps, so it matches a config at the default and differs from one that swaps."""
    from envace_jax.runtime.workdir import WARM_START_KEYS, config_differences, config_json

    ours = config_json(load(base_config()))
    saved = {k: dict(v) if isinstance(v, dict) else v for k, v in ours.items()}
    del saved["rehearsal"]["sft_memory_swaps"]
    assert config_differences(ours, saved, WARM_START_KEYS) == []
    swapping = base_config()
    swapping.rehearsal.sft_memory_swaps = 0.5
    differ = config_differences(config_json(load(swapping)), saved, WARM_START_KEYS)
    assert differ == ["rehearsal.sft_memory_swaps=0.0"]
    saved["rehearsal"]["sft_memory_fraction"] = 0.9  # a key it has still counts
    assert "rehearsal.sft_memory_fraction=0.9" in config_differences(ours, saved, WARM_START_KEYS)
