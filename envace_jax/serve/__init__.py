"""OpenAI-compatible HTTP serving of a policy over the compiled sampler.

    python -m envace_jax.serve --model DIR [--port 8000] [--api-key KEY]

`batcher.Engine` batches concurrent requests into the jitted decode loop; `app.create_app`
exposes it as `/v1/models`, `/v1/completions` and `/v1/chat/completions` (tools, streaming).
"""
