"""Server throughput, latency and memory, measured in one run against a live server on localhost.

1. On the fresh server: 16 concurrent chat requests without `max_tokens` (each may use the rest
   of the context), then the server's peak resident memory (target: < 1.5 GB for SmolLM2-135M
   at its 8k context).
2. For 1, 4, 16 and 32 concurrent streaming clients (each sending requests back to back):
   requests/s, generated tokens/s, time to first token (the first streamed text chunk) and
   inter-token latency (a request's time after its first chunk over its later tokens), p50 and
   p95.
3. The same 16 requests once all at once (batched by the server) and once one after another:
   the batched-over-sequential throughput ratio (target: >= 3x), the median of `--burst-pairs`
   pairs run back to back.

    make smollm2 && python benchmarks/serve.py --model workdir/smollm2 --json serve.json
    python benchmarks/serve.py [--preset demo-qwen3] [--max-tokens 64]

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
import machine


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


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int | None, chat=False
):
    """Streams one completion (a chat completion with `prompt` as the user message when
    `chat`; no `max_tokens` when n is None); returns (seconds to first text, total seconds,
    tokens)."""
    body = {"model": model, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if n is not None:
        body["max_tokens"] = n
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    first, tokens = None, 0
    path = "/chat/completions" if chat else "/completions"
    async with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk["choices"]
            texts = [c.get("text") or (c.get("delta") or {}).get("content") for c in choices]
            if first is None and any(texts):
                first = time.perf_counter() - start
    return first if first is not None else float("nan"), time.perf_counter() - start, tokens


def percentile(values, q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


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


def latency_rows(url, model, max_tokens: int, per_client: int, levels) -> list[dict]:
    rows = []
    for clients in levels:
        # The same run untimed first: it compiles every program the timed one meets.
        asyncio.run(clients_run(url, model, clients, per_client, max_tokens))
        wall, res = asyncio.run(clients_run(url, model, clients, per_client, max_tokens))
        ttft = [r[0] * 1000 for r in res]
        itl = [(r[1] - r[0]) * 1000 / (r[2] - 1) for r in res if r[2] > 1]
        rows.append(
            {
                "clients": clients,
                "req_per_s": len(res) / wall,
                "tok_per_s": sum(r[2] for r in res) / wall,
                "ttft_ms_p50": percentile(ttft, 0.5),
                "ttft_ms_p95": percentile(ttft, 0.95),
                "itl_ms_p50": percentile(itl, 0.5),
                "itl_ms_p95": percentile(itl, 0.95),
            }
        )
    head = ("clients", "req/s", "tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95")
    print("\n" + " ".join(f"{h:>9}" for h in head) + "   (ms)")
    for r in rows:
        vals = [f"{v:>9.2f}" if isinstance(v, float) else f"{v:>9}" for v in r.values()]
        print(" ".join(vals))
    return rows


async def full_context_burst(url, model, k: int) -> int:
    """`k` concurrent short chat requests, each with the whole context as its budget."""
    async with httpx.AsyncClient(timeout=600) as http:
        res = await asyncio.gather(
            *(
                one_request(http, url, model, f"Say hello to customer {i}.", None, chat=True)
                for i in range(k)
            )
        )
    return sum(r[2] for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF model directory (default: export one)")
    ap.add_argument("--preset", default="demo-qwen3", help="preset exported without --model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=4, help="requests per client")
    ap.add_argument("--clients", default="1,4,16,32", help="concurrency levels to time")
    ap.add_argument("--burst-pairs", type=int, default=5, help="batched + sequential pairs")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model
        if model_dir is None:
            model_dir = os.path.join(work, "model")
            export_model(model_dir, args.preset)
        proc, url = start_server(model_dir, work, args.server_arg)
        try:
            model = httpx.get(url + "/models").json()["data"][0]["id"]
            # Memory first, on the fresh server: the later 32-client runs keep their programs.
            full = asyncio.run(full_context_burst(url, model, 16))
            rss = peak_rss_mb(proc.pid)
            print(
                f"16 concurrent chat requests without max_tokens: {full} tokens in all; server "
                f"peak RSS {rss:.0f} MB (target < 1536 MB for SmolLM2-135M at its full context)"
            )
            levels = [int(c) for c in args.clients.split(",")]
            rows = latency_rows(url, model, args.max_tokens, args.per_client, levels)

            for sequential in (False, True):  # compile the programs of both (rows, widths)
                asyncio.run(burst(url, model, 16, args.max_tokens, sequential))
            # Pairs run back to back: the machine's load drifts between minutes, not within one.
            ratios = []
            for _ in range(args.burst_pairs):
                t_batched, n_batched = asyncio.run(burst(url, model, 16, args.max_tokens, False))
                t_seq, n_seq = asyncio.run(burst(url, model, 16, args.max_tokens, True))
                ratios.append((n_batched / t_batched) / (n_seq / t_seq))
                print(
                    f"16 requests: batched {t_batched:.2f}s ({n_batched} tokens), sequential "
                    f"{t_seq:.2f}s ({n_seq} tokens): {ratios[-1]:.2f}x"
                )
            ratio = statistics.median(ratios)
            print(
                f"batched / sequential throughput: {ratio:.2f}x, median of {len(ratios)} pairs "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}; target >= 3x)"
            )
            if args.json:
                machine.write_json(
                    args.json,
                    {
                        "model": args.model or args.preset,
                        "max_tokens": args.max_tokens,
                        "clients": rows,
                        "batched_over_sequential_16": ratio,
                        "batched_over_sequential_16_pairs": ratios,
                        "peak_rss_mb": rss,
                        "full_context_tokens": full,
                    },
                    indent=2,
                )
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
