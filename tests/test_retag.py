"""Retagging a ChatML checkpoint for the tool-use layout (envace_jax.text.retag)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from envace_jax.text.chat import chat_layout, render_text
from envace_jax.text.retag import retag_checkpoint
from envace_jax.text.tokenizer import SPECIAL_TOKEN_TEXTS, load_tokenizer, special_ids
from envace_jax.text.trajectory import Role, encode_conversation
from tests.chat_samples import MULTI_TURN

# SmolLM2's template: plain ChatML, no tools.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPARE = ["<repo_name>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<jupyter>"]


def _chatml_dir(tmp_path, spare=SPARE, chatml=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A byte-level BPE checkpoint directory with ChatML tokens and `spare` special tokens
    (SmolLM2's layout in miniature): ids 0.. are the specials, then the 256 bytes."""
    specials = list(chatml) + list(spare)
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    src = tmp_path / "src"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    cfg["chat_template"] = CHATML_TEMPLATE
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "pad_token_id": 2}))
    (src / "model.safetensors").write_bytes(b"weights")
    return src


def test_retag_places_tags_on_spare_ids_and_keeps_the_rest(tmp_path):
    src = _chatml_dir(tmp_path)
    before = load_tokenizer(src)
    with pytest.raises(ValueError, match=r"<tool_call> \(tool_call_open: encodes to 11 ids\)"):
        special_ids(before)
    out = tmp_path / "out"
    plan = retag_checkpoint(src, out)

    tags = [t for t in SPECIAL_TOKEN_TEXTS.values() if t not in ("<|im_start|>", "<|im_end|>")]
    tags.remove("<|endoftext|>")
    assert plan == dict(zip(range(3, 9), tags, strict=True))  # spare ids in id order
    after = load_tokenizer(out)
    ids = special_ids(after)
    assert (ids.im_start, ids.im_end, ids.endoftext) == (1, 2, 0)
    assert [ids.tool_call_open, ids.tool_call_close] == [3, 4]
    assert [ids.tool_response_open, ids.tool_response_close, ids.think_open, ids.think_close] == [
        5,
        6,
        7,
        8,
    ]
    assert len(after) == len(before)  # the embedding matrix still fits
    text = 'Send 52 from account A3 {"amount": 52}'
    assert after.encode(text, add_special_tokens=False) == before.encode(
        text, add_special_tokens=False
    )
    assert after.pad_token_id == 0 and after.eos_token_id == 2
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0
    assert (out / "model.safetensors").read_bytes() == b"weights"

    # The tool-use layout is derived and a tool conversation round-trips through the ids.
    assert chat_layout(after).response_open == "<tool_response>\n"
    enc = encode_conversation(after, MULTI_TURN)
    assert after.decode(enc.ids) == render_text(after, MULTI_TURN)
    assert ids.tool_call_open in enc.ids and ids.tool_response_open in enc.ids
    assert {int(Role.ACT), int(Role.REHEARSE)} <= set(enc.roles)


def test_retag_errors_name_the_problem(tmp_path):
    few = _chatml_dir(tmp_path, spare=SPARE[:2])
    with pytest.raises(ValueError, match=r"6 tags to place .* only 2 spare"):
        retag_checkpoint(few, tmp_path / "out")
    no_chatml = tmp_path / "nochatml"
    no_chatml.mkdir()
    (no_chatml / "config.json").write_text("{}")
    (no_chatml / "tokenizer_config.json").write_text("{}")
    (no_chatml / "tokenizer.json").write_text(json.dumps({"added_tokens": []}))
    with pytest.raises(ValueError, match="lack the ChatML tokens"):
        retag_checkpoint(no_chatml, tmp_path / "out2")
    (no_chatml / "tokenizer.json").write_text('{"added_tokens":\n [}')
    with pytest.raises(ValueError, match=r"tokenizer.json: line 2"):
        retag_checkpoint(no_chatml, tmp_path / "out3")
    with pytest.raises(ValueError, match="is the source"):
        retag_checkpoint(no_chatml, no_chatml)


@pytest.mark.slow
def test_retagged_smollm2_encodes_a_demo_trajectory(smollm2_hf_dir, tmp_path):
    """SmolLM2-135M-Instruct, retagged, gives the demo domain's oracle trajectories with
    single-id tags and the same text as its template renders."""
    from envace_jax.envs.demo import generate_tasks, oracle_messages

    plan = retag_checkpoint(smollm2_hf_dir, tmp_path / "smol")
    assert list(plan) == list(range(3, 9))  # <repo_name> ... <issue_start>
    tok = load_tokenizer(tmp_path / "smol")
    messages = oracle_messages(generate_tasks(0, 1)[0])
    enc = encode_conversation(tok, messages)
    assert tok.decode(enc.ids) == render_text(tok, messages)
    assert special_ids(tok).tool_response_open in enc.ids
