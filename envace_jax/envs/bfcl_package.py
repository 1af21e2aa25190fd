"""bfcl-eval's own virtual environment, shared by the BFCL harness (`eval.bfcl`) and the
`bfcl_multi_turn` domain (`envs.bfcl_multi_turn`).

`bfcl-eval` pins numpy 1.26 and many client SDKs, so it lives in a virtual environment of its
own, created on first use under `.cache/bfcl-venv` (or `$ENVACE_CACHE/bfcl-venv`) with the
pinned versions below and reused afterwards. Its data (questions, possible answers, multi-turn
function docs and executable backends) ships in the wheel: nothing is downloaded at run time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

BFCL_VERSION = "2026.3.23"
# bfcl-eval's own requirements at the versions tested together, minus sentence-transformers
# and faiss (memory_vector only, and they pull a CUDA torch), plus what its code imports
# without declaring (transformers for the local-model tokenizer, soundfile for qwen-agent).
BFCL_REQUIREMENTS = (
    "anthropic==2.14.0",
    "beautifulsoup4==4.15.0",
    "boto3==1.44.8",
    "cohere==5.18.0",
    "datamodel-code-generator==0.25.7",
    "filelock==3.20.0",
    "google-genai==3.6.1",
    "google-search-results==2.4.2",
    "html2text==2025.4.15",
    "huggingface_hub==2.4.0",
    "mistralai==1.7.0",
    "mpmath==1.3.0",
    "networkx==3.3",
    "numpy==1.26.4",
    "openai==3.57.0",
    "overrides==7.7.0",
    "pandas==3.0.6",
    "pydantic==2.14.4",
    "python-dotenv==1.2.4",
    "qwen-agent==0.0.34",
    "rank-bm25==0.2.2",
    "requests==2.34.2",
    "soundfile==0.14.0",
    "tabulate==0.10.0",
    "tenacity==9.1.4",
    "tokenizers==0.23.3",
    "tqdm==4.70.1",
    "transformers==5.24.0",
    "tree-sitter==0.21.3",
    "tree-sitter-java==0.21.0",
    "tree-sitter-javascript==0.21.4",
    "typer==0.29.2",
    "writer-sdk==3.0.0",
)


def default_venv() -> Path:
    root = os.environ.get("ENVACE_CACHE") or os.path.join(os.getcwd(), ".cache")
    return Path(root) / "bfcl-venv"


def _stamp() -> str:
    text = "\n".join((BFCL_VERSION, sys.version.split()[0], *BFCL_REQUIREMENTS))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_venv(path: Path) -> Path:
    """The venv's python, creating or rebuilding the venv when its pinned set changed."""
    python = path / "bin" / "python"
    stamp_file = path / ".envace-stamp"
    if python.exists() and stamp_file.exists() and stamp_file.read_text() == _stamp():
        return python
    start = time.perf_counter()
    print(
        f"[bfcl] creating the bfcl-eval {BFCL_VERSION} environment in {path} (once; a few minutes)",
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *BFCL_REQUIREMENTS], check=True)
    # --no-deps: its declared set would add sentence-transformers and faiss (see above).
    subprocess.run([*pip, "--no-deps", f"bfcl-eval=={BFCL_VERSION}"], check=True)
    subprocess.run([str(python), "-c", "import bfcl_eval.__main__"], check=True)
    stamp_file.write_text(_stamp())
    print(f"[bfcl] environment ready in {time.perf_counter() - start:.0f}s", flush=True)
    return python


def venv_environ(root: Path, extra: dict | None = None) -> dict:
    """The environment variables of a process run in the venv, with `root` as the package's
    project root (where it reads and writes result and score files)."""
    env = dict(os.environ)
    env.update(
        BFCL_PROJECT_ROOT=str(root),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTHONPATH", None)  # our venv's packages must not leak into theirs
    env.update(extra or {})
    return env
