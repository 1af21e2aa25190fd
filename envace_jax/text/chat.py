"""Chat rendering with tools, and its inverse (rendered text or ids back to chat messages).

Rendering: the chat template renders text (``tokenize=False``), which is then encoded with
``add_special_tokens=False``. This is exactly what ``apply_chat_template(tokenize=True)`` does
inside transformers 5 (a test checks the ids agree), without its return-type differences
(a ``BatchEncoding`` there), and it gives the text that role-piece derivation diffs.

Message text is untrusted: the strings of control tokens in system, user and tool messages and
in the tools are encoded as text (`text.untrusted`), so that text cannot end its turn and start
another; the template's own markup, and assistant messages (the model's output), are encoded
as the template renders them.

Parsing relies on a :class:`ChatLayout`: the literal pieces of the Qwen3 layout (turn header,
end-of-turn token, tool-response wrapping, tools block), each derived by rendering probe
conversations with the tokenizer's own template, never hard-coded. Anything the template
renders parses back to messages that re-render to the same text, hence the same ids; the
parser checks this and raises :class:`ConversationParseError` where it does not hold.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envace_jax.text.tool_calls import parse_tool_calls
from envace_jax.text.untrusted import (
    Marked,
    choose_mark,
    encode_marked,
    hide_marked,
    holds_markup,
    mark_values,
    marked_ids,
    strings_of,
)

Message = dict[str, Any]
UNTRUSTED_ROLES = ("system", "developer", "user", "tool")  # whose text is not markup


class TemplateLayoutError(ValueError):
    """The chat template does not render what a use of it needs (the Qwen3 tool-use layout
    for training and rehearsal; a stop id and a generation prompt for serving)."""


class ConversationParseError(ValueError):
    """Text that is not a conversation in the tokenizer's chat layout."""


# ---------------------------------------------------------------------------------------------
# Rendering


def render_text(
    tokenizer,
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template's rendering of ``messages`` (with ``tools`` in the system turn)."""
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text in which special-token strings are the special tokens (no BOS/EOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Exact text of ``ids``, special tokens included."""
    return tokenizer.decode(
        [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _untrusted_parts(message: Mapping) -> list:
    """What of a message is not markup: a system, user or tool message's content; an
    assistant message's calls (names and arguments), not its content."""
    if message.get("role") in UNTRUSTED_ROLES:
        return [message.get("content")]
    return [c.get("function", c) for c in message.get("tool_calls") or []]


def _marked_message(tokenizer, message: Mapping, mark: str) -> dict:
    m = dict(message)
    if m.get("role") in UNTRUSTED_ROLES:
        m["content"] = mark_values(tokenizer, m.get("content"), mark)
    elif m.get("tool_calls"):
        m["tool_calls"] = mark_values(tokenizer, m["tool_calls"], mark)
    return m


def render_marked(
    tokenizer,
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
    mark: str | None = None,
) -> Marked:
    """The template's rendering of ``messages`` with the control-token strings of untrusted
    text marked as text (``text.untrusted``); ``mark``: the mark to use (one is chosen)."""
    untrusted = [p for m in messages for p in _untrusted_parts(m)] + list(tools or [])
    strings = list(strings_of(untrusted))
    if not any(holds_markup(tokenizer, x) for x in strings):
        text = render_text(tokenizer, messages, tools, add_generation_prompt)
        return Marked(text, mark or choose_mark([text]))
    mark = mark or choose_mark(strings_of([list(messages), list(tools or [])]))
    marked = [_marked_message(tokenizer, m, mark) for m in messages]
    marked_tools = mark_values(tokenizer, list(tools), mark) if tools else None
    return Marked(render_text(tokenizer, marked, marked_tools, add_generation_prompt), mark)


def render(
    tokenizer,
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of the template's rendering of ``messages``, message text encoded as text."""
    return encode_marked(
        tokenizer, render_marked(tokenizer, messages, tools, add_generation_prompt)
    )


# ---------------------------------------------------------------------------------------------
# The layout, derived from the template


@dataclasses.dataclass(frozen=True)
class ChatLayout:
    """Literal text pieces of the Qwen3 layout, as this tokenizer's template renders them.

    A turn is ``head_prefix + role + head_suffix + body + end_of_turn + turn_sep``; a tool
    turn is a user turn whose body is ``response_open + r1 + response_close + response_sep +
    response_open + r2 + response_close``; the tools block in the system turn is
    ``tools_prefix + json1 + tools_sep + json2 + tools_suffix``, after the system content and
    ``system_tools_sep`` when there is a system message.
    """

    head_prefix: str
    head_suffix: str
    end_of_turn: str
    turn_sep: str
    response_open: str
    response_close: str
    response_sep: str
    tools_prefix: str
    tools_sep: str
    tools_suffix: str
    system_tools_sep: str

    def head(self, role: str) -> str:
        return self.head_prefix + role + self.head_suffix


_CACHES: dict[str, weakref.WeakKeyDictionary] = {}


def cached_per_tokenizer(kind: str, tokenizer, build: Callable[[Any], Any]) -> Any:
    """``build(tokenizer)`` computed once per tokenizer object (and chat template). Errors of
    the template itself while rendering probes are reported as TemplateLayoutError."""
    cache = _CACHES.setdefault(kind, weakref.WeakKeyDictionary())
    entry = cache.get(tokenizer)
    if entry is None or entry[0] != tokenizer.chat_template:
        try:
            built = build(tokenizer)
        except TemplateLayoutError:
            raise
        except Exception as e:  # the template raised on a probe conversation
            raise TemplateLayoutError(
                f"chat template raised on a probe conversation ({kind}): {e}"
            ) from e
        entry = (tokenizer.chat_template, built)
        cache[tokenizer] = entry
    return entry[1]


def split_once(text: str, marker: str, what: str) -> tuple[str, str]:
    """``text`` around the single occurrence of ``marker``; TemplateLayoutError otherwise."""
    count = text.count(marker)
    if count != 1:
        raise TemplateLayoutError(
            f"chat template: {what}: expected the probe text {marker!r} once in the rendering, "
            f"found it {count} times in {text!r}"
        )
    before, after = text.split(marker)
    return before, after


def _expect(ok: bool, what: str, got: str) -> None:
    if not ok:
        raise TemplateLayoutError(f"chat template does not render the Qwen3 layout: {what} {got!r}")


PROBE_TOOLS = (
    {"type": "function", "function": {"name": "probe_fn_one", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "probe_fn_two", "parameters": {"type": "object"}}},
)


def probe_call(name: str, value: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"probe_key": value}}}


def _derive_layout(tokenizer) -> ChatLayout:
    u = {"role": "user", "content": "qzuserq"}
    r_user = render_text(tokenizer, [u])
    pre, post = split_once(r_user, "qzuserq", "user message")
    k = pre.rfind("user")
    _expect(k >= 0, "user turn header lacks the role name:", pre)
    head_prefix, head_suffix = pre[:k], pre[k + len("user") :]
    first = encode(tokenizer, post)[:1]
    end_of_turn = decode(tokenizer, first)
    _expect(
        bool(first) and first[0] in tokenizer.all_special_ids and post.startswith(end_of_turn),
        "user content is not followed by a special end-of-turn token:",
        post,
    )
    turn_sep = post[len(end_of_turn) :]
    lay = dict(head_prefix=head_prefix, head_suffix=head_suffix, end_of_turn=end_of_turn)
    lay["turn_sep"] = turn_sep
    tail = end_of_turn + turn_sep

    gen = render_text(tokenizer, [u], add_generation_prompt=True)[len(r_user) :]
    _expect(gen == head_prefix + "assistant" + head_suffix, "generation prompt is", gen)
    sys_ = render_text(tokenizer, [{"role": "system", "content": "qzsysq"}, u])
    _expect(sys_ == head_prefix + "system" + head_suffix + "qzsysq" + tail + r_user, "system", sys_)
    # A user turn follows: Qwen3's own template adds a <think> block to a trailing answer.
    r_asst = render_text(tokenizer, [u, {"role": "assistant", "content": "qzasstq"}, u])
    _expect(
        r_asst == r_user + gen + "qzasstq" + tail + r_user, "assistant message renders as", r_asst
    )

    # Tool responses: two in one turn after an assistant message that called two tools.
    calls = [probe_call("probe_fn_one", "a"), probe_call("probe_fn_two", "b")]
    conv = [u, {"role": "assistant", "content": "", "tool_calls": calls}]
    conv += [{"role": "tool", "content": "qzresp1q"}, {"role": "tool", "content": "qzresp2q"}]
    r_tools = render_text(tokenizer, conv)
    user_head = head_prefix + "user" + head_suffix
    k = r_tools.rfind(user_head, 0, r_tools.find("qzresp1q"))
    _expect(
        k > len(r_user) and r_tools[:k].endswith(tail),
        "tool responses are not a user turn after the assistant turn:",
        r_tools,
    )
    turn = r_tools[k + len(user_head) :]
    response_open, rest = split_once(turn, "qzresp1q", "first tool response")
    between, after = split_once(rest, "qzresp2q", "second tool response")
    _expect(after.endswith(tail), "tool turn ends", after)
    response_close = after[: -len(tail)]
    _expect(
        between.startswith(response_close) and between.endswith(response_open),
        "two tool responses are separated by",
        between,
    )
    lay["response_open"], lay["response_close"] = response_open, response_close
    lay["response_sep"] = between[len(response_close) : len(between) - len(response_open)]

    # Tools block, without and with a system message.
    r_tb = render_text(tokenizer, [u], tools=PROBE_TOOLS)
    sys_head = head_prefix + "system" + head_suffix
    _expect(r_tb.startswith(sys_head) and r_tb.endswith(tail + r_user), "tools turn", r_tb)
    block = r_tb[len(sys_head) : len(r_tb) - len(tail + r_user)]
    j1, j2 = (json.dumps(t, ensure_ascii=False) for t in PROBE_TOOLS)
    tools_prefix, rest = split_once(block, j1, "first tool schema (rendered with tojson)")
    lay["tools_prefix"] = tools_prefix
    lay["tools_sep"], lay["tools_suffix"] = split_once(rest, j2, "second tool schema")
    r_stb = render_text(tokenizer, [{"role": "system", "content": "qzsysq"}, u], tools=PROBE_TOOLS)
    _expect(r_stb.startswith(sys_head + "qzsysq"), "system turn with tools", r_stb)
    sts = r_stb[len(sys_head + "qzsysq") :]
    _expect(sts.endswith(block + tail + r_user), "system turn with tools", r_stb)
    lay["system_tools_sep"] = sts[: len(sts) - len(block + tail + r_user)]
    return ChatLayout(**lay)


def chat_layout(tokenizer) -> ChatLayout:
    """The tokenizer's :class:`ChatLayout` (derived once; TemplateLayoutError if not Qwen3)."""
    return cached_per_tokenizer("layout", tokenizer, _derive_layout)


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclasses.dataclass(frozen=True)
class ParsedConversation:
    """A conversation recovered from text. ``render_text(tokenizer)`` gives the text back.

    ``final_turn_sep`` is False when the text stops right after an end-of-turn token (as a
    sampled trajectory does at its stop id); ``partial`` is the unfinished text of a last turn
    cut off before its end-of-turn token (after the assistant header when
    ``add_generation_prompt``, else the whole unfinished turn).
    """

    messages: tuple[Message, ...]
    tools: tuple[Message, ...] | None
    add_generation_prompt: bool
    final_turn_sep: bool
    partial: str

    def render_text(self, tokenizer) -> str:
        return self.render_marked(tokenizer).plain

    def render_marked(self, tokenizer, mark: str | None = None) -> Marked:
        lay = chat_layout(tokenizer)
        if not self.messages:  # nothing but an unfinished first turn
            head = lay.head("assistant") if self.add_generation_prompt else ""
            return Marked(head + self.partial, mark or choose_mark([self.partial]))
        text = render_marked(tokenizer, self.messages, self.tools, self.add_generation_prompt, mark)
        if not self.final_turn_sep:
            text = Marked(text.text[: len(text.text) - len(lay.turn_sep)], text.mark)
        return text + self.partial

    def render(self, tokenizer) -> list[int]:
        return encode_marked(tokenizer, self.render_marked(tokenizer))


def _assistant_message(tokenizer, lay: ChatLayout, body: Marked) -> Message:
    """Structured (content + tool_calls) when that re-renders to ``body``, else raw content.
    A control-token string that was text (marked) is text inside a call, never its markup."""
    hidden, restore = hide_marked(tokenizer, body)
    action = parse_tool_calls(hidden)
    clean = body.plain
    if action.calls:
        calls = []
        for call in action.calls:
            name, raw = restore(call.name), restore(call.raw)
            prefix = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
            if raw.startswith(prefix) and raw.endswith("}"):
                args: Any = raw[len(prefix) : -1]  # verbatim, so it re-renders exactly
            else:
                args = restore(call.arguments)
            calls.append({"type": "function", "function": {"name": name, "arguments": args}})
        content = restore(action.content)
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        expected = lay.head("assistant") + clean + lay.end_of_turn + lay.turn_sep
        try:
            if render_text(tokenizer, [message]) == expected:
                return message
        except Exception:  # e.g. a template that rejects the structure: keep the raw text
            pass
    return {"role": "assistant", "content": clean}


def _system_and_tools(lay: ChatLayout, body: str) -> tuple[str | None, list | None]:
    """Split a first system turn into (system content or None, tools or None)."""
    if not body.endswith(lay.tools_suffix):
        return body, None
    start = body.find(lay.tools_prefix)
    while start >= 0:
        head, middle = body[:start], body[start + len(lay.tools_prefix) : -len(lay.tools_suffix)]
        try:
            tools = [json.loads(line) for line in middle.split(lay.tools_sep)]
        except ValueError:
            tools = None
        if tools and all(isinstance(t, dict) for t in tools):
            if head == "":
                return None, tools
            if head.endswith(lay.system_tools_sep):
                return head[: len(head) - len(lay.system_tools_sep)], tools
        start = body.find(lay.tools_prefix, start + 1)
    return body, None


def find_markup(text: str, sub: str, start: int, mark: str) -> int:
    """``text.find(sub, start)``, skipping occurrences that are marked as plain text."""
    at = text.find(sub, start)
    while at > 0 and text[at - 1] == mark:
        at = text.find(sub, at + 1)
    return at


def parse_conversation(tokenizer, ids_or_text: str | Sequence[int]) -> ParsedConversation:
    """Split a rendered conversation (text or ids) back into chat messages and tools.

    Tool-response turns become ``tool`` messages; assistant turns get ``tool_calls`` (with the
    arguments' exact JSON text) when that re-renders identically, otherwise their raw text as
    content. From ids, a control-token string that was encoded as text is text of its message,
    never markup, and the messages re-render to the same ids. Raises ConversationParseError
    where the text is not in the chat layout or does not re-render to itself.
    """
    if isinstance(ids_or_text, str):
        marked = Marked(ids_or_text, choose_mark([ids_or_text]))
    else:
        marked = marked_ids(tokenizer, ids_or_text)
    text, mark = marked.text, marked.mark
    lay = chat_layout(tokenizer)
    turns: list[tuple[str, str]] = []
    pos, final_sep, gen_prompt, partial = 0, True, False, ""
    while pos < len(text):
        if not text.startswith(lay.head_prefix, pos):
            raise ConversationParseError(
                f"expected {lay.head_prefix!r} at character {pos}, found {text[pos : pos + 40]!r}"
            )
        role_end = text.find(lay.head_suffix, pos + len(lay.head_prefix))
        body_start = role_end + len(lay.head_suffix)
        end = find_markup(text, lay.end_of_turn, body_start, mark) if role_end >= 0 else -1
        if end < 0:  # the last turn is unfinished
            role = text[pos + len(lay.head_prefix) : role_end] if role_end >= 0 else None
            if role == "assistant":
                gen_prompt, partial = True, text[body_start:]
            else:
                partial = text[pos:]
            break
        turns.append((text[pos + len(lay.head_prefix) : role_end], text[body_start:end]))
        pos = end + len(lay.end_of_turn)
        if pos == len(text):
            final_sep = False
        elif text.startswith(lay.turn_sep, pos):
            pos += len(lay.turn_sep)
        else:
            raise ConversationParseError(
                f"expected {lay.turn_sep!r} after the end of turn at character {pos}, "
                f"found {text[pos : pos + 40]!r}"
            )

    messages: list[Message] = []
    tools = None
    ro, rc = lay.response_open, lay.response_close
    partial = partial.replace(mark, "")
    for i, (role, body) in enumerate(turns):  # markup is found in `body`, text is `clean`
        clean = body.replace(mark, "")
        if i == 0 and role == "system":
            content, tools = _system_and_tools(lay, clean)
            if content is not None:
                messages.append({"role": "system", "content": content})
        elif role == "user" and _is_tool_turn(body, ro, rc):
            inner = body[len(ro) : len(body) - len(rc)]
            for response in inner.split(rc + lay.response_sep + ro):
                messages.append({"role": "tool", "content": response.replace(mark, "")})
        elif role == "assistant":
            messages.append(_assistant_message(tokenizer, lay, Marked(body, mark)))
        else:
            messages.append({"role": role, "content": clean})

    parsed = ParsedConversation(
        tuple(messages), tuple(tools) if tools else None, gen_prompt, final_sep, partial
    )
    _check_round_trip(tokenizer, parsed, marked, not isinstance(ids_or_text, str))
    return parsed


def _is_tool_turn(body: str, response_open: str, response_close: str) -> bool:
    return (
        len(body) >= len(response_open + response_close)
        and body.startswith(response_open)
        and body.endswith(response_close)
    )


def _check_round_trip(tokenizer, parsed: ParsedConversation, marked: Marked, ids: bool) -> None:
    """The messages render to `marked`: from ids, marks included (a control-token string that
    was text is text of an untrusted message again, not of an assistant message, nor markup);
    from text, which cannot tell, as text."""
    text = marked.text if ids else marked.plain
    try:
        again = parsed.render_marked(tokenizer, marked.mark)
        again = again.text if ids else again.plain
    except Exception as e:
        raise ConversationParseError(f"parsed messages do not render: {e}") from e
    if again != text:
        at = next((i for i, (a, b) in enumerate(zip(again, text, strict=False)) if a != b), None)
        at = min(len(again), len(text)) if at is None else at
        raise ConversationParseError(
            f"conversation does not re-render to itself: differs at character {at}: "
            f"input {text[at : at + 40]!r} vs re-rendered {again[at : at + 40]!r}"
        )


def messages_from_text(tokenizer, ids_or_text: str | Sequence[int]) -> list[Message]:
    """The chat messages of a rendered conversation (see :func:`parse_conversation`)."""
    return list(parse_conversation(tokenizer, ids_or_text).messages)
