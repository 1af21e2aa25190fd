"""Will a job fit a TPU slice? Memory estimates per device (`estimate`), slice topologies
(`topology`), the command line (`cli`, `python -m envace_jax.planner`) and the Qwen3 TPU
configs' helper (`tpu_configs`)."""
