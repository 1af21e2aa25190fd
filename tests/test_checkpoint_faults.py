"""Checkpoint faults an operator meets, on real Orbax directories: step directories this process
may not read, and background writes that fail (a disk that fills up).

Permissions mean nothing to root, so the unreadable-directory cases run in a child process that
drops to an unprivileged uid once its imports are done (the interpreter's own files may be out of
that uid's reach)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests.conftest import fake_devices_env

NOBODY = 65534

UNREADABLE_SCRIPT = """
import grp, json, logging, os, pwd, sys, tempfile  # grp, pwd: imported lazily by etils
import jax, jax.numpy as jnp, orbax.checkpoint as ocp
from envace_jax.runtime.checkpoint import Checkpointer

directory, uid = sys.argv[1], int(sys.argv[2])
warnings = []
handler = logging.Handler()
handler.emit = lambda r: warnings.append(r.getMessage()) if r.levelno >= logging.WARNING else None
logging.getLogger("envace_jax.runtime.checkpoint").addHandler(handler)

def state(seed):
    return {"w": jnp.arange(64.0) + seed, "b": jnp.full((3,), seed, jnp.int32)}

# Everything Orbax imports lazily is imported here, while the interpreter is still reachable.
scratch = tempfile.mkdtemp()
with Checkpointer(scratch) as c:
    c.save(1, state(0), {}); c.wait(); c.restore(state(0)); c.save(2, state(0), {})
if uid:
    os.setgid(uid); os.setuid(uid)

with Checkpointer(directory, keep=5, async_save=False) as c:
    for s in (1, 2, 3, 4):
        c.save(s, state(s), {"step": s})
# A writer that died mid-save left an unfinished step behind, as unreadable as the rest.
os.rename(os.path.join(directory, "4"), os.path.join(directory, "5" + ocp.step.TMP_DIR_SUFFIX))
for name in ("3", "5" + ocp.step.TMP_DIR_SUFFIX):
    os.chmod(os.path.join(directory, name), 0)

out = {}
c = Checkpointer(directory, keep=5)
out["listed"] = c.all_steps()
out["restored"] = c.restore(state(0))[0]
c.save(3, state(33), {"step": 33})  # the redone work reaches the unreadable step's number
c.save(4, state(44), {"step": 44})
c.wait()
step, restored, meta = c.restore(state(0))
out["after"] = [step, meta, float(restored["w"][0])]
out["steps"] = c.all_steps()
out["names"] = sorted(os.listdir(directory))
c.close()
out["warnings"] = warnings
print("RESULT " + json.dumps(out))
"""


def test_unreadable_checkpoints_are_left_in_place_and_saving_goes_on():
    """As an unprivileged user, the newest step directory and an unfinished save are chmod
    000: restore skips them, and the saves that follow (up to and past the unreadable step's
    number) set them aside where they are instead of failing to move them."""
    uid = NOBODY if os.geteuid() == 0 else 0
    root = tempfile.mkdtemp(prefix="envace-unreadable-")
    try:
        os.chmod(root, 0o777)
        directory = os.path.join(root, "ckpt")
        env = {**fake_devices_env(1), "HOME": root}
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(UNREADABLE_SCRIPT), directory, str(uid)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        assert r.returncode == 0 and lines, r.stderr[-4000:]
        out = json.loads(lines[0][len("RESULT ") :])
    finally:
        shutil.rmtree(root, ignore_errors=True)  # root, or the owner of every directory
    assert out["listed"] == [1, 2, 3] and out["restored"] == 2
    assert out["after"] == [4, {"step": 44}, 44.0] and out["steps"] == [1, 2, 3, 4]
    assert "3.unreadable" in out["names"] and "5.unreadable" in out["names"], out["names"]
    aside = [w for w in out["warnings"] if "cannot be read" in w]
    assert len(aside) == 2 and any("3.unreadable" in w for w in aside), out["warnings"]
    assert "superseded" not in out["names"]


FAILING_DISK_SCRIPT = """
import json, resource, signal, sys, time
import jax.numpy as jnp, numpy as np
from envace_jax.runtime.checkpoint import Checkpointer, CheckpointError

# Files over 256 KiB fail to write (EFBIG), as a full disk fails them (ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((512, 1024), np.float32))}
ckpt = Checkpointer(sys.argv[1])
ckpt.save(7, big, {"step": 7})
out = {"checks": 0}
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # a training loop's step boundaries
    try:
        t0 = time.monotonic()
        ckpt.check()
        out["longest_check_s"] = max(out.get("longest_check_s", 0), time.monotonic() - t0)
        out["checks"] += 1
    except CheckpointError as e:
        out["error"] = str(e)
        break
    time.sleep(0.01)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_failed_background_save_is_raised_at_the_next_step_boundary(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAILING_DISK_SCRIPT), str(tmp_path / "ckpt")],
        env=fake_devices_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert "error" in out, out
    assert "checkpoint step 7" in out["error"] and "File too large" in out["error"], out
    # The process ends cleanly: no background thread dies at interpreter shutdown.
    for symptom in ("sys.meta_path is None", "Event loop is closed", "Exception ignored"):
        assert symptom not in r.stderr, r.stderr[-4000:]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_is_a_checkpoint_error(tmp_path, async_save):
    """A write error in a synchronous save, or one reported by `wait`, is CheckpointError."""
    code = FAILING_DISK_SCRIPT.split("ckpt = Checkpointer")[0] + textwrap.dedent(f"""
        ckpt = Checkpointer(sys.argv[1], async_save={async_save})
        try:
            ckpt.save(3, big, {{}})
            ckpt.wait()
        except CheckpointError as e:
            print("RESULT " + str(e), flush=True)
        """)
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")],
        env=fake_devices_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "RESULT saving checkpoint step 3" in r.stdout, r.stderr[-4000:]
