"""Demo tokenizer: loading, special pieces, lossless byte-level coding, reproducible files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.text import decode, encode, load_tokenizer, special_ids
from envace_jax.text.tokenizer import DEMO_TOKENIZER_DIR, SPECIAL_TOKEN_TEXTS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_demo_tokenizer.py"
SHIPPED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Text the Rust tokenizers can encode: no lone surrogates.
encodable = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def test_demo_tokenizer_shape(tok):
    assert len(tok) == 2048
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert tok.chat_template
    total = sum((DEMO_TOKENIZER_DIR / f).stat().st_size for f in SHIPPED)
    assert total < 300_000, total


def test_special_ids_are_single_distinct_tokens(tok):
    ids = special_ids(tok)
    values = [getattr(ids, f) for f in SPECIAL_TOKEN_TEXTS]
    assert len(set(values)) == len(values)
    for field, text in SPECIAL_TOKEN_TEXTS.items():
        assert tok.convert_ids_to_tokens(getattr(ids, field)) == text
        # Inside running text the tag is still one id, with its neighbours separate.
        got = encode(tok, f"ab{text}cd")
        assert got.count(getattr(ids, field)) == 1
    # Chat-control tokens are special; tool/think tags are not (decoding skips only the former).
    assert decode(tok, [ids.im_start, ids.tool_call_open, ids.im_end]) == (
        "<|im_start|><tool_call><|im_end|>"
    )
    assert tok.decode([ids.im_start, ids.tool_call_open, ids.im_end], skip_special_tokens=True) == (
        "<tool_call>"
    )


@settings(max_examples=200, deadline=None)
@given(encodable)
def test_decode_inverts_encode(tok, text):
    assert decode(tok, encode(tok, text)) == text


@settings(max_examples=200, deadline=None)
@given(encodable, encodable)
def test_no_merge_crosses_a_newline(tok, a, b):
    # Every role boundary of the chat layout follows a newline or a special token; this is
    # what makes separately tokenised role pieces concatenate to the template's ids.
    assert encode(tok, a + "\n") + encode(tok, b) == encode(tok, a + "\n" + b)
    assert encode(tok, a + "<|im_end|>") + encode(tok, b) == encode(tok, a + "<|im_end|>" + b)


def test_domain_text_compresses(tok):
    text = (
        '<tool_call>\n{"name": "transfer_money", "arguments": {"from_account": "ACC-1234", '
        '"to_account": "ACC-98765", "amount": 120.5}}\n</tool_call>'
    )
    assert len(encode(tok, text)) < len(text) / 2.5


def test_missing_directory_is_named():
    with pytest.raises(FileNotFoundError, match="no/such/tokenizer"):
        load_tokenizer("no/such/tokenizer")


def test_plain_fast_tokenizer_loads_without_the_model_stack(tmp_path, monkeypatch):
    """A tokenizer whose config names the plain fast class loads as AutoTokenizer would load
    it, without AutoTokenizer: that one reads the model config, which imports PyTorch where
    it is installed (a third of the server's memory). Another class still goes through it."""
    code = (
        "import sys, json; from envace_jax.text.tokenizer import load_tokenizer; "
        "t = load_tokenizer(sys.argv[1]); "
        "print(json.dumps([type(t).__name__, 'torch' in sys.modules, t.encode('Hi <tool_call>')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "demo"], capture_output=True, text=True, check=True
    )
    name, torch_imported, ids = json.loads(out.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER_DIR), local_files_only=True)
    assert (name, ids) == (type(auto).__name__, auto.encode("Hi <tool_call>"))
    assert not torch_imported
    # A directory naming another class is loaded by AutoTokenizer, which resolves it.
    other = tmp_path / "other"
    shutil.copytree(DEMO_TOKENIZER_DIR, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Other"}))
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def recording(cls, path, **kw):
        calls.append(path)
        return real(cls, path, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recording))
    load_tokenizer("demo")
    load_tokenizer(other)
    assert calls == [str(other)]


def test_missing_chat_template_is_named(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER_DIR / name, tmp_path / name)
    with pytest.raises(ValueError, match=f"{tmp_path}.*no chat template"):
        load_tokenizer(tmp_path)


def test_special_ids_names_missing_pieces(tmp_path):
    for name in SHIPPED:
        shutil.copy(DEMO_TOKENIZER_DIR / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"] = [
        t for t in spec["added_tokens"] if t["content"] not in ("<think>", "</think>")
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="<think>.*</think>"):
        special_ids(tok)


def _generate(out: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, cwd=ROOT)


def test_generator_is_deterministic_and_shipped_files_are_current(tmp_path):
    _generate(tmp_path / "a")
    _generate(tmp_path / "b")
    for name in SHIPPED:
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes(), name
        assert a == (DEMO_TOKENIZER_DIR / name).read_bytes(), f"{name}: rerun {SCRIPT.name}"
