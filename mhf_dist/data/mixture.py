"""Weighted mixtures of shard directories (``data.sources``, or a blend in ``data.path``): one global sample order over
several prepared datasets, independent of the number of data-parallel ranks and resumable at the next unseen sample of
every source.

The mixture's global positions come in blocks of ``BLOCK``, each holding ``c_k`` positions of source ``k`` (the
largest-remainder apportionment of ``BLOCK`` by the weights, each source at least one) in an order drawn by a generator
seeded with ``(seed, 2, block)``. The ``i``-th position of source ``k`` reads the ``i``-th sample of that source's own
stream (a ``ShardReader``'s global order), so a source smaller than its share repeats, epoch after epoch, and one
larger is not read to its end (said at start, ``describe``). dp rank ``r`` of ``R`` reads the positions
``X0 + r, X0 + r + R, ...``, each source's reader only the source positions that fall to it; the state is the next
unread mixture position, the same on every rank, so a resume, also on another dp, continues every source at its next
unseen sample (docs/design-training.md, "Reading the data").
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from mhf_dist.config import DataConfig, DataSource
from mhf_dist.data.formats import DataError
from mhf_dist.data.reader import RESTART_ADVICE, ShardReader, as_batch
from mhf_dist.data.skipped import Ranges
from mhf_dist.data.training_data import TrainingData, Validation

BLOCK = 4096  # the positions over which the sources' shares are exact


class MixtureSchedule:
    """Which source each mixture position reads, and at which position of that source's stream."""

    def __init__(self, weights: list[float], seed: int):
        self.seed = seed
        self.counts = apportion(weights, BLOCK)
        # the sources' readers and the consumer walk the same blocks
        self.block = lru_cache(maxsize=16)(self._block)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position of block ``b``, that position's index among the block's positions of its
        source)."""
        source = np.repeat(np.arange(len(self.counts)), self.counts)
        source = source[np.random.default_rng([self.seed, 2, b]).permutation(BLOCK)]
        occurrence = np.empty(BLOCK, dtype=np.int64)
        for k in range(len(self.counts)):
            occurrence[source == k] = np.arange(self.counts[k])
        return source, occurrence

    def positions(
        self, start: int, rank: int, ranks: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Block by block, the sources and source positions of mixture positions ``start + rank + i·ranks``."""
        first, b = start + rank, (start + rank) // BLOCK
        while True:
            x = np.arange(b * BLOCK, (b + 1) * BLOCK)
            mine = x[(x >= first) & ((x - first) % ranks == 0)]
            source, occurrence = self.block(b)
            k = source[mine - b * BLOCK]
            yield k, b * self.counts[k] + occurrence[mine - b * BLOCK]
            b += 1

    def consumed(self, end: int) -> np.ndarray:
        """Samples of each source among the mixture positions before ``end``."""
        b, rest = divmod(end, BLOCK)
        return b * self.counts + np.bincount(self.block(b)[0][:rest], minlength=len(self.counts))


def apportion(weights: list[float], total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (largest remainders), each share at least 1."""
    if len(weights) > total:
        raise DataError(
            f"{len(weights)} data sources are more than a mixture block of {total} positions holds"
        )
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]] += 1
    for k in np.flatnonzero(
        counts == 0
    ):  # a tiny weight still reads its source, at the largest one's expense
        counts[k], counts[np.argmax(counts)] = 1, counts.max() - 1
    return counts


class _SourceReader(ShardReader):
    """One source of a mixture: reads the source positions the schedule gives this rank."""

    def follow(self, positions: Iterator[np.ndarray]) -> None:
        self.close()
        self._positions = positions

    def _rank_positions(self) -> Iterator[np.ndarray]:
        return self._positions


class MixtureReader(TrainingData):
    """Batches for one data-parallel rank from a weighted mixture of shard directories (module docstring)."""

    def __init__(
        self,
        sources: list[DataSource],
        *,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        split: str = "train",
        skipped: Ranges = (),
        **reader_args,
    ):
        self.sources = sources
        self.readers = [
            _SourceReader(s.path, split=split, seed=seed, skipped=skipped, **reader_args)
            for s in sources
        ]
        self.manifest = self.readers[0].manifest
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.reader_args = reader_args  # the sources' settings, for their validation splits
        self.name = ", ".join(f"{s.label} ({r.name})" for s, r in zip(sources, self.readers))
        self.schedule = MixtureSchedule([s.weight for s in sources], seed)
        self._start(0)

    @property
    def skipped_shards(self) -> int:
        return sum(r.skipped_shards for r in self.readers)

    def _start(self, position: int) -> None:
        """Read from mixture position ``position`` on: each source follows this rank's share of the schedule."""
        self._base, self._consumed = position, 0
        plans = [
            self.schedule.positions(position, self.dp_rank, self.dp_size) for _ in self.readers
        ]
        for k, reader in enumerate(self.readers):
            reader.follow(source_positions(plans[k], k))
        self._order = (
            k
            for block, _ in self.schedule.positions(position, self.dp_rank, self.dp_size)
            for k in block.tolist()
        )

    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        rows = [self.readers[next(self._order)].next_rows(1)[0] for _ in range(micro_batch)]
        self._consumed += micro_batch
        return as_batch(rows, pin)

    @property
    def position(self) -> int:
        """The next unread mixture position (the same on every rank once all took equal batches)."""
        return self._base + self._consumed * self.dp_size

    def consumed(self) -> dict[str, int]:
        """Samples read so far from each source, by its label, over all ranks."""
        return dict(
            zip((s.label for s in self.sources), self.schedule.consumed(self.position).tolist())
        )

    def validation(self) -> list[Validation]:
        """Each source's validation split, where it has one, read by this rank as a single directory's is."""
        return [
            Validation(
                s.label,
                s.weight,
                ShardReader(
                    s.path,
                    split="val",
                    seed=self.seed,
                    dp_rank=self.dp_rank,
                    dp_size=self.dp_size,
                    **self.reader_args,
                ),
            )
            for s, r in zip(self.sources, self.readers)
            if "val" in r.manifest["splits"]
        ]

    def describe(self, samples: int, tokens: int) -> list[str]:
        return describe(self.sources, self.readers, samples, tokens)

    def state_dict(self) -> dict:
        return {
            "mixture_position": self.position,
            "seed": self.seed,
            "sources": [
                {"label": s.label, "weight": s.weight, "dataset": r.fingerprint}
                for s, r in zip(self.sources, self.readers)
            ],
        }

    def state_mismatch(self, state: dict) -> str | None:
        """Why ``state`` is a position in another stream (other sources, weights or seed), or None when it is one
        of this mixture's."""
        ours = self.state_dict()
        for key in ("seed", "sources"):
            if state.get(key) != ours[key]:
                return (
                    f"reader state has {key}={state.get(key)!r} but this mixture has {ours[key]!r}"
                )
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s mixture position; the rank count may differ from the saving run's."""
        if (mismatch := self.state_mismatch(state)) is not None:
            raise DataError(
                f"{mismatch}: resume with the sources, weights and data seed of the saved run, or "
                f"{RESTART_ADVICE}"
            )
        self.close()
        self._start(state["mixture_position"])

    def close(self) -> None:
        """Stop the sources' prefetch threads; ``next_batch`` goes on where the stream stands."""
        for reader in self.readers:
            reader.close()
        # the sources' threads read ahead of the consumer: plan again from here
        self._start(self.position)

    def __enter__(self) -> "MixtureReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_data(data: DataConfig, shards: Path, split: str = "train", **reader_args) -> TrainingData:
    """The reader of a run's data: its mixture (``data.sources``), else the shards of ``shards``."""
    if data.sources:
        return MixtureReader(data.sources, split=split, **reader_args)
    return ShardReader(shards, split=split, **reader_args)


def source_positions(plan: Iterator[tuple[np.ndarray, np.ndarray]], k: int) -> Iterator[np.ndarray]:
    """Source ``k``'s positions in a rank's plan, block by block (blocks without any are passed over)."""
    for source, position in plan:
        if (mine := position[source == k]).size:
            yield mine


def describe(
    sources: list[DataSource], readers: list[ShardReader], samples: int, tokens: int
) -> list[str]:
    """One line per source at start: its share of the mix and the epochs it gets over a run of ``samples``
    samples (``tokens`` tokens)."""
    shares = apportion([s.weight for s in sources], BLOCK) / BLOCK
    total = (
        f"{tokens / 1e9:.3g}B"
        if tokens >= 1e9
        else f"{tokens / 1e6:.3g}M"
        if tokens >= 1e6
        else f"{tokens:,}"
    )
    return [
        f"source {s.label}: {share:.2f} of the mix, {samples * share / r.samples_per_epoch:.2g} epochs over "
        f"{total} tokens ({r.samples_per_epoch:,} samples per epoch)"
        for s, share, r in zip(sources, shares, readers)
    ]
