"""Serving chat templates other than the Qwen3 tool-use layout: SmolLM2's own ChatML template
(a default system turn, no tools) is served, and a template that cannot be served is refused
with what it lacks. References: transformers' rendering of the same template and the
transformers PyTorch model's greedy decoding."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.serve_helpers import REPO, TOOL, TorchReference, export_test_model, running_server

# SmolLM2-135M-Instruct's chat template, as its GGUF metadata carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Plain text turns: nothing special ends an assistant message, so a reply has no stop id.
NO_STOP_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
NO_PROMPT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n'}}{% endfor %}"
)


def with_template(src: str, dst: str, template: str) -> str:
    """A copy of the model directory `src` whose tokenizer has chat template `template`."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
        f.write(template)
    return dst


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("templates") / "qwen3")
    export_test_model(path, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def chatml_dir(qwen3_dir):
    return with_template(qwen3_dir, qwen3_dir + "-chatml", SMOLLM2_TEMPLATE)


def _tokenizer(path):
    from envace_jax.text.tokenizer import load_tokenizer

    return load_tokenizer(path)


def test_chatml_template_serves_without_tools(chatml_dir, qwen3_dir):
    from envace_jax.text.serving_template import serving_template

    tok = _tokenizer(chatml_dir)
    chatml, qwen3 = serving_template(tok), serving_template(_tokenizer(qwen3_dir))
    im_end, endoftext = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert (chatml.stop_id, chatml.abort_ids, chatml.tools) == (im_end, (endoftext,), False)
    assert chatml.tool_call_id == -1
    assert (qwen3.stop_id, qwen3.tools) == (im_end, True)
    assert qwen3.tool_call_id == tok.convert_tokens_to_ids("<tool_call>")


@pytest.mark.parametrize(
    "template, lacks",
    [(NO_STOP_TEMPLATE, "end-of-turn token"), (NO_PROMPT_TEMPLATE, "add_generation_prompt")],
)
def test_template_that_cannot_serve_names_what_it_lacks(qwen3_dir, tmp_path, template, lacks):
    from envace_jax.text.chat import TemplateLayoutError
    from envace_jax.text.serving_template import serving_template

    path = with_template(qwen3_dir, str(tmp_path / "bad"), template)
    with pytest.raises(TemplateLayoutError, match=lacks):
        serving_template(_tokenizer(path))
    # The server refuses it at start with that one line, before loading the weights.
    cmd = [sys.executable, "-m", "envace_jax.serve", "--model", path, "--port", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert lacks in proc.stderr and "Traceback" not in proc.stderr


def test_server_renders_the_default_system_turn_and_refuses_tools(chatml_dir):
    tok = _tokenizer(chatml_dir)
    messages = [{"role": "user", "content": "Do you sell umbrellas?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = tok.encode(prompt, add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    want = TorchReference(chatml_dir).greedy(ids, 24, stop_ids={im_end})
    want_text = tok.decode([i for i in want if i != im_end], skip_special_tokens=False)
    body = {"model": "qwen3-chatml", "messages": messages, "max_tokens": 24, "temperature": 0}
    with running_server(chatml_dir) as (url, _):
        with httpx.Client(timeout=300) as c:
            out = c.post(url + "/v1/chat/completions", json=body).json()
            refused = c.post(url + "/v1/chat/completions", json={**body, "tools": [TOOL]})
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == want_text
    assert out["choices"][0]["finish_reason"] == ("stop" if want[-1] == im_end else "length")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tools" and "does not render tools" in error["message"]
