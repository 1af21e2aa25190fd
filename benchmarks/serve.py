"""Server throughput and latency, measured in one run against a live server on localhost.

For 1, 4 and 16 concurrent streaming clients (each sending requests back to back), prints
requests/s, generated tokens/s and time to first token (the first streamed text chunk); then
sends the same 16 requests once all at once (batched by the server) and once one after another,
and prints the batched-over-sequential throughput ratio. Target: >= 3x at 16 clients.

    python benchmarks/serve.py [--model DIR] [--preset demo-qwen3] [--max-tokens 64]

Without --model, a random model of the preset is exported with the demo tokenizer. Compile
time is excluded: every configuration is run once before it is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def export_model(out_dir: str, preset: str) -> None:
    from flax import nnx

    from envace_jax.models.config import get_preset
    from envace_jax.models.decoder import Decoder
    from envace_jax.models.hf_io import save_hf_model
    from envace_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    cfg = get_preset(preset, vocab_size=len(tok), max_position_embeddings=2048)
    save_hf_model(Decoder(cfg, rngs=nnx.Rngs(0)), cfg, out_dir, tokenizer=tok)


def start_server(model_dir: str, work: str, extra: list[str]):
    port_file = os.path.join(work, "port")
    cmd = [sys.executable, "-m", "envace_jax.serve", "--model", model_dir, "--port", "0"]
    cmd += ["--port-file", port_file, "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{int(open(port_file).read())}/v1"


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int):
    """Streams one completion; returns (seconds to first text, total seconds, tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("text") for c in chunk["choices"]):
                first = time.perf_counter() - start
    return first if first is not None else float("nan"), time.perf_counter() - start, tokens


def prompts(k: int) -> list[str]:
    return [
        f"<|im_start|>user\nOrder {i}: two umbrellas to Oslo<|im_end|>\n<|im_start|>assistant\n"
        for i in range(k)
    ]


async def clients_run(url, model, clients: int, per_client: int, max_tokens: int):
    """`clients` concurrent clients, each sending `per_client` requests back to back."""
    async with httpx.AsyncClient(timeout=600) as http:

        async def client(c):
            out = []
            for p in prompts(per_client):
                out.append(await one_request(http, url, model, f"{c} {p}", max_tokens))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - start
    flat = [r for rs in results for r in rs]
    return wall, flat


async def burst(url, model, k: int, max_tokens: int, sequential: bool) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        if sequential:
            res = [await one_request(http, url, model, p, max_tokens) for p in prompts(k)]
        else:
            res = await asyncio.gather(
                *(one_request(http, url, model, p, max_tokens) for p in prompts(k))
            )
        return time.perf_counter() - start, sum(r[2] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF model directory (default: export one)")
    ap.add_argument("--preset", default="demo-qwen3", help="preset exported without --model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=4, help="requests per client")
    ap.add_argument("--server-arg", action="append", default=[])
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model
        if model_dir is None:
            model_dir = os.path.join(work, "model")
            export_model(model_dir, args.preset)
        proc, url = start_server(model_dir, work, args.server_arg)
        try:
            model = httpx.get(url + "/models").json()["data"][0]["id"]
            rows = []
            for clients in (1, 4, 16):
                asyncio.run(clients_run(url, model, clients, 1, args.max_tokens))  # compile
                wall, res = asyncio.run(
                    clients_run(url, model, clients, args.per_client, args.max_tokens)
                )
                ttft = [r[0] for r in res]
                rows.append(
                    (
                        clients,
                        len(res) / wall,
                        sum(r[2] for r in res) / wall,
                        statistics.mean(ttft) * 1000,
                        statistics.median(ttft) * 1000,
                    )
                )
            print(f"\n{'clients':>8} {'req/s':>8} {'tok/s':>9} {'TTFT mean ms':>13} {'p50 ms':>8}")
            for c, rps, tps, mean, p50 in rows:
                print(f"{c:>8} {rps:>8.2f} {tps:>9.1f} {mean:>13.1f} {p50:>8.1f}")

            for sequential in (False, True):  # compile the programs of both (rows, widths)
                asyncio.run(burst(url, model, 16, args.max_tokens, sequential))
            t_batched, n_batched = asyncio.run(burst(url, model, 16, args.max_tokens, False))
            t_seq, n_seq = asyncio.run(burst(url, model, 16, args.max_tokens, True))
            ratio = (n_batched / t_batched) / (n_seq / t_seq)
            print(
                f"\n16 requests: batched {t_batched:.2f}s ({n_batched} tokens), sequential "
                f"{t_seq:.2f}s ({n_seq} tokens)"
            )
            print(f"batched / sequential throughput: {ratio:.1f}x (target >= 3x)")
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
