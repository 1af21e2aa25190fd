"""Conversation -> role-tagged token sequence (the trajectory format)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.text import (
    ConversationParseError,
    Role,
    decode,
    encode,
    encode_conversation,
    load_tokenizer,
    parse_conversation,
    prompt_ids,
    render,
    role_pieces,
    tool_responses_ids,
)
from tests.chat_samples import ACT1, ACT2, ACT4, MULTI_TURN, TOOLS, call


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


# The generated spans of MULTI_TURN, written by hand: (role, text).
SPANS = [
    (Role.ACT, ACT1 + "<|im_end|>"),
    (
        Role.REHEARSE,
        '{"status": "shipped"}\n</tool_response>\n<tool_response>\n{"status": "pending"}'
        "\n</tool_response><|im_end|>",
    ),
    (Role.ACT, ACT2 + "<|im_end|>"),
    (Role.REHEARSE, '{"cancelled": true}\n</tool_response><|im_end|>'),
    (Role.ACT, "ORD-1 shipped; ORD-2 is cancelled.<|im_end|>"),
    (Role.ACT, ACT4 + "<|im_end|>"),
    (Role.REHEARSE, "\n 42.0 \n\n</tool_response><|im_end|>"),
    (Role.ACT, "Your balance is 42.0.<|im_end|>"),
]


def test_spans_roles_and_segments(tok):
    enc = encode_conversation(tok, MULTI_TURN, TOOLS)
    assert enc.ids.dtype == np.int32 and enc.roles.dtype == np.int8
    assert enc.segments.dtype == np.int32
    assert list(enc.ids) == render(tok, MULTI_TURN, TOOLS)
    assert enc.num_segments == len(SPANS)
    assert enc.segment_roles() == [r for r, _ in SPANS]
    for s, (role, text) in enumerate(SPANS, start=1):
        mask = enc.segments == s
        idx = np.flatnonzero(mask)
        assert np.all(np.diff(idx) == 1), "a segment is contiguous"
        assert decode(tok, enc.ids[mask]) == text
        assert np.all(enc.roles[mask] == role)
    context = enc.segments == 0
    assert np.all(enc.roles[context] == Role.CONTEXT)
    # CONTEXT is the prompt, the glue and the second user turn.
    text = decode(tok, enc.ids[context])
    assert text.startswith("<|im_start|>system\nYou run errands.")
    assert "  Thanks!\nAnd my balance?" in text and "shipped" not in text


def test_matches_role_piece_composition(tok):
    # Build the tagged sequence as a sampler would: glue is CONTEXT, spans are generated.
    rp = role_pieces(tok)
    ids, roles, segs = [], [], []

    def add(piece, role=Role.CONTEXT, seg=0):
        piece = list(piece)
        ids.extend(piece)
        roles.extend([role] * len(piece))
        segs.extend([seg] * len(piece))

    add(prompt_ids(tok, MULTI_TURN[:2], TOOLS))
    glue_after = [
        rp.act_to_rehearse,
        rp.rehearse_to_act,
        rp.act_to_rehearse,
        rp.rehearse_to_act,
        rp.final_to_user_prefix
        + tuple(encode(tok, "  Thanks!\nAnd my balance?"))
        + rp.user_to_act_suffix,
        rp.act_to_rehearse,
        rp.rehearse_to_act,
        tuple(encode(tok, "\n")),
    ]
    for s, ((role, text), glue) in enumerate(zip(SPANS, glue_after, strict=True), start=1):
        add(encode(tok, text), role, s)
        add(glue)
    enc = encode_conversation(tok, MULTI_TURN, TOOLS)
    np.testing.assert_array_equal(enc.ids, ids)
    np.testing.assert_array_equal(enc.roles, roles)
    np.testing.assert_array_equal(enc.segments, segs)


def test_real_environment_observations_are_context(tok):
    enc = encode_conversation(tok, MULTI_TURN, TOOLS, rehearse=False)
    acts = [text for role, text in SPANS if role == Role.ACT]
    assert list(enc.ids) == render(tok, MULTI_TURN, TOOLS)
    assert enc.segment_roles() == [Role.ACT] * len(acts)
    for s, text in enumerate(acts, start=1):
        assert decode(tok, enc.ids[enc.segments == s]) == text
    assert '{"cancelled": true}' in decode(tok, enc.ids[enc.roles == Role.CONTEXT])


def test_generation_prompt_and_bad_start(tok):
    enc = encode_conversation(tok, MULTI_TURN[:2], TOOLS, add_generation_prompt=True)
    assert list(enc.ids) == prompt_ids(tok, MULTI_TURN[:2], TOOLS)
    assert enc.num_segments == 0 and not enc.roles.any()
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        encode_conversation(tok, [{"role": "assistant", "content": "hi"}])


words = st.lists(st.sampled_from(["a", "b c", "\n", " ", "{}", '"x"', "9", "é"]), max_size=12)
text = words.map("".join)


def _js(c):
    return json.dumps(c["function"]["arguments"]["q"], ensure_ascii=False)


@st.composite
def conversation_and_spans(draw):
    msgs = [{"role": "user", "content": draw(text)}]
    spans = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 3))
        content = draw(text)
        calls = [call(f"tool_{i}", {"q": draw(text)}) for i in range(n)]
        msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
        blocks = "\n".join(
            f'<tool_call>\n{{"name": "tool_{i}", "arguments": {{"q": {_js(c)}}}}}\n</tool_call>'
            for i, c in enumerate(calls)
        )
        spans.append((Role.ACT, (content + "\n" if content else "") + blocks + "<|im_end|>"))
        bodies = [draw(text) for _ in range(n)]
        msgs += [{"role": "tool", "content": b} for b in bodies]
        joined = "\n</tool_response>\n<tool_response>\n".join(bodies)
        spans.append((Role.REHEARSE, joined + "\n</tool_response><|im_end|>"))
    final = draw(text)
    msgs.append({"role": "assistant", "content": final})
    spans.append((Role.ACT, final + "<|im_end|>"))
    return msgs, spans


@settings(max_examples=60, deadline=None)
@given(conversation_and_spans())
def test_fuzz_spans_are_what_each_role_writes(tok, case):
    msgs, spans = case
    enc = encode_conversation(tok, msgs)
    assert list(enc.ids) == render(tok, msgs)
    assert enc.segment_roles() == [r for r, _ in spans]
    for s, (_, span_text) in enumerate(spans, start=1):
        assert decode(tok, enc.ids[enc.segments == s]) == span_text


def test_template_that_marks_a_trailing_answer(tok):
    # Qwen3's own template puts an empty <think> block before a trailing answer, so a
    # rendering that stops after an assistant message is not a prefix of the whole. The
    # derivations avoid such prefixes; check with a template that behaves that way.
    qwen_like = load_tokenizer("demo")
    qwen_like.chat_template = tok.chat_template.replace(
        "'<|im_start|>assistant\\n' + content",
        "'<|im_start|>assistant\\n' + ('<think>\\n\\n</think>\\n\\n' if loop.last else '')"
        " + content",
    )
    assert qwen_like.chat_template != tok.chat_template
    assert role_pieces(qwen_like) == role_pieces(tok)
    rendered = render(qwen_like, MULTI_TURN, TOOLS)
    assert rendered != render(tok, MULTI_TURN, TOOLS)
    enc = encode_conversation(qwen_like, MULTI_TURN, TOOLS)
    assert list(enc.ids) == rendered
    assert enc.segment_roles() == [r for r, _ in SPANS]
    last = decode(qwen_like, enc.ids[enc.segments == enc.num_segments])
    assert last == "<think>\n\n</think>\n\n" + SPANS[-1][1]
    for s, (_, text) in enumerate(SPANS[:-1], start=1):
        assert decode(qwen_like, enc.ids[enc.segments == s]) == text
    # This template inserts text no message holds, so it cannot be inverted; the parser says so
    # instead of returning messages that render differently.
    with pytest.raises(ConversationParseError, match="does not re-render"):
        parse_conversation(qwen_like, rendered)


def test_tool_responses_ids_are_the_rehearse_segments(tok):
    enc = encode_conversation(tok, MULTI_TURN, TOOLS)
    bodies = [
        ['{"status": "shipped"}', '{"status": "pending"}'],
        ['{"cancelled": true}'],
        ["\n 42.0 \n"],
    ]
    rehearse = [s for s, r in enumerate(enc.segment_roles(), start=1) if r == Role.REHEARSE]
    for s, responses in zip(rehearse, bodies, strict=True):
        assert tool_responses_ids(tok, responses) == list(enc.ids[enc.segments == s])
