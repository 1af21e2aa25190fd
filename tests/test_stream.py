"""length_grouped_batch: length-bucketed batches drawn from a TaskStream, window by window.

The reference is TaskStream itself: the records of window w are whatever the plain stream
yields at position w * window * batch_size, so grouping can only reorder records, never add,
drop or repeat them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.data import TaskStream
from envace_jax.data.stream import length_grouped_batch


def _window_chunk(n: int, seed: int, w: int, window: int, batch_size: int) -> list[int]:
    return TaskStream(range(n), seed, position=w * window * batch_size).next_indices(
        window * batch_size
    )


def _padding(batches, lengths) -> int:
    """Pad tokens when each batch is padded to its longest row."""
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    batch_size=st.integers(1, 5),
    window=st.integers(1, 6),
    w=st.integers(0, 4),
    max_len=st.integers(1, 50),
)
def test_a_window_reorders_exactly_the_plain_streams_records(
    n, seed, batch_size, window, w, max_len
):
    lengths = np.random.default_rng(seed).integers(1, max_len + 1, n).tolist()
    batches = [
        length_grouped_batch(lengths, seed, w * window + j, batch_size, window)
        for j in range(window)
    ]
    assert all(len(b) == batch_size for b in batches)
    chunk = _window_chunk(n, seed, w, window, batch_size)
    # As multisets: a window larger than n (or one straddling epochs) repeats records, as the
    # plain stream does; otherwise each record of the chunk appears exactly once.
    assert sorted(i for b in batches for i in b) == sorted(chunk)

    # The batches are consecutive runs of the chunk sorted by length (ties by index), each run
    # used once: so a batch's longest row is no longer than the next run's shortest.
    ranked = sorted(chunk, key=lambda i: (lengths[i], i))
    runs = [ranked[k * batch_size : (k + 1) * batch_size] for k in range(window)]
    assert sorted(batches) == sorted(runs)
    for a, b in zip(runs, runs[1:], strict=False):
        assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)

    # Sorted runs minimise the summed batch maxima, so padding never exceeds the plain stream's.
    plain = [chunk[k * batch_size : (k + 1) * batch_size] for k in range(window)]
    assert _padding(batches, lengths) <= _padding(plain, lengths)


def test_grouping_cuts_padding_on_a_realistic_spread():
    # Why the feature exists: long-tailed lengths padded per batch waste far less when grouped.
    n, bs, window, seed = 512, 8, 16, 3
    lengths = np.random.default_rng(0).lognormal(5, 0.6, n).astype(int).tolist()
    steps = n // bs
    grouped = [length_grouped_batch(lengths, seed, s, bs, window) for s in range(steps)]
    stream = TaskStream(range(n), seed)
    plain = [stream.next_indices(bs) for _ in range(steps)]
    assert _padding(grouped, lengths) < 0.5 * _padding(plain, lengths)


def test_pure_function_of_step():
    n, bs, window, seed = 60, 3, 4, 9
    lengths = np.random.default_rng(1).integers(1, 100, n)  # a NumPy array works too
    in_order = [length_grouped_batch(lengths, seed, s, bs, window) for s in range(25)]
    shuffled = np.random.default_rng(2).permutation(25)
    out_of_order = {
        int(s): length_grouped_batch(lengths, seed, int(s), bs, window) for s in shuffled
    }
    assert [out_of_order[s] for s in range(25)] == in_order
    assert length_grouped_batch(lengths, seed, 7, bs, window) == in_order[7]
    # Windows visit their runs in a shuffled order: the shortest run is not always first.
    shortest_at = []
    for w in range(6):
        chunk = sorted(_window_chunk(n, seed, w, window, bs), key=lambda i: (lengths[i], i))
        got = [
            length_grouped_batch(lengths, seed, w * window + j, bs, window) for j in range(window)
        ]
        shortest_at.append(got.index(chunk[:bs]))
    assert len(set(shortest_at)) > 1
    other = [length_grouped_batch(lengths, seed + 1, s, bs, window) for s in range(25)]
    assert other != in_order


@pytest.mark.parametrize(("n", "bs", "window"), [(48, 4, 3), (48, 4, 12), (30, 1, 5), (7, 7, 1)])
def test_every_record_once_per_epoch(n, bs, window):
    assert n % (bs * window) == 0
    lengths = np.random.default_rng(n).integers(1, 20, n).tolist()
    per_epoch = n // bs
    seen = [
        [
            i
            for s in range(e * per_epoch, (e + 1) * per_epoch)
            for i in length_grouped_batch(lengths, 4, s, bs, window)
        ]
        for e in range(3)
    ]
    for epoch in seen:
        assert sorted(epoch) == list(range(n))
    if n > bs:
        assert seen[0] != seen[1]  # a fresh order each epoch


def test_window_of_one_is_the_plain_stream_batch():
    # One batch per window: sorting only reorders rows inside the batch.
    n, bs, seed = 20, 4, 5
    lengths = list(range(n, 0, -1))
    stream = TaskStream(range(n), seed)
    for s in range(10):
        plain = stream.next_indices(bs)
        got = length_grouped_batch(lengths, seed, s, bs, 1)
        assert got == sorted(plain, key=lambda i: (lengths[i], i))


@pytest.mark.parametrize(
    ("window", "batch_size", "step", "name"),
    [(0, 4, 0, "window"), (-2, 4, 0, "window"), (2, 0, 0, "batch_size"), (2, 4, -1, "step")],
)
def test_bad_arguments_name_the_argument(window, batch_size, step, name):
    with pytest.raises(ValueError, match=name):
        length_grouped_batch([1, 2, 3], 0, step, batch_size, window)
