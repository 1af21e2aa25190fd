"""The host's side of one decode call of the running batch (`batcher.Engine._step`): the token
masks of rows under a grammar before it, and after it the hand-out of every row's new tokens to
its sequence, ending the rows that stopped.

Structured output (`serve.structured`): a sequence with a `grammar` may only sample the tokens
its grammar allows next, which depend on the token it sampled last. While a batch holds such a
row, it decodes one token per step call, and before each call the host asks every constrained
row's grammar for its mask (packed bits, [B, ceil(V/32)] int32; every token allowed in the other
rows), an input of the compiled step (`loop.decode(token_mask=...)`); the sampled tokens are
handed back to the grammars when they are emitted. A batch without constrained rows runs the
program it ran before (no mask input, `chunk_steps` tokens a call): unconstrained requests pay
nothing unless they share a batch with constrained ones, and then lose the chunking (one host
round-trip per token) while they do. Mask widths are fixed per model, so the masked programs
are one more per (rows, buffer) bucket. A grammar that fails (an error computing its mask, or a
sampled token it refuses) fails its own sequence only.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from envace_jax.serve.batch_state import Batch
from envace_jax.serve.sequences import Sequence, Tokens
from envace_jax.text.codes import Status

log = logging.getLogger(__name__)

# finish(seq, reason, num_generated=..., error=...): ends a sequence (`Engine._finish`).
Finish = Callable[..., None]


class Written(NamedTuple):
    """What a decode call left on the host: each row's window of tokens and logprobs from its
    first token not handed out yet ([B, chunk_steps]), its length and status ([B])."""

    tokens: np.ndarray
    logprobs: np.ndarray
    length: np.ndarray
    status: np.ndarray


def chunk_room(batch: Batch, chunk_steps: int) -> int:
    """The buffer length the next chunk may write up to: a row writes at most one token per
    step, up to its budget."""
    return max(
        (
            min(batch.prompt_len[i] + s.emitted + chunk_steps, s.budget)
            for i, s in enumerate(batch.rows)
            if s is not None
        ),
        default=0,
    )


def token_masks(batch: Batch, stats: collections.Counter) -> np.ndarray | None:
    """The token masks of a batch with rows under a grammar, int32 [B, words] (every token
    allowed in the other rows), or None when no row has one. A grammar that fails to give its
    mask fails its own sequence (`failed`; its row is then cancelled)."""
    rows = [
        (slot, seq)
        for slot, seq in enumerate(batch.rows)
        if seq is not None and seq.grammar is not None and seq.failed is None
    ]
    if not rows:
        return None
    start = time.perf_counter()
    mask = np.full((batch.size, rows[0][1].grammar.words), -1, np.int32)
    errors = _fill_batched(mask, rows)
    if errors is None:
        errors = [_fill_one(mask[slot], seq) for slot, seq in rows]
    for (_, seq), error in zip(rows, errors, strict=True):
        seq.failed = error
    stats["masks"] += len(rows)
    stats["mask_us"] += int((time.perf_counter() - start) * 1e6)
    return mask


def _fill_batched(mask: np.ndarray, rows) -> list[str | None] | None:
    """Every row's mask in one call where the grammars' class offers it (the GIL released once,
    not once a row); None where it does not, or fails."""
    kind = type(rows[0][1].grammar)
    if not hasattr(kind, "fill_masks") or any(type(s.grammar) is not kind for _, s in rows):
        return None
    try:
        return kind.fill_masks(mask, [(slot, seq.grammar) for slot, seq in rows])
    except Exception:
        log.exception("batched grammar masks failed; computing them row by row")
        return None


def _fill_one(out: np.ndarray, seq: Sequence) -> str | None:
    try:
        seq.grammar.fill_mask(out)
        return None
    except Exception as e:
        log.exception("grammar failed; failing its sequence")
        return f"{type(e).__name__}: {e}"


def hand_out(batch: Batch, written: Written, finish: Finish) -> np.ndarray:
    """Hands every row's new tokens to its sequence and ends (frees) the rows that stopped, were
    cancelled, or whose grammar broke. Returns bool [B]: rows still running on the device whose
    grammar refused their token (to be stopped now)."""
    broken = np.zeros(batch.size, bool)
    for slot, seq in enumerate(batch.rows):
        if seq is not None:
            broken[slot] = _hand_out_row(batch, slot, seq, written, finish)
    return broken


def _hand_out_row(batch: Batch, slot: int, seq: Sequence, written: Written, finish) -> bool:
    n = int(written.length[slot] - batch.prompt_len[slot]) - seq.emitted
    st = int(written.status[slot])
    stopped = st != Status.RUNNING
    ids, logp = written.tokens[slot, :n].tolist(), written.logprobs[slot, :n].tolist()
    total = seq.emitted + n
    # Read once: a callback or the server thread may cancel the row meanwhile, and the reason
    # and the decision to finish must agree (read twice, a row still running once ended as
    # 'stop').
    cancelled = seq.cancelled
    if cancelled:
        reason = "cancelled"
    elif st in (Status.FINISHED, Status.INVALID):
        reason = "stop"
        ids, logp = ids[:-1], logp[:-1]  # the stop token itself is not text
    elif st == Status.TRUNCATED:
        reason = "length"
    else:
        reason = None
    seq.emitted += n
    broken = False
    if seq.grammar is not None and ids and not cancelled and seq.failed is None:
        seq.failed = seq.grammar.advance(ids)
        broken = seq.failed is not None and not stopped
    if seq.failed is not None:
        batch.rows[slot] = None
        finish(seq, "error", num_generated=total, error=seq.failed)
        return broken
    if ids and not cancelled:
        seq.on_event(Tokens(tuple(ids), tuple(logp)))
    if stopped or cancelled:
        batch.rows[slot] = None
        finish(seq, reason or "stop", num_generated=total)
    return broken
