"""EnvACE in JAX: one policy that acts and rehearses the environment, trained by role-wise GRPO."""

__version__ = "0.1.0"
