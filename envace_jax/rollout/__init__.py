"""Rollouts that make training batches: world rehearsal in the shared view (`world_rehearsal`)
and the grounded view (`grounded`), host turns in a real or corrupted environment
(`real_env`), two parameter sets in one decode loop (`role_models`), and parsing sampled
trajectories into episodes (`episodes`)."""
