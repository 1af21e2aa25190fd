"""Run I/O shared by every job: building the mesh, tokenizer and model from a config
(`build`), Orbax checkpoints and their integrity checks, a run directory's layout and warm-start
lookup (`workdir`), metrics files and progress lines, the workdir lock and SIGINT handling."""
