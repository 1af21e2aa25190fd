"""The machine a benchmark ran on, recorded with its figures: a ratio measured on one CPU is a
claim about that CPU, its caches and its memory bandwidth, under the load it ran beside.

`write_json(path, figures)` writes a script's figures with a `machine` entry: CPU model, cores
(online and usable by this process), L2 and L3 sizes, the array-copy bandwidth measured when
the figures are written, the load average when the script started and when it wrote them, and
the Python, jax and jaxlib versions. `LOAD_AT_START` is taken when a script imports this
module, before its work.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

LOAD_AT_START = os.getloadavg()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _caches() -> dict[str, str]:
    """Cache sizes by level as the kernel reports them for CPU 0 (e.g. {'L2': '2048K'})."""
    out = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind in ("Unified", "Data") and level in ("2", "3"):
            out[f"L{level}"] = size
    return out


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large array copy (read + write): the memory bandwidth a decode step can
    stream weights at, best of `repeats`."""
    import numpy as np

    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def describe() -> dict:
    """The machine entry of a benchmark's JSON (see the module docstring)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cores_online": os.cpu_count(),
        "cores_usable": usable,
        "caches": _caches(),
        "copy_bandwidth_gb_per_s": round(copy_bandwidth() / 1e9, 2),
        "load_average_at_start": [round(x, 2) for x in LOAD_AT_START],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "versions": _versions(),
    }


def write_json(path: str, figures: dict, indent: int = 1) -> None:
    """`figures` and the machine they were measured on, to `path`."""
    with open(path, "w") as f:
        json.dump({**figures, "machine": describe()}, f, indent=indent)
