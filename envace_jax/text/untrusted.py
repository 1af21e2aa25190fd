"""Text the project does not control, encoded as text: no string in it becomes a control token.

A tokenizer reads its added tokens (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, ...) wherever
their strings occur. Message text written by users, tool results (a hostile web page, a tool
that echoes its input) and task files is not the chat template's own markup: encoded with the
template's glue, a `<|im_end|>` in a tool result closed the tool turn and let the text start a
turn of any role. Here such strings in untrusted text stay plain text.

Marking. Before rendering, each added-token string inside untrusted text is prefixed with a
`mark` character that occurs nowhere in the conversation (a private-use code point). The chat
template renders the marks along with the text; `encode_marked` then reads an added-token
string as its token only where no mark precedes it, and encodes the text between two such
tokens, marked strings included, with the tokenizer's own pipeline minus its added tokens
(`plain_encoder`). Where no untrusted text holds such a string (nearly always), this is exactly
`tokenizer.encode`: the tokenizer, too, splits the text at its added tokens first and encodes
the pieces between them on their own.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Any

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Marks: private-use code points (U+E000-U+F8FF), the first one absent from the text.
_MARKS = range(0xE000, 0xF900)


@dataclasses.dataclass(frozen=True)
class Marked:
    """Text in which `mark` precedes each added-token string that is plain text."""

    text: str
    mark: str

    @property
    def plain(self) -> str:
        return self.text.replace(self.mark, "")

    def __add__(self, trusted: str) -> Marked:
        """This text followed by `trusted` (template or layout text: its markup counts)."""
        return Marked(self.text + trusted, self.mark)


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    pattern: re.Pattern  # the added tokens' strings, leftmost-longest as the tokenizer reads
    ids: dict[str, int]  # string -> id
    plain: Any  # a tokenizers.Tokenizer without added tokens


def _vocabulary(tokenizer) -> _Vocabulary:
    entry = _CACHE.get(tokenizer)
    if entry is None:
        entry = _CACHE[tokenizer] = _build(tokenizer)
    return entry


def _build(tokenizer) -> _Vocabulary:
    from tokenizers import Tokenizer

    ids = dict(tokenizer.get_added_vocab())
    strings = sorted(ids, key=len, reverse=True)  # alternation tries the longest first
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else re.compile("(?!)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__}: encoding text as text needs a fast tokenizer"
        )
    data = json.loads(backend.to_str())
    data["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(data))
    plain.no_padding()
    plain.no_truncation()
    for s in strings:  # the model's merges must not rebuild a control token from its text
        got = set(plain.encode(s, add_special_tokens=False).ids)
        if got & set(ids.values()):
            raise ValueError(f"the tokenizer's vocabulary encodes the text {s!r} as that token")
    return _Vocabulary(pattern, ids, plain)


def added_token_strings(tokenizer) -> tuple[str, ...]:
    """The strings the tokenizer reads as single added tokens (special or not)."""
    return tuple(_vocabulary(tokenizer).ids)


def holds_markup(tokenizer, text: str) -> bool:
    """Whether `text` holds an added token's string."""
    return _vocabulary(tokenizer).pattern.search(text) is not None


def encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of `text` with every added-token string in it encoded as text."""
    return list(_vocabulary(tokenizer).plain.encode(text, add_special_tokens=False).ids)


def choose_mark(strings: Iterable[str]) -> str:
    """A mark that occurs in none of `strings`."""
    seen = set().union(*(set(s) for s in strings))
    return next(chr(c) for c in _MARKS if chr(c) not in seen)


def mark_text(tokenizer, text: str, mark: str) -> str:
    """`text` (untrusted) with `mark` before each added-token string in it."""
    return _vocabulary(tokenizer).pattern.sub(lambda m: mark + m.group(0), text)


def mark_values(tokenizer, value: Any, mark: str) -> Any:
    """`value` (JSON-like) with every string in it marked (`mark_text`), keys included."""
    if isinstance(value, str):
        return mark_text(tokenizer, value, mark)
    if isinstance(value, dict):
        return {
            mark_values(tokenizer, k, mark): mark_values(tokenizer, v, mark)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [mark_values(tokenizer, v, mark) for v in value]
    return value


def strings_of(value: Any) -> Iterable[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_of(k)
            yield from strings_of(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from strings_of(v)


def encode_marked(tokenizer, marked: Marked) -> list[int]:
    """Ids of `marked`: an added-token string is its token unless the mark precedes it; the
    text between two tokens is encoded without added tokens (module docstring)."""
    vocab = _vocabulary(tokenizer)
    text, mark = marked.text, marked.mark
    ids: list[int] = []
    start = 0  # where the text not yet encoded begins
    for m in vocab.pattern.finditer(text):
        if m.start() > 0 and text[m.start() - 1] == mark:
            continue  # plain text: stays in the piece being built
        if m.start() > start:
            ids += encode_plain(tokenizer, _unmark(text[start : m.start()], mark, vocab))
        ids.append(vocab.ids[m.group(0)])
        start = m.end()
    if start < len(text):
        ids += encode_plain(tokenizer, _unmark(text[start:], mark, vocab))
    return ids


def _unmark(piece: str, mark: str, vocab: _Vocabulary) -> str:
    """`piece` without its marks; a mark that precedes no added-token string means the text
    was changed between marking and encoding."""
    if mark not in piece:
        return piece
    stray = [i for i, c in enumerate(piece) if c == mark and not vocab.pattern.match(piece, i + 1)]
    if stray:
        raise ValueError(
            "the chat template changed message text around a control-token string (a mark "
            f"without its string at {piece[stray[0] : stray[0] + 20]!r}); it cannot be encoded "
            "as text"
        )
    return piece.replace(mark, "")


def hide_marked(tokenizer, marked: Marked) -> tuple[str, Callable[[Any], Any]]:
    """`marked`'s text with each marked added-token string replaced by a private-use character
    of its own, so that a text parser (of tool calls) sees no markup there; and `restore`, which
    puts the strings back, unmarked, into a string or a JSON-like value."""
    vocab, text = _vocabulary(tokenizer), marked.text
    if marked.mark not in text:
        return text, lambda v: v
    free = (chr(c) for c in _MARKS if chr(c) not in text and chr(c) != marked.mark)
    chars: dict[str, str] = {}

    def hide(m: re.Match) -> str:
        token = m.group(0)[1:]
        if token not in chars:
            chars[token] = next(free)
        return chars[token]

    hidden = re.sub(re.escape(marked.mark) + f"(?:{vocab.pattern.pattern})", hide, text)
    back = {c: token for token, c in chars.items()}

    def restore(v: Any) -> Any:
        if isinstance(v, str):
            return "".join(back.get(c, c) for c in v)
        if isinstance(v, dict):
            return {restore(k): restore(x) for k, x in v.items()}
        if isinstance(v, list):
            return [restore(x) for x in v]
        return v

    return hidden, restore


def marked_ids(tokenizer, ids) -> Marked:
    """The text of `ids`, with the mark before each added-token string that was encoded as
    text (not as its token): what `encode_marked` encodes back to `ids`."""
    vocab = _vocabulary(tokenizer)
    token_ids = set(vocab.ids.values())
    runs: list[tuple[bool, str]] = []  # (is a token, text)
    run: list[int] = []
    for i in [int(x) for x in ids]:
        if i in token_ids:
            if run:
                runs.append((False, _decode(tokenizer, run)))
                run = []
            runs.append((True, _decode(tokenizer, [i])))
        else:
            run.append(i)
    if run:
        runs.append((False, _decode(tokenizer, run)))
    mark = choose_mark(t for _, t in runs)
    text = "".join(t if token else mark_text(tokenizer, t, mark) for token, t in runs)
    return Marked(text, mark)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
