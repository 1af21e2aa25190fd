"""What `envace_jax.main` runs once the config is validated."""

from __future__ import annotations

import ml_collections


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """The EnvACE training job: warm start, world-rehearsal RL, real-environment evaluation."""
    from envace_jax.trainer import Trainer

    return Trainer(config, workdir).run()
