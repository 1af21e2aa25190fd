"""Run a benchmark harness against our server: start it on a free loopback port, stop it after."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path


def start_server(model_dir: str, workdir: Path, extra=(), timeout: float = 300.0):
    """Starts `python -m envace_jax.serve`; returns (process, base url ending in /v1).
    The server's output goes to workdir/server.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "server.port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "envace_jax.serve", "--model", str(model_dir), "--port", "0"]
    cmd += ["--port-file", str(port_file), "--log-level", "warning", *extra]
    with open(workdir / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not start; see {workdir / 'server.log'}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}/v1"


def stop_server(proc) -> None:
    """SIGTERM (graceful: running requests finish), then SIGKILL after a minute."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def served(model_dir: str, workdir: Path, extra=()):
    """Yields the base url of a server for model_dir, stopped on exit."""
    proc, url = start_server(model_dir, workdir, extra)
    try:
        yield url
    finally:
        stop_server(proc)


def served_name(model_dir: str) -> str:
    """The model id the server announces for model_dir (its directory name)."""
    return os.path.basename(os.path.normpath(model_dir))
