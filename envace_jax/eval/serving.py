"""Run a benchmark harness against our server: start it on a free loopback port, stop it after;
the command-line pieces every harness runner shares."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

try:  # Linux: a child asks for a signal when the process that started it ends
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (AttributeError, OSError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def end_with_parent(sig: int = signal.SIGTERM) -> None:
    """A `preexec_fn`: the child gets `sig` when its parent ends, however it ends (a child in a
    session of its own is out of reach of a kill of the parent's process group). Linux only; a
    no-op elsewhere. Start such children before starting threads (`preexec_fn`)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig))


def start_server(
    model_dir: str, workdir: Path, extra=(), timeout: float = 300.0, own_session: bool = False
):
    """Starts `python -m envace_jax.serve`; returns (process, base url ending in /v1).
    The server's output goes to workdir/server.log. own_session: in a session of its own, so
    that a terminal's Ctrl-C reaches the runner only, which then stops the server with one
    signal (a second one makes uvicorn cancel the requests still running); it gets SIGTERM when
    the runner ends, however it ends (`end_with_parent`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "server.port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "envace_jax.serve", "--model", str(model_dir), "--port", "0"]
    cmd += ["--port-file", str(port_file), "--log-level", "warning", *extra]
    with open(workdir / "server.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=own_session,
            preexec_fn=end_with_parent if own_session else None,
        )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not start; see {workdir / 'server.log'}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}/v1"


def stop_server(proc) -> None:
    """SIGTERM (graceful: running requests finish), then SIGKILL after a minute, or at once on
    a Ctrl-C while waiting."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        except KeyboardInterrupt:  # a second Ctrl-C: do not leave the server running
            proc.kill()
            proc.wait(10)
            raise


@contextlib.contextmanager
def served(model_dir: str, workdir: Path, extra=(), own_session: bool = False):
    """Yields the base url of a server for model_dir, stopped on exit (`start_server`)."""
    proc, url = start_server(model_dir, workdir, extra, own_session=own_session)
    try:
        yield url
    finally:
        stop_server(proc)


def served_name(model_dir: str) -> str:
    """The model id the server announces for model_dir (its directory name)."""
    return os.path.basename(os.path.normpath(model_dir))


def harness_parser(prog: str, description: str, workdir: str) -> argparse.ArgumentParser:
    """A runner's argument parser with the flags every runner takes: the model to serve, the
    run's size, the server's settings."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", required=True, help="HF model directory to serve")
    p.add_argument("--num-tasks", type=int, default=None)
    p.add_argument("--num-trials", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--api-key", default=None, help="the server's API key, if it needs one")
    p.add_argument("--workdir", default=workdir, help="server log, port file, runner files")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    return p


def split_argv(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the runner's arguments, the harness's own after a `--`) of a command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def server_flags(args: argparse.Namespace) -> list[str]:
    """The serve flags of a runner's `--server-arg`s, and `--api-key` when one is set."""
    return [*args.server_arg, *(["--api-key", args.api_key] if args.api_key else [])]


def cli_missing(cli: str, install: str) -> bool:
    """Whether the harness's CLI is not on PATH (then the install line goes to stderr)."""
    if shutil.which(cli) is not None:
        return False
    print(f"the {cli} CLI is not installed; install it with:\n  {install}", file=sys.stderr)
    return True
