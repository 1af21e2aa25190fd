"""The job entry point.

    python -m envace_jax.main --config configs/demo.py --workdir workdir/demo
    python -m envace_jax.main --config configs/demo.py:smoke --config.seed=1 --workdir /tmp/x

The config is validated before anything is built or compiled; a wrong key or value is an error
that names it. A multi-process run (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, as `tpu_scripts/worker_run.sh` sets them on a pod slice, or SLURM / Open MPI)
calls `jax.distributed.initialize` before anything touches a device; every process runs this
same command.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from envace_jax.configuration import ConfigError, validate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Job config file (`path.py` or `path.py:variant`).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and exports.")


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
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from envace_jax import parallel

    parallel.initialize_distributed()
    import jax

    workdir = os.path.abspath(_WORKDIR.value)
    os.makedirs(workdir, exist_ok=True)
    # A job run on a train workdir (rehearsal_eval) keeps the train job's config.json.
    name = "config.json" if config.job == "train" else f"{config.job}_config.json"
    if jax.process_index() == 0:
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(config.to_dict(), f, indent=1)
    logging.info("workdir %s", workdir)

    from envace_jax import jobs  # heavy imports only after the config is known to be good

    jobs.run(config, workdir)


def cli():
    app.run(main)


if __name__ == "__main__":
    cli()
