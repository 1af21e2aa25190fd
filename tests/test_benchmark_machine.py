"""The machine entry every benchmark's JSON carries, read from this machine's own reports."""

import importlib.util
import json
import os
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "machine", Path(__file__).resolve().parents[1] / "benchmarks" / "machine.py"
)
machine = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(machine)


def test_the_machine_entry_names_cpu_caches_bandwidth_load_and_versions(tmp_path):
    path = tmp_path / "figures.json"
    machine.write_json(str(path), {"ratio": 1.5})
    got = json.loads(path.read_text())
    assert got["ratio"] == 1.5
    m = got["machine"]
    assert m["cpu"] and m["cores_online"] == os.cpu_count()
    assert 1 <= m["cores_usable"] <= m["cores_online"]
    cache_dir = Path("/sys/devices/system/cpu/cpu0/cache")
    if cache_dir.exists():  # Linux: L3 as the kernel reports it, e.g. '32768K'
        sizes = {
            (d / "level").read_text().strip(): (d / "size").read_text().strip()
            for d in cache_dir.glob("index*")
            if (d / "level").exists()
        }
        assert m["caches"].get("L3") == sizes.get("3")
    assert m["copy_bandwidth_gb_per_s"] > 0.1
    assert len(m["load_average_at_start"]) == len(m["load_average_at_end"]) == 3
    import jax

    assert m["versions"]["jax"] == jax.__version__
