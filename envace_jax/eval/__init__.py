"""Benchmark evaluation against a served policy (OpenAI-compatible HTTP).

`bfcl` runs the official BFCL-v4 package in its own virtual environment; `tau2` and
`vitabench` launch those harnesses against our server; `finmcp` holds FinMCP-Bench's tool-call
metrics and an offline replay harness. See docs/benchmarks.md.
"""
