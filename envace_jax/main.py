"""The job entry point.

    python -m envace_jax.main --config configs/demo.py --workdir workdir/demo
    python -m envace_jax.main --config configs/demo.py:smoke --config.seed=1 --workdir /tmp/x

The config is validated before anything is built, compiled or written: a missing config file,
an unknown key, a bad value or a missing model directory is one line naming it (exit status 2).
A run stopped by a checkpoint that cannot be written (e.g. out of disk), or by a judge that
fails (its endpoint and first error named), ends with one line too (exit status 1); invalid
task files list every bad record (exit status 2). Rerunning a finished train workdir writes
its outputs again from the final checkpoint and prints its summary; `--force` redoes its final
evaluation.

A multi-process run (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, as
`tpu_scripts/worker_run.sh` sets them on a pod slice, or SLURM / Open MPI) calls
`jax.distributed.initialize` before anything touches a device; every process runs this same
command.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging as std_logging
import os
import signal
import sys
import traceback
import warnings

from absl import app, flags, logging
from ml_collections import config_flags

from envace_jax.configuration import ConfigError, key_problem, validate
from envace_jax.runtime import interrupts
from envace_jax.runtime.locks import LockHeld, PidLock

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Job config file (`path.py` or `path.py:variant`).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and exports.")
_FORCE = flags.DEFINE_bool(
    "force", False, "Redo a finished train run's final evaluation (default: print its summary)."
)


def _fail(message, status: int):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def _config_arguments_problem(args: list[str]) -> str | None:
    """What is wrong with the --config arguments, checked before absl applies them: there,
    a missing file is two chained tracebacks and an unknown override key a bare KeyError."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            continue
        if name == "config":
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            path = value.split(":", 1)[0]
            if path and not os.path.isfile(path):
                return f"--config: no config file {path!r}"
        elif name.startswith(("config.", "noconfig.")):
            if problem := key_problem(name.split(".", 1)[1]):
                return problem
    return None


def _parse_flags(argv: list[str]) -> list[str]:
    if problem := _config_arguments_problem(argv[1:]):
        _fail(problem, 2)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e} (--help lists the flags)", 2)


def _missing_paths(config) -> list[str]:
    """Local directories the config names that do not exist (found before the workdir is
    written, not when the model is loaded)."""
    from envace_jax.models.shipped import resolve_hf_path

    out = []
    hf_path = config.model.hf_path
    if hf_path and not os.path.isdir(resolve_hf_path(hf_path)):
        out.append(f"config.model.hf_path = {hf_path!r}: no such directory")
    if config.tokenizer != "demo" and not os.path.isdir(config.tokenizer):
        out.append(f"config.tokenizer = {config.tokenizer!r}: no such directory")
    return out


class _NoOrbaxTracebacks(std_logging.Filter):
    """A failed background checkpoint write is logged with a traceback by each Orbax thread
    involved, and by asyncio for each of its futures that failed too; the error reaches the
    user once, as CheckpointError. Orbax's own lines stay, without their tracebacks; asyncio's
    multi-line reports of the same error are dropped."""

    def filter(self, record):
        if not record.exc_info or record.exc_info[1] is None:
            return True
        frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] else []
        from_orbax = any(f"{os.sep}orbax{os.sep}" in f.filename for f in frames)
        # A TensorStore write error carries no Python frames, but names Orbax's temporary dir.
        if record.name == "asyncio":
            return not (from_orbax or ".orbax-checkpoint-tmp" in str(record.exc_info[1]))
        if from_orbax:
            record.exc_info, record.exc_text = None, None
        return True


def _drop_closed_loop_callbacks(hook):
    """`sys.unraisablehook` without two kinds of report. Orbax writes a checkpoint on an event
    loop of its own and closes it when the first write fails; TensorStore then reports each
    other write's completion to the closed loop, as an unraisable error with a traceback. And
    reading an unreadable checkpoint, the first array that fails is the error the restore
    names (one warning); the other reads, dropped unawaited, can each be reported with a
    traceback when collected."""
    from envace_jax.runtime.checkpoint import ORBAX_READ

    def unraisable(u):
        frames = traceback.extract_tb(u.exc_traceback) if u.exc_traceback else []
        closed = (
            isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        )
        if closed and frames and frames[-1].name == "_check_closed":
            return
        if frames and frames[-1].name == ORBAX_READ:
            return
        hook(u)

    return unraisable


def _lock_workdir(workdir: str, process: int) -> PidLock:
    """Makes this process the workdir's only job (`runtime.locks`): two jobs on one workdir
    would mix their metrics and remove each other's checkpoints. Released at exit."""
    name = "job.lock" if process == 0 else f"job.process{process}.lock"
    lock = PidLock(os.path.join(workdir, name))
    try:
        os.makedirs(workdir, exist_ok=True)
        lock.acquire()
    except OSError as e:  # permissions, a read-only file system
        _fail(f"workdir {workdir}: cannot write there ({e.strerror}: {e.filename})", 1)
    except LockHeld as e:
        _fail(
            f"workdir {workdir} is in use by another job (process {e.pid}, per {e.path}); "
            "wait for it to end, or give another --workdir",
            1,
        )
    if lock.previous_pid is not None:
        print(
            f"warning: workdir {workdir}: taking over the lock of process {lock.previous_pid}, "
            "which ended without releasing it (killed?); resuming from its newest checkpoint",
            file=sys.stderr,
        )
    atexit.register(lock.release)
    return lock


_INTERRUPTED = "interrupted (SIGINT); run the same command again to resume"


def _stop(message, status: int, lock: PidLock | None) -> None:
    """Exit with one line, skipping the interpreter's teardown: there, each write Orbax
    abandoned is reported again (to a closed log file, or as a coroutine never awaited), and
    an interrupt that reaches it makes the status -SIGINT. A save left unfinished is never
    listed, and removed at the next run's first save."""
    warnings.filterwarnings("ignore", "coroutine '.*' was never awaited", RuntimeWarning)
    warnings.simplefilter("ignore", ResourceWarning)  # an abandoned save's unclosed handles
    gc.collect()
    if lock is not None:
        lock.release()  # atexit handlers do not run after os._exit
    print(f"error: {message}", file=sys.stderr)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/demo.py")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    try:
        config = validate(_CONFIG.value)
    except ConfigError as e:
        _fail(e, 2)
    if missing := _missing_paths(config):
        _fail("; ".join(missing), 2)
    workdir = os.path.abspath(_WORKDIR.value)
    interrupts.install()
    lock = None
    try:
        from envace_jax import parallel

        lock = _lock_workdir(workdir, parallel.process_id_from_env())
        _run(config, workdir, lock)
        interrupts.check()  # one a library swallowed after the trainer's last step boundary
        gc.collect()  # what is left is reported under this job's hooks, not in the teardown
        # The work is done and saved: a SIGINT in the interpreter's teardown would only turn
        # status 0 into -SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        _stop(_INTERRUPTED, 130, lock)
    except Exception as e:
        # A SIGINT that surfaced as another error: an import it cut short fails as ImportError.
        if interrupts.received():
            logging.info("the job stopped on an interrupt", exc_info=e)  # job.INFO only
            _stop(_INTERRUPTED, 130, lock)
        if not isinstance(e, OSError):
            raise
        # An OS error: e.g. a workdir made read-only or removed mid-run.
        logging.info("the job stopped on an OS error", exc_info=e)  # job.INFO only
        where = f": {e.filename}" if e.filename else ""
        log = os.path.join(workdir, "job.INFO")
        # Without the teardown: there, the saves Orbax abandoned print their own warnings.
        _stop(f"{e.strerror or e}{where} (errno {e.errno}); the traceback is in {log}", 1, lock)


def _run(config, workdir: str, lock: PidLock) -> None:
    """The job, once the workdir is this process's."""
    from envace_jax import parallel

    # Library INFO lines (JAX, Orbax, absl) go to workdir/job.INFO; warnings still reach the
    # console beside the progress lines and the summary.
    logging.get_absl_handler().use_absl_log_file("job", workdir)
    flags.FLAGS.stderrthreshold = "warning"
    parallel.initialize_distributed()
    import jax

    # A job run on a train workdir (rehearsal_eval) keeps the train job's config.json.
    name = "config.json" if config.job == "train" else f"{config.job}_config.json"
    if jax.process_index() == 0:
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(config.to_dict(), f, indent=1)
    logging.info("workdir %s", workdir)

    from envace_jax import jobs  # heavy imports only after the config is known to be good
    from envace_jax.data.readers import TaskFileError
    from envace_jax.rewards.judges import JudgeFailed
    from envace_jax.runtime.checkpoint import UNAWAITED_READ, CheckpointError
    from envace_jax.runtime.workdir import use_compile_cache

    use_compile_cache(workdir)

    # A failed checkpoint write reaches the user once, as CheckpointError (below).
    logging.get_absl_handler().addFilter(_NoOrbaxTracebacks())  # every logger's records
    sys.unraisablehook = _drop_closed_loop_callbacks(sys.unraisablehook)
    warnings.filterwarnings("ignore", UNAWAITED_READ, RuntimeWarning)  # the same reads
    try:
        jobs.run(config, workdir, force=_FORCE.value)
    except (CheckpointError, JudgeFailed) as e:
        _stop(e, 1, lock)
    except TaskFileError as e:  # the task data: every bad record named, then exit 2
        _stop(e, 2, lock)


def cli():
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
