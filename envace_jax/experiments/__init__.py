"""Studies built from train jobs: the mode comparison with its verdicts (`compare`, `verdicts`)
and the stability study (`stability`)."""
