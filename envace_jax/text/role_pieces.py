"""Role-switch token pieces, derived from the tokenizer's chat template.

A world-rehearsal trajectory is one token sequence in the chat layout. The sampler builds it
by alternating generated spans with fixed glue::

    prompt (ends with act_start)
    ACT      <- the assistant message: content, tool-call blocks, then act_end (the stop id)
    act_to_rehearse                          "\\n<|im_start|>user\\n<tool_response>\\n"
    REHEARSE <- response bodies joined by tool_response_sep, then rehearse_end
    rehearse_to_act                          "\\n<|im_start|>assistant\\n"
    ACT ... final reply + act_end
    final_to_user_prefix                     "\\n<|im_start|>user\\n"
    user text (CONTEXT)
    user_to_act_suffix                       "<|im_end|>\\n<|im_start|>assistant\\n"
    ACT ...

Where the REHEARSE span ends: the REHEARSE role writes every response body of the turn, the
separators between them (``\\n</tool_response>\\n<tool_response>\\n``) and the closing
``\\n</tool_response><|im_end|>``; the glue before it stops at the first body. Its stop id is
the end-of-turn token, as for ACT. So the role knows how many responses to write from the calls
it reads, and a span is exactly what the template renders between the glue pieces.

The strings in the diagram are what the Qwen3 layout renders; the pieces themselves are found
by rendering a probe conversation with the template and cutting it at probe texts, and the
derivation checks that the pieces, tokenised separately, concatenate to the template's ids. That
holds when every boundary sits at a special token or right after a newline that the tokenizer
keeps as its own pre-token (the demo tokenizer does). A tokenizer where a BPE merge crosses a
boundary gets a TemplateLayoutError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from envace_jax.text.chat import (
    TemplateLayoutError,
    cached_per_tokenizer,
    chat_layout,
    encode,
    probe_call,
    render,
    render_text,
    split_once,
)
from envace_jax.text.untrusted import Marked, choose_mark, encode_marked, mark_text

Ids = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RolePieces:
    """Token ids of the chat layout's role-switch glue (see the module docstring)."""

    act_start: Ids  # the generation prompt: header of an assistant message
    act_end: Ids  # ends an assistant message; its one id is the ACT stop id
    act_to_rehearse: Ids  # after an ACT message with tool calls, up to the first response body
    tool_response_sep: Ids  # between two response bodies of one tool-response turn
    rehearse_end: Ids  # closes the last response and the turn; ends with the stop id
    rehearse_to_act: Ids  # after a tool-response turn, up to the next assistant content
    final_to_user_prefix: Ids  # after a final reply, up to the next user message's text
    user_to_act_suffix: Ids  # after a user message's text, up to the assistant content

    @classmethod
    def from_tokenizer(cls, tokenizer) -> RolePieces:
        """Derive the pieces from the tokenizer's chat template (cached per tokenizer)."""
        return role_pieces(tokenizer)

    @property
    def stop_id(self) -> int:
        """The id that ends both ACT and REHEARSE spans (``<|im_end|>`` in the Qwen3 layout)."""
        return self.act_end[-1]


_M = {  # probe texts: plain ASCII words, so no merge joins them to the glue around them
    "user1": "qzuseroneq",
    "act1": "qzactoneq",
    "resp1": "qzrespaq",
    "resp2": "qzrespbq",
    "act2": "qzacttwoq",
    "resp3": "qzrespcq",
    "act3": "qzactthreeq",
    "user2": "qzusertwoq",
}


def probe_conversation() -> tuple[list[dict], list[dict]]:
    """(messages, tools) of the probe: two calls answered in one turn, a second round with
    one call, a final reply, a second user turn (rendered with a generation prompt)."""
    tools = [
        {
            "type": "function",
            "function": {"name": n, "parameters": {"type": "object"}},
        }
        for n in ("probe_fn_one", "probe_fn_two")
    ]
    messages = [
        {"role": "system", "content": "qzsystemq"},
        {"role": "user", "content": _M["user1"]},
        {
            "role": "assistant",
            "content": _M["act1"],
            "tool_calls": [probe_call("probe_fn_one", "x"), probe_call("probe_fn_two", "y")],
        },
        {"role": "tool", "content": _M["resp1"]},
        {"role": "tool", "content": _M["resp2"]},
        {
            "role": "assistant",
            "content": _M["act2"],
            "tool_calls": [probe_call("probe_fn_one", "z")],
        },
        {"role": "tool", "content": _M["resp3"]},
        {"role": "assistant", "content": _M["act3"]},
        {"role": "user", "content": _M["user2"]},
    ]
    return messages, tools


def _derive(tokenizer) -> RolePieces:
    eot = chat_layout(tokenizer).end_of_turn
    messages, tools = probe_conversation()
    full = render_text(tokenizer, messages, tools, add_generation_prompt=True)
    cuts = _cut_rendering(full, eot)
    text = dict(cuts)

    user_to_act = text["user1"][len(_M["user1"]) :]
    user2_tail = text["user2_and_prompt"][len(_M["user2"]) :]
    reh1, reh2 = text["rehearse1"], text["rehearse2"]
    sep = reh1[len(_M["resp1"]) : reh1.index(_M["resp2"])]
    rehearse_end = reh1[reh1.index(_M["resp2"]) + len(_M["resp2"]) :]
    act_end = text["act3"][len(_M["act3"]) :]
    checks = [
        ("prompt", full.startswith(render_text(tokenizer, messages[:2], tools, True))),
        ("second user turn", user2_tail == user_to_act),
        ("second tool round glue", text["act_to_rehearse_2"] == text["act_to_rehearse"]),
        ("second tool round glue", text["rehearse_to_act_2"] == text["rehearse_to_act"]),
        ("single-response turn", reh2 == _M["resp3"] + rehearse_end),
        ("rehearse span ends with the end-of-turn token", rehearse_end.endswith(eot)),
        ("final reply", act_end == eot),
        ("spans start at the probe texts", text["act1"].startswith(_M["act1"])),
    ]
    for what, ok in checks:
        if not ok:
            raise TemplateLayoutError(f"chat template does not render the Qwen3 layout: {what}")
    gen = render_text(tokenizer, messages[:2], tools, True)
    act_start = gen[len(render_text(tokenizer, messages[:2], tools)) :]

    # Token level: the pieces, tokenised separately, must concatenate to the template's ids.
    pieces = [t for _, t in cuts[:1]] + [_M["user1"], user_to_act] + [t for _, t in cuts[2:-1]]
    pieces += [_M["user2"], user2_tail]
    stop = _check_token_boundaries(tokenizer, pieces, act_end)

    def ids(s: str) -> Ids:
        return tuple(encode(tokenizer, s))

    return RolePieces(
        act_start=ids(act_start),
        act_end=stop,
        act_to_rehearse=ids(text["act_to_rehearse"]),
        tool_response_sep=ids(sep),
        rehearse_end=ids(rehearse_end),
        rehearse_to_act=ids(text["rehearse_to_act"]),
        final_to_user_prefix=ids(text["final_to_user_prefix"]),
        user_to_act_suffix=ids(user_to_act),
    )


def _cut_rendering(full: str, eot: str) -> list[tuple[str, str]]:
    """The probe conversation's rendering cut into alternating (glue, span) pieces at the probe
    texts and at the end-of-turn token that closes each generated span: (what, text) in order,
    whose concatenation is `full`."""
    cuts: list[tuple[str, str]] = []
    rest = full

    def take_until(marker: str, what: str) -> None:
        nonlocal rest
        before, _ = split_once(rest, marker, what)
        cuts.append((what, before))
        rest = rest[len(before) :]

    def take_span(what: str) -> None:  # from here through the next end-of-turn token
        nonlocal rest
        end = rest.find(eot)
        if end < 0:
            raise TemplateLayoutError(f"chat template: {what} is not closed by {eot!r}")
        cuts.append((what, rest[: end + len(eot)]))
        rest = rest[end + len(eot) :]

    take_until(_M["user1"], "prompt_to_user1")
    take_until(_M["act1"], "user1")  # user text + user_to_act_suffix: split by the caller
    take_span("act1")
    take_until(_M["resp1"], "act_to_rehearse")
    take_span("rehearse1")
    take_until(_M["act2"], "rehearse_to_act")
    take_span("act2")
    take_until(_M["resp3"], "act_to_rehearse_2")
    take_span("rehearse2")
    take_until(_M["act3"], "rehearse_to_act_2")
    take_span("act3")
    take_until(_M["user2"], "final_to_user_prefix")
    cuts.append(("user2_and_prompt", rest))
    return cuts


def _check_token_boundaries(tokenizer, pieces: list[str], act_end: str) -> Ids:
    """Checks that `pieces`, tokenised separately, concatenate to the probe conversation's ids
    and that `act_end` is one special id; returns that id."""
    messages, tools = probe_conversation()
    composed = [i for piece in pieces for i in encode(tokenizer, piece)]
    if composed != render(tokenizer, messages, tools, add_generation_prompt=True):
        raise TemplateLayoutError(
            "role boundaries are not token boundaries for this tokenizer: tokenising the chat "
            "layout's pieces separately does not give the template's ids (a BPE merge crosses "
            "a boundary), so role-switch pieces cannot be spliced between generated spans"
        )
    stop = encode(tokenizer, act_end)
    if len(stop) != 1 or stop[0] not in tokenizer.all_special_ids:
        raise TemplateLayoutError(f"end of an assistant message {act_end!r} is not one special id")
    return tuple(stop)


def role_pieces(tokenizer) -> RolePieces:
    """The tokenizer's :class:`RolePieces` (derived once per tokenizer)."""
    return cached_per_tokenizer("role_pieces", tokenizer, _derive)


def tool_responses_text(tokenizer, responses: Sequence[str]) -> str:
    """The REHEARSE span holding ``responses`` (one per call): bodies, separators, closing."""
    lay = chat_layout(tokenizer)
    between = lay.response_close + lay.response_sep + lay.response_open
    return between.join(responses) + lay.response_close + lay.end_of_turn


def tool_responses_marked(tokenizer, responses: Sequence[str], mark: str | None = None) -> Marked:
    """:func:`tool_responses_text` with the responses' control-token strings marked as text
    (``text.untrusted``: a tool result that holds ``<|im_end|>`` cannot end its turn)."""
    mark = mark or choose_mark(responses)
    marked = [mark_text(tokenizer, r, mark) for r in responses]
    return Marked(tool_responses_text(tokenizer, marked), mark)


def tool_responses_ids(tokenizer, responses: Sequence[str]) -> list[int]:
    """Ids of :func:`tool_responses_text`, encoded as one text (the responses as text): the
    template's ids for any tokenizer (splicing ``tool_response_sep`` between separately encoded
    bodies is exact only when no merge joins a body's last character to the newline after it,
    as in the demo tokenizer but not in Qwen3's, where e.g. ``}\n`` is one token)."""
    return encode_marked(tokenizer, tool_responses_marked(tokenizer, responses))


def prompt_ids(
    tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None
) -> list[int]:
    """Ids of ``messages`` rendered with the generation prompt: where ACT starts writing."""
    return render(tokenizer, messages, tools, add_generation_prompt=True)
