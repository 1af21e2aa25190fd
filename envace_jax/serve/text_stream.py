"""Incremental detokenisation with stop sequences, for one generated choice.

Tokens arrive in chunks; `ChoiceText.add` keeps the decoded text, cuts it at the first stop
sequence (or stop token id), and tells how much of it is safe to stream: text that could still
turn out to be the start of a stop sequence (or of a `<tool_call>` block, for chat with tools)
is held back, as is a trailing partial UTF-8 character.

Decoding is incremental: the text of tokens up to the last clean character boundary is kept, and
only the tokens after it are decoded again (byte-level BPE decodes any clean split exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """

    def __init__(
        self,
        tokenizer,
        *,
        stops: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
        hold: Sequence[str] = (),
        skip_special_tokens: bool = False,
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
        self.text = text

    def _trim_tokens(self, chars: int) -> None:
        """Drops the tokens that start at or after character `chars` (after a stop string)."""
        n, end = 0, 0
        while n < len(self.ids) and end < chars:
            end = len(self._decode(self.ids[: n + 1]))
            n += 1
        del self.ids[n:], self.logprobs[n:]

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
