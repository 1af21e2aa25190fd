"""A tiny Qwen3 for serving tests, its PyTorch greedy reference, and a server process.

The model is random except for one planted chain of tokens: from the last token of the forced
`{"name": "get_weather", "arguments": {"city": "` prefix (`serve.forced.prefix`), greedy
decoding writes `Paris"}}</tool_call><|im_end|>`. Each chain token gets an embedding along its
own axis, large enough to dominate the (small random) residual updates, and the LM head maps
that axis to the next chain token: a bigram planted into a real transformer. The planted axes
are zero for every other token and in every layer's output, so everything else is an ordinary
random model writing random text.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
FORCED_PREFIX = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
# Pieces of the planted continuation, each one token of the demo tokenizer.
# No newline before </tool_call> (the parser allows that): "\n" ends every generation prompt, so
# planting it would make every reply the same.
CHAIN = ["Paris", '"}}', "</tool_call>", "<|im_end|>"]
EXPECTED_ARGUMENTS = {"city": "Paris"}


MODEL = "tiny-qwen3"  # the name export_test_model serves under


def chat(content, **kw):
    """A chat-completions body with one user message."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def client(url: str, key: str) -> httpx.Client:
    """An HTTP client of the server at `url` that sends `key`, patient with slow CPU replies."""
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def error_of(resp, status):
    """The OpenAI-shaped error of `resp`, which must have `status`."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def single_id(tokenizer, piece: str) -> int:
    ids = tokenizer.encode(piece, add_special_tokens=False)
    assert len(ids) == 1, f"{piece!r} is {len(ids)} tokens in this tokenizer"
    return ids[0]


def export_test_model(out_dir: str, *, max_position_embeddings: int = 1024, seed: int = 0):
    """Writes the tiny planted Qwen3 with the demo tokenizer to out_dir (HF layout)."""
    from flax import nnx

    from envace_jax.models.config import get_preset
    from envace_jax.models.decoder import Decoder
    from envace_jax.models.hf_io import save_hf_model
    from envace_jax.text.chat import encode, render_text
    from envace_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    cfg = get_preset(
        "tiny-qwen3", vocab_size=len(tok), max_position_embeddings=max_position_embeddings
    )
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    prompt = render_text(
        tok, [{"role": "user", "content": "Weather?"}], [TOOL], add_generation_prompt=True
    )
    start = encode(tok, prompt + FORCED_PREFIX)[-1]
    chain = [start] + [single_id(tok, p) for p in CHAIN]
    assert len(set(chain)) == len(chain), "the planted chain must not repeat a token"
    emb = np.array(params["embed"]["embedding"])
    head = np.array(params["lm_head"]["kernel"])
    layers = params["layers"]
    o_proj = np.array(layers["attn"]["o_proj"]["kernel"])  # [L, H, D, E]
    down = np.array(layers["mlp"]["down_proj"]["kernel"])  # [L, F, E]
    axes = np.arange(len(chain) - 1)
    # The planted axes belong to the chain alone: no other token and no layer writes to them.
    emb[:, axes] = 0.0
    o_proj[..., axes] = 0.0
    down[..., axes] = 0.0
    head[axes, :] = 0.0
    for axis, (tok_id, nxt) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
        emb[tok_id] = 0.0
        emb[tok_id, axis] = 30.0
        head[axis, nxt] = 10.0
    params["embed"]["embedding"] = emb
    params["lm_head"]["kernel"] = head
    layers["attn"]["o_proj"]["kernel"] = o_proj
    layers["mlp"]["down_proj"]["kernel"] = down
    save_hf_model(params, cfg, out_dir, tokenizer=tok)
    return cfg


class TorchReference:
    """Greedy decoding with the transformers PyTorch model loaded from the exported directory."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(self, prompt_ids, max_new: int, stop_ids=()) -> list[int]:
        """New ids (the stop id included when reached)."""
        ids = list(prompt_ids)
        with self.torch.no_grad():
            for _ in range(max_new):
                logits = self.model(self.torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
                if ids[-1] in stop_ids:
                    break
        return ids[len(prompt_ids) :]


def port_file_path(model_dir: str) -> str:
    """A port file of its own for one server (its log is this path + '.log')."""
    return os.path.join(model_dir, f"port-{os.getpid()}-{time.monotonic_ns()}")


@contextlib.contextmanager
def running_server(
    model_dir: str, *extra: str, timeout: float = 180.0, port_file=None, preexec_fn=None
):
    """Starts `python -m envace_jax.serve` on a free loopback port; yields (base_url, process).
    The server is always stopped (SIGTERM, then SIGKILL if it does not exit)."""
    port_file = port_file or port_file_path(model_dir)
    log_path = port_file + ".log"
    cmd = [sys.executable, "-m", "envace_jax.serve", "--model", model_dir, "--port", "0"]
    cmd += ["--port-file", port_file, "--log-level", "warning", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn
        )
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; log:\n{open(log_path).read()}")
            time.sleep(0.2)
        port = int(open(port_file).read())
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
