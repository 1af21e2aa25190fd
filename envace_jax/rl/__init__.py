"""Role-wise GRPO and SFT: trajectory batches, advantages, losses, optimizer and train steps.

Import the modules themselves (`envace_jax.rl.steps`, `envace_jax.rl.config`, ...): this package
re-exports nothing, so that reading the step configs (`rl.config`) imports no JAX.
"""
