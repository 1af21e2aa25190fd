"""A chat conversation as one role-tagged token sequence (the trajectory format of the design).

``encode_conversation`` gives the ids the chat template renders, with per token a role (0
CONTEXT, 1 ACT, 2 REHEARSE) and a segment id (1..S numbering the generated messages in order,
0 for CONTEXT). The generated spans are the ones ``role_pieces`` defines:

- ACT: an assistant message's content, its tool-call blocks and the closing end-of-turn token,
  not the ``<|im_start|>assistant\\n`` header;
- REHEARSE: one segment per tool-response turn (all responses to one ACT message), from the
  first response body through the turn's closing end-of-turn token, not the
  ``\\n<|im_start|>user\\n<tool_response>\\n`` glue before it.

With ``rehearse=False`` tool-response turns are CONTEXT (observations of a real environment).
Used for warm-start SFT demonstrations and as the reference for sampled trajectories.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from envace_jax.text.chat import chat_layout, decode, find_markup, render_marked
from envace_jax.text.codes import Role
from envace_jax.text.role_pieces import role_pieces, tool_responses_marked
from envace_jax.text.untrusted import Marked, encode_marked


@dataclasses.dataclass(frozen=True)
class EncodedConversation:
    """``ids`` int32 [T], ``roles`` int8 [T], ``segments`` int32 [T] (0 = CONTEXT)."""

    ids: np.ndarray
    roles: np.ndarray
    segments: np.ndarray

    @property
    def num_segments(self) -> int:
        return int(self.segments.max(initial=0))

    def segment_roles(self) -> list[Role]:
        """Role of segments 1..S, in order."""
        return [
            Role(int(self.roles[np.argmax(self.segments == s)]))
            for s in range(1, self.num_segments + 1)
        ]


def _spans(tokenizer, messages, tools, marked: Marked, rehearse: bool):
    """Character spans (start, end, role) of the generated messages in ``marked.text`` (the
    rendering with untrusted text marked, ``text.untrusted``).

    An assistant span starts where the generation prompt after the messages before it ends and
    runs through the next end-of-turn token; a tool-response span starts after the
    act-to-rehearse glue and is checked against the layout's wrapping of its responses. Only
    renderings that end before an assistant message are used as prefixes (Qwen3's own
    template renders a trailing assistant message differently).
    """
    lay = chat_layout(tokenizer)
    glue = decode(tokenizer, role_pieces(tokenizer).act_to_rehearse)
    eot = lay.end_of_turn
    full, mark = marked.text, marked.mark

    def prefix_end(n: int, gen: bool = False) -> int:
        text = render_marked(tokenizer, messages[:n], tools, gen, mark).text
        if not full.startswith(text):
            raise ValueError(
                f"the rendering of messages[:{n}] is not a prefix of the whole conversation's; "
                "the chat template is not the Qwen3 layout"
            )
        return len(text)

    for i, m in enumerate(messages):  # the model's own text is markup: it cannot hold one
        if m.get("role") == "assistant" and eot in (m.get("content") or ""):
            raise ValueError(f"messages[{i}] contains the end-of-turn token {eot!r}")

    spans: list[tuple[int, int, Role]] = []
    i, act_end = 0, None  # act_end: where the previous message's ACT span ended, if any
    while i < len(messages):
        role = messages[i].get("role")
        if role == "assistant":
            if i == 0:
                raise ValueError(
                    "messages[0]: a conversation must start with a system or user turn"
                )
            start = prefix_end(i, gen=True)
            end = find_markup(full, eot, start, mark) + len(eot)
            if end < len(eot):
                raise ValueError(f"messages[{i}]: assistant turn has no end-of-turn token")
            spans.append((start, end, Role.ACT))
            i, act_end = i + 1, end
        elif role == "tool":
            j = i
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            turn = act_end if act_end is not None else prefix_end(i) - len(lay.turn_sep)
            if full[turn : turn + len(glue)] != glue:
                raise ValueError(f"messages[{i}]: tool-response turn does not start with {glue!r}")
            responses = [m.get("content") or "" for m in messages[i:j]]
            span = tool_responses_marked(tokenizer, responses, mark).text
            start = turn + len(glue)
            if full[start : start + len(span)] != span:
                raise ValueError(f"messages[{i}:{j}]: tool responses do not render as the layout")
            if rehearse:
                spans.append((start, start + len(span), Role.REHEARSE))
            i, act_end = j, None
        else:
            i, act_end = i + 1, None
    return spans


def encode_conversation(
    tokenizer,
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] | None = None,
    rehearse: bool = True,
    add_generation_prompt: bool = False,
) -> EncodedConversation:
    """Ids (== ``render(tokenizer, messages, tools)``), roles and segments of a conversation.

    Raises ValueError if a role boundary is not a token boundary (each piece is tokenised on
    its own and the concatenation must equal the template's ids).
    """
    messages = [dict(m) for m in messages]
    marked = render_marked(tokenizer, messages, tools, add_generation_prompt)
    spans = _spans(tokenizer, messages, tools, marked, rehearse)
    full, mark = marked.text, marked.mark

    def encode(text: str) -> list[int]:
        return encode_marked(tokenizer, Marked(text, mark)) if text else []

    ids, roles, segments = [], [], []
    pos = 0
    for seg, (start, end, role) in enumerate(spans, start=1):
        for text, r, s in ((full[pos:start], Role.CONTEXT, 0), (full[start:end], role, seg)):
            piece = encode(text)
            ids += piece
            roles += [int(r)] * len(piece)
            segments += [s] * len(piece)
        pos = end
    tail = encode(full[pos:])
    ids += tail
    roles += [0] * len(tail)
    segments += [0] * len(tail)
    if ids != encode(full):
        raise ValueError(
            "role boundaries are not token boundaries for this tokenizer: encoding the role "
            "spans separately differs from encoding the whole rendering"
        )
    return EncodedConversation(
        np.asarray(ids, np.int32), np.asarray(roles, np.int8), np.asarray(segments, np.int32)
    )
