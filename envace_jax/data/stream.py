"""Deterministic shuffled iteration over a random-access source, resumable from one integer.

The stream is a pure function of (seed, position): epoch e visits the records in the order of
a permutation drawn from `SeedSequence([seed, e])`, and `position` counts the records this
stream has yielded since the start, across epochs. Saving `position` in a checkpoint and
building `TaskStream(source, seed, position)` later yields exactly the records an
uninterrupted stream would have yielded next.

Multi-host: with `shard_count=k`, process `shard_index=s` reads only positions s, s+k, s+2k...
of each epoch's permutation. Every shard gets `len(source) // k` records per epoch (the
permutation's tail is left out, a different tail each epoch), so all hosts stay in lockstep and
share one `position` value when they draw batches of the same size.

The order depends on numpy's `Generator.permutation`, which numpy keeps stable in practice but
does not promise across major versions; pin numpy to replay a run record for record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np


class RandomAccess(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class TaskStream:
    """Endless shuffled records of `source`, epoch after epoch.

    Args:
      source: anything with `len` and integer `__getitem__` (a list, an ArrayRecord data
        source, `TaskRecords`).
      seed: base seed; epoch e uses SeedSequence([seed, e]).
      position: records already consumed by this shard (0 to start; a saved `.position`).
      shard_index, shard_count: this process's share of every epoch.
      shuffle: False visits records in source order every epoch (evaluation).
    """

    def __init__(
        self,
        source: RandomAccess,
        seed: int,
        position: int = 0,
        *,
        shard_index: int = 0,
        shard_count: int = 1,
        shuffle: bool = True,
    ):
        if shard_count < 1 or not 0 <= shard_index < shard_count:
            raise ValueError(
                f"shard_index must be in [0, shard_count), got {shard_index} of {shard_count}"
            )
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        n = len(source)
        if n // shard_count == 0:
            raise ValueError(
                f"source has {n} records, too few for {shard_count} shards (need >= 1 each)"
            )
        self.source = source
        self.seed = int(seed)
        self.shard_index = shard_index
        self.shard_count = shard_count
        self.shuffle = shuffle
        self.per_epoch = n // shard_count  # records this shard reads per epoch
        self._n = n
        self._position = int(position)
        self._cached_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def position(self) -> int:
        """Records consumed so far (save this to resume)."""
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self.per_epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """This shard's source indices for `epoch`, [per_epoch] int64."""
        if epoch != self._cached_epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                perm = rng.permutation(self._n)
            else:
                perm = np.arange(self._n)
            self._order = perm[self.shard_index :: self.shard_count][: self.per_epoch]
            self._cached_epoch = epoch
        return self._order

    def index_at(self, position: int) -> int:
        """Source index of the record at stream `position` (pure in seed and position)."""
        epoch, offset = divmod(position, self.per_epoch)
        return int(self._epoch_order(epoch)[offset])

    def next_indices(self, n: int) -> list[int]:
        """The next n source indices; advances the position."""
        out = [self.index_at(self._position + i) for i in range(n)]
        self._position += n
        return out

    def next_batch(self, n: int) -> list[Any]:
        """The next n records; advances the position."""
        return [self.source[i] for i in self.next_indices(n)]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next_batch(1)[0]


def length_grouped_batch(lengths, seed: int, step: int, batch_size: int, window: int) -> list[int]:
    """Source indices of batch `step` (0-based) when batches are grouped by length.

    The stream's records are taken `window` batches at a time; inside a window they are
    sorted by `lengths[index]` and cut into `window` batches, which are visited in a seeded
    random order. Rows of one batch then have similar lengths, so a batch padded to its longest
    row wastes little (the usual bucket-by-length sampling), and the records are those the
    plain stream yields, in another order within each window. A pure function of `step`:
    resuming needs no state beyond the step.
    """
    for name, value, least in (
        ("window", window, 1),
        ("batch_size", batch_size, 1),
        ("step", step, 0),
    ):
        if value < least:
            raise ValueError(f"length_grouped_batch: {name} must be >= {least}, got {value}")
    w, j = divmod(step, window)
    stream = TaskStream(range(len(lengths)), seed, position=w * window * batch_size)
    chunk = stream.next_indices(window * batch_size)
    chunk.sort(key=lambda i: (lengths[i], i))
    order = np.random.default_rng([seed, w, 1]).permutation(window)
    k = int(order[j])
    return chunk[k * batch_size : (k + 1) * batch_size]
