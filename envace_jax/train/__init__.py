"""The train job: warm start -> RL -> held-out evaluation (`trainer`), what each training mode
decides inside that loop (`strategies`), the warm start's demonstrations, the evaluations and
copy diagnostics, the report, and the headroom job (pass@k against greedy)."""
