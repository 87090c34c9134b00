"""Ranges of the global sample order that a run never reads: the data a rollback skipped (``train.on_spike=rollback``).

A range ``[start, stop)`` is in global positions (``epoch × samples per epoch + position``, the reader's order, which
no rank count changes) and spans whole optimizer steps, so its length is a multiple of every data-parallel size the
global batch allows and each rank's positions keep their stride across it. A reader that would read a skipped
position reads the next one past the range instead; the positions outside the ranges keep their order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Ranges = Sequence[tuple[int, int]]


def merged(ranges: Ranges) -> list[tuple[int, int]]:
    """``ranges`` as disjoint ranges in order (a later rollback to the same checkpoint skips a range that holds an
    earlier one)."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif stop > start:
            out.append((start, stop))
    return out


def past_skipped(position: int, ranges: Ranges) -> int:
    """``position``, or the end of the skipped range it falls in (``ranges``: as ``merged`` returns them)."""
    for start, stop in ranges:
        if start <= position < stop:
            return stop
    return position


def place(base: int, offsets: np.ndarray, ranges: Ranges) -> np.ndarray:
    """The global positions of the samples ``offsets`` (increasing) unskipped samples past ``base`` (itself not
    skipped): each range past ``base`` shifts the offsets that reach it by its length (``ranges``: as ``merged``
    returns them, so that each shift is taken in order)."""
    positions = base + offsets
    for start, stop in ranges:
        if stop > base:
            positions = np.where(positions >= start, positions + (stop - start), positions)
    return positions
