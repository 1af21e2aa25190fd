"""Incremental detokenisation with stop sequences, for one generated choice.

Tokens arrive in chunks; `ChoiceText.add` keeps the decoded text, cuts it at the first stop
sequence (or stop token id), and tells how much of it is safe to stream: text that could still
turn out to be the start of a stop sequence (or of a `<tool_call>` block, for chat with tools)
is held back, as is a trailing partial UTF-8 character.

Decoding is incremental: the text of tokens up to the last clean character boundary is kept, and
only the tokens after it are decoded again (byte-level BPE decodes any clean split exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_PARTIAL = "\ufffd"  # what a cut multi-byte character decodes to


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ChoiceText:
    """The text of one choice, built from token chunks.

    stops: stop strings (the text ends before the first one; it is not included).
    stop_ids: token ids that end the text (not included).
    hold: markers whose beginnings are held back from streaming (e.g. '<tool_call>').
    offsets: keep `offsets`, where each kept token's text starts in `text` (for logprobs).
    stop_at: called with the text so far; where it returns an index, the text ends there (as
      at a stop sequence).
    """

    def __init__(
        self,
        tokenizer,
        *,
        stops: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
        hold: Sequence[str] = (),
        skip_special_tokens: bool = False,
        offsets: bool = False,
        stop_at: Callable[[str], int | None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.stop_ids = frozenset(stop_ids)
        self.hold = tuple(hold)
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.stopped = False  # a stop string or stop id was reached
        self.offsets: list[int] | None = [] if offsets else None
        self.stop_at = stop_at
        self._fixed_ids = 0
        self._fixed_text = ""
        self._searched = 0  # stop strings were looked for in text[:_searched]

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=self.skip_special,
            clean_up_tokenization_spaces=False,
        )

    def add(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Appends generated tokens (ignored once stopped)."""
        if self.stopped:
            return
        ids, logprobs = list(ids), list(logprobs)
        for j, t in enumerate(ids):
            if t in self.stop_ids:
                ids, logprobs, self.stopped = ids[:j], logprobs[:j], True
                break
        self.ids += ids
        self.logprobs += logprobs
        tail = self._decode(self.ids[self._fixed_ids :])
        text = self._fixed_text + tail
        if self.offsets is not None:
            self._place_tokens(tail)
        if not tail.endswith(_PARTIAL):
            self._fixed_ids, self._fixed_text = len(self.ids), text
        if self.stops:
            longest = max(len(s) for s in self.stops)
            start = max(0, self._searched - longest + 1)
            hits = [p for p in (text.find(s, start) for s in self.stops) if p >= 0]
            if hits:
                text, self.stopped = text[: min(hits)], True
                self._trim_tokens(len(text))
            self._searched = len(text)
        if self.stop_at is not None and not self.stopped:
            cut = self.stop_at(text)
            if cut is not None:
                text, self.stopped = text[:cut], True
                self._trim_tokens(len(text))
        self.text = text

    def _place_tokens(self, tail: str) -> None:
        """Offsets of the tokens after the last clean boundary (recomputed while a character
        is still open there): where the text of the tokens before each one ends, as far as
        it agrees with the text so far (a byte that never completes a character stays a
        U+FFFD in the text; one that does is not counted on its own)."""
        start = self._fixed_ids
        del self.offsets[start:]
        base = len(self._fixed_text)
        for j in range(start, len(self.ids)):
            head = self._decode(self.ids[start:j])
            pairs = enumerate(zip(head, tail, strict=False))
            n = next((k for k, (a, b) in pairs if a != b), len(head))
            self.offsets.append(base + min(n, len(tail)))

    def _trim_tokens(self, chars: int) -> None:
        """Drops the tokens that start at or after character `chars` (after a stop string)."""
        n, end = 0, 0
        while n < len(self.ids) and end < chars:
            end = len(self._decode(self.ids[: n + 1]))
            n += 1
        del self.ids[n:], self.logprobs[n:]
        if self.offsets is not None:
            del self.offsets[n:]

    def sent_tokens(self, chars: int) -> int:
        """How many kept tokens lie wholly within text[:chars] (with `offsets`)."""
        ends = self.offsets[1:] + [len(self.text)]
        return next((k for k, end in enumerate(ends) if end > chars), len(ends))

    def streamable(self, finished: bool) -> str:
        """The prefix of the text that can be sent now (all of it once finished)."""
        text = self.text
        if finished or self.stopped:
            return text
        if text.endswith(_PARTIAL):
            text = text.rstrip(_PARTIAL)
        k = _held_suffix(text, self.stops + self.hold)
        return text[: len(text) - k]

    def token_texts(self) -> list[str]:
        """Each kept token decoded on its own (what logprobs report as `token`)."""
        return [self._decode([t]) for t in self.ids]
