"""What `envace_jax.main` runs once the config is validated: the job `config.job` names, given
the typed config (`configuration.JobConfig`) from here down."""

from __future__ import annotations

import ml_collections

from envace_jax.configuration import load


def run(config: ml_collections.ConfigDict, workdir: str, force: bool = False) -> dict:
    """'train': the EnvACE training job (warm start, world-rehearsal RL, real-environment
    evaluation). 'rehearsal_eval': test-time rehearsal of a trained workdir
    (`testtime.rehearsal_eval`). 'headroom': greedy, pass@1 and pass@k of a trained workdir's
    policies (`train.headroom`). force: a finished train job redoes its final evaluation."""
    job = load(config)
    if job.job == "headroom":
        from envace_jax.train.headroom import run as headroom

        return headroom(job, workdir)
    if job.job == "rehearsal_eval":
        from envace_jax.testtime.rehearsal_eval import run as rehearsal_eval

        return rehearsal_eval(job, workdir)
    from envace_jax.train.trainer import Trainer

    return Trainer(job, workdir).run(force=force)
