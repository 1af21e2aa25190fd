"""The batching engine's queue: sequences waiting for a row, in arrival order, and the window
that lets concurrent requests start in one batch (see `batcher`'s docstring).

Thread-safe: HTTP threads put and cancel, the engine thread takes. Cancelled sequences that
are still waiting are ended here (`finish(seq, 'cancelled')`) without taking a row.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from envace_jax.serve.sequences import Sequence


class RequestQueue:
    """wait_s / max_wait_s / max_batch: the batching window (`gather`). finish: ends a
    sequence (`Engine._finish`)."""

    def __init__(
        self, *, wait_s: float, max_wait_s: float, max_batch: int, finish: Callable[..., None]
    ):
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s
        self.max_batch = max_batch
        self._finish = finish
        self._pending: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self.stopping = False

    def put(self, seq: Sequence) -> None:
        with self._cv:
            if self.stopping:
                raise RuntimeError("the engine is shutting down")
            self._pending.append(seq)
            self._cv.notify_all()

    def wake(self) -> None:
        """Wakes the engine thread (a sequence was cancelled)."""
        with self._cv:
            self._cv.notify_all()

    def stop(self) -> None:
        """No more sequences are taken; the engine thread is woken to see it."""
        with self._cv:
            self.stopping = True
            self._cv.notify_all()

    def drain(self) -> list[Sequence]:
        """Empties the queue; returns what waited."""
        with self._cv:
            leftover = list(self._pending)
            self._pending.clear()
        return leftover

    def waiting(self) -> int:
        with self._cv:
            return len(self._pending)

    def wait_for_work(self, timeout: float) -> bool:
        """True if a sequence waits; otherwise waits up to `timeout` for one (or a stop) and
        returns False, so that the caller looks again."""
        with self._cv:
            if self.stopping:
                return False
            self._drop_cancelled()
            if self._pending:
                return True
            self._cv.wait(timeout)
            return False

    def gather(self) -> None:
        """The batching window: returns once no request arrived for `wait_s` (counted from the
        latest arrival), `max_wait_s` after the first one, at `max_batch` waiting, or on stop."""
        with self._cv:
            if not self._pending:
                return
            deadline = self._pending[0].arrived + self.max_wait_s
            while not self.stopping and len(self._pending) < self.max_batch:
                now = time.monotonic()
                until = min(self._pending[-1].arrived + self.wait_s, deadline)
                if now >= until:
                    return
                self._cv.wait(until - now)  # put() notifies: the window is re-measured

    def take(self, limit: int, max_len: int | None = None) -> list[Sequence]:
        """Pops up to `limit` waiting sequences in arrival order; with `max_len`, only while
        they fit a buffer of that length (the first that does not blocks those behind it)."""
        taken = []
        with self._cv:
            self._drop_cancelled()
            while self._pending and len(taken) < limit:
                if max_len is not None and self._pending[0].need > max_len:
                    break
                taken.append(self._pending.popleft())
        return taken

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._pending if s.cancelled]:
            self._pending.remove(seq)
            self._finish(seq, "cancelled")
