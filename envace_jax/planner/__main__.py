"""`python -m envace_jax.planner`: the memory planner's command line (`planner.cli`)."""

from envace_jax.planner import cli

__doc__ = cli.__doc__  # absl prints the main module's docstring for --help

cli.cli()
