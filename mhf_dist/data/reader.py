"""Rank-disjoint, resumable reading of packed token shards (``mhf_dist.data.prepare`` writes them).

Shards are opened by ``open_url`` (local paths, ``pipe:`` commands, ``http(s)``, object
storage through fsspec), iterated with WebDataset's tar iterators and checked against the manifest's SHA-256 whatever
they come from. A source is a local directory, the URL of a directory holding ``manifest.json`` and its shards, or shard
URLs with a manifest (a brace pattern, ``::``-separated, or a list); ``mhf_dist.data.shard_source`` resolves it. The
reader defines one infinite stream of samples, the same for every rank count: each epoch permutes the shards and cuts
them into windows of ``shuffle_window`` shards whose (permuted) samples it interleaves; dp rank ``r`` of ``R`` reads
global positions ``X0 + r, X0 + r + R, ...``, so a step consumes the same positions whatever ``R`` is, and the state
(the next unread position, the same on every rank) resumes on any ``R``. Ranges a rollback skipped are passed over. One
background thread per reader prefetches the next window. A bad shard raises ``DataError`` naming it and the fix, or
with ``on_bad_shard="skip"`` is skipped, its positions read from the window's next readable shard, so positions and
state stay as without it. Position by position, and why: docs/design-training.md, "Reading the data".
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import threading
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Literal

import numpy as np
import torch
import webdataset as wds

from mhf_dist.data.formats import MANIFEST, TRAIN_SPLIT, DataError
from mhf_dist.data.locations import open_url, read_json
from mhf_dist.data.shard_source import Shard, check_expectations, manifest_digest, resolve
from mhf_dist.data.skipped import Ranges, merged, past_skipped, place
from mhf_dist.data.training_data import TrainingData, Validation

log = logging.getLogger(__name__)

RESTART_ADVICE = (
    "start this data's order from its beginning with --set data.restart=true (weights, optimizer and "
    "learning-rate schedule continue)"
)  # the fix for a resume whose data position is in other data
_POSITION_BLOCK = 4096  # a rank's positions are planned this many at a time
_REPAIR = "re-copy or re-create it (mhf-dist prepare-data)"
_FIX = _REPAIR + ", or set data.on_bad_shard=skip to train without it"


class _HashingReader:
    """A read-only stream that feeds everything read through it into a SHA-256."""

    def __init__(self, stream):
        self.stream = stream
        self.sha256 = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.sha256.update(data)
        return data


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))


class ShardReader(TrainingData):
    """Batches of packed samples for one data-parallel rank, in the rank-count-independent global order.

    ``source``: a directory holding ``manifest.json`` and its shards (named by
    their paths under it: a merged manifest's are in the parts' sub-directories,
    ``part-1-of-4/train-000000.tar``, see ``mhf_dist.data.parts``), or shard
    URLs (a brace pattern / ``::``-separated string, or a list) together with
    ``manifest`` (a path or URL of the manifest). URLs are matched to the
    manifest's shards by name; a subset of the shards may be given.
    ``seq_len`` and ``tokenizer_fingerprint``, when given, must match the
    manifest. ``split`` is ``"train"`` or ``"val"``. ``skipped``: global position ranges
    never read (``mhf_dist.data.skipped``). ``pipe:`` URLs run a shell
    command per shard, so they are refused unless ``allow_pipe`` (``data.allow_pipe``);
    a local directory is read through absolute paths, so its name is never taken
    for a URL scheme.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str],
        *,
        manifest: str | os.PathLike | None = None,
        split: str = TRAIN_SPLIT,
        seq_len: int | None = None,
        tokenizer_fingerprint: str | None = None,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle_window: int = 16,
        on_bad_shard: Literal["error", "skip"] = "error",
        verify_checksums: bool = True,
        allow_pipe: bool = False,
        skipped: Ranges = (),
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if seed < 0 or shuffle_window < 1:
            raise ValueError(f"seed={seed} must be >= 0 and shuffle_window={shuffle_window} >= 1")
        if on_bad_shard not in ("error", "skip"):
            raise ValueError(f"on_bad_shard={on_bad_shard!r}: use 'error' or 'skip'")
        self.manifest, self.manifest_location, self.shards = resolve(
            source, manifest, split, allow_pipe
        )
        # a local directory: its absolute path
        self.name = self.manifest_location.removesuffix(f"/{MANIFEST}")
        self._reopen = partial(
            ShardReader,
            source,
            manifest=manifest,
            seq_len=seq_len,
            seed=seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tokenizer_fingerprint=tokenizer_fingerprint,
            allow_pipe=allow_pipe,
            shuffle_window=shuffle_window,
            on_bad_shard=on_bad_shard,
            verify_checksums=verify_checksums,
        )  # another split of this source (validation)
        # a failing shard may mean the data was re-prepared
        self._manifest_digest = manifest_digest(self.manifest)
        check_expectations(self.manifest, self.manifest_location, seq_len, tokenizer_fingerprint)
        self.seq_len = self.manifest["seq_len"]
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.member = self.manifest["sample_member"]
        self.seed, self.dp_rank, self.dp_size, self.shuffle_window = (
            seed,
            dp_rank,
            dp_size,
            shuffle_window,
        )
        self.on_bad_shard, self.verify_checksums = on_bad_shard, verify_checksums
        self.counts = np.array([s.samples for s in self.shards])
        self.samples_per_epoch = int(self.counts.sum())
        self.fingerprint = hashlib.sha256(
            json.dumps([[s.name, s.samples, s.sha256] for s in self.shards]).encode()
        ).hexdigest()
        self.skipped_shards = 0
        self.skipped = merged(skipped)
        # global position where this reader's stream starts (all ranks)
        self._base = past_skipped(0, self.skipped)
        self._consumed = 0  # samples returned by this rank since _base
        self._epoch_cache: tuple[int, np.ndarray, list[np.ndarray]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._buffer: deque = deque()
        self._error: BaseException | None = None

    # ------------------------------------------------------------ consumer
    def next_batch(self, micro_batch: int, pin: bool = False) -> torch.Tensor:
        """This rank's next ``micro_batch`` samples: a LongTensor ``[micro_batch, seq_len + 1]``, in pinned memory
        with ``pin`` (for a CUDA device: its copy there can then be ``non_blocking``; needs CUDA)."""
        return as_batch(self.next_rows(micro_batch), pin)

    def next_rows(self, count: int) -> list[np.ndarray]:
        """This rank's next ``count`` samples, as the shards hold them."""
        if self._error is not None:
            raise self._error
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._produce,
                args=(self._rank_positions(),),
                daemon=True,
                name="ShardReader",
            )
            self._thread.start()
        rows = []
        while len(rows) < count:
            if not self._buffer:
                item = self._queue.get()
                if isinstance(item, BaseException):
                    self._error = item
                    raise item
                self._buffer.extend(item)
            rows.append(self._buffer.popleft())
        self._consumed += count
        return rows

    def state_dict(self) -> dict:
        """The next unread global position (the same on every rank once all took equal batches); JSON-serialisable."""
        epoch, position = divmod(self.global_position(), self.samples_per_epoch)
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "shuffle_window": self.shuffle_window,
            "dataset": self.fingerprint,
        }

    def state_mismatch(self, state: dict) -> str | None:
        """Why ``state`` is a position in another stream (other shards, seed or shuffle window), or None when it
        is one of this reader's."""
        for key, ours in (
            ("dataset", self.fingerprint),
            ("seed", self.seed),
            ("shuffle_window", self.shuffle_window),
        ):
            if state.get(key) != ours:
                return (
                    f"reader state has {key}={state.get(key)!r} but this reader uses {ours!r} "
                    f"({self.manifest_location})"
                )
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s global position; the rank count may differ from the saving run's."""
        if (mismatch := self.state_mismatch(state)) is not None:
            raise DataError(
                f"{mismatch}: resume with the shards, data seed and shuffle window of the saved run, or "
                f"{RESTART_ADVICE}"
            )
        self.close()
        self._base = past_skipped(self.global_position(state), self.skipped)
        self._consumed = 0
        self._error = None

    def validation(self) -> list[Validation]:
        """A reader of this source's validation split, with this reader's settings (none without one)."""
        return (
            [Validation(None, 1.0, self._reopen(split="val"))]
            if "val" in self.manifest["splits"]
            else []
        )

    def skip(self, start: int, stop: int) -> None:
        """Never read global positions ``[start, stop)`` (a rollback's, whose stream already stands past them)."""
        self.close()
        self.skipped = merged([*self.skipped, (start, stop)])
        self._base = past_skipped(self._base, self.skipped)

    def global_position(self, state: dict | None = None) -> int:
        """The global position (``epoch × samples per epoch + position``) of ``state`` (a ``state_dict`` of this
        stream), or this reader's next unread one: past the samples all ranks took since ``_base`` and the skipped
        ranges among them."""
        if state is not None:
            return state["epoch"] * self.samples_per_epoch + state["position"]
        if not self._consumed:
            return self._base
        last = int(
            place(self._base, np.array([self._consumed * self.dp_size - 1]), self.skipped)[0]
        )
        return past_skipped(last + 1, self.skipped)

    def close(self) -> None:
        """Stop the prefetch thread (``next_batch`` restarts it where the stream stands)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=1)
        self._base = self.global_position()
        self._consumed = 0
        self._buffer.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ producer
    def _rank_positions(self) -> Iterator[np.ndarray]:
        """This rank's global positions from where its stream stands, increasing, in blocks (past skipped ranges)."""
        x, step = self._consumed * self.dp_size + self.dp_rank, self.dp_size * _POSITION_BLOCK
        while True:
            yield place(self._base, np.arange(x, x + step, self.dp_size), self.skipped)
            x += step

    def _produce(self, positions: Iterator[np.ndarray]) -> None:
        """Background thread: this rank's samples window by window, at the global ``positions`` (increasing,
        endless)."""
        stop, out = self._stop, self._queue
        try:
            pending = next(positions)
            while not stop.is_set():
                epoch, p = divmod(int(pending[0]), self.samples_per_epoch)
                starts, groups = self._windows(epoch)
                w = int(np.searchsorted(starts, p, side="right")) - 1
                end = epoch * self.samples_per_epoch + starts[w + 1]
                if pending[-1] < end:  # the window's positions may go on in the next block
                    pending = np.concatenate([pending, next(positions)])
                    continue
                inside = pending < end
                local = pending[inside] - epoch * self.samples_per_epoch - starts[w]
                pending = pending[~inside]
                _put(out, self._load_window(epoch, groups[w], local), stop)
        except BaseException as e:  # handed to the consumer, which raises it
            _put(out, e, stop)

    def _windows(self, epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Start positions of ``epoch``'s windows (and the epoch's end) and each window's shards."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = _rng(self.seed, 0, epoch).permutation(len(self.shards))
            groups = [
                order[i : i + self.shuffle_window]
                for i in range(0, len(order), self.shuffle_window)
            ]
            starts = np.concatenate([[0], np.cumsum([self.counts[g].sum() for g in groups])])
            self._epoch_cache = (epoch, starts, groups)
        return self._epoch_cache[1], self._epoch_cache[2]

    def _window_order(self, epoch: int, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard and in-shard index of every position of one window (round-robin over shuffled shards)."""
        slot = np.concatenate([np.full(self.counts[s], k) for k, s in enumerate(group)])
        turn = np.concatenate([np.arange(self.counts[s]) for s in group])
        index = np.concatenate(
            [
                _rng(self.seed, 1, epoch, self.shards[s].index).permutation(self.counts[s])
                for s in group
            ]
        )
        order = np.lexsort((slot, turn))
        return group[slot[order]], index[order]

    def _load_window(self, epoch: int, group: np.ndarray, local: np.ndarray) -> list[np.ndarray]:
        """The samples at window positions ``local``, substituting for skipped shards."""
        shard_of, index_of = self._window_order(epoch, group)
        got: dict[tuple[int, int], np.ndarray] = {}
        bad: set[int] = set()
        while True:
            positions = _substitutes(local, shard_of, bad, [self.shards[s].name for s in group])
            wanted = list(zip(shard_of[positions].tolist(), index_of[positions].tolist()))
            missing: dict[int, set[int]] = defaultdict(set)
            for s, i in wanted:
                if (s, i) not in got:
                    missing[s].add(i)
            if not missing:
                return [got[key] for key in wanted]
            for s, indices in missing.items():
                try:
                    got.update(
                        ((s, i), a) for i, a in self._read_shard(self.shards[s], indices).items()
                    )
                except DataError as e:
                    if (replaced := self._replaced(self.shards[s])) is not None:
                        raise replaced from None  # no bad shard: skipping it would not help
                    if self.on_bad_shard == "error":
                        raise
                    bad.add(s)
                    self.skipped_shards += 1
                    log.warning("skipping shard (data.on_bad_shard=skip): %s", e)

    def _replaced(self, shard: Shard) -> DataError | None:
        """When a shard fails because its manifest changed since this reader read it (the directory was prepared
        again, ``prepare-data --overwrite``), the error that says so; None when the manifest is as it was."""
        try:
            now = manifest_digest(read_json(self.manifest_location))
        except DataError:  # gone, or unreadable: replaced or being replaced
            now = None
        if now == self._manifest_digest:
            return None
        change = "is gone" if now is None else "changed"
        return DataError(
            f"shard {shard.url} is not the one this run's manifest lists: {self.manifest_location} "
            f"{change} since the run started reading it, so the data was prepared again (or removed) "
            "under the run, which no data.on_bad_shard setting mends. To train on the new preparation, "
            f"resume and {RESTART_ADVICE}; to go on with the old data, put it back and resume"
        )

    def _read_shard(self, shard: Shard, wanted: set[int]) -> dict[int, np.ndarray]:
        """Stream one shard from start to end; the samples at ``wanted`` indices, after every check."""
        try:
            stream = open_url(shard.url)
        except FileNotFoundError:
            raise DataError(
                f"shard {shard.url} is missing (listed in {self.manifest_location}); {_FIX}"
            ) from None
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"shard {shard.url} cannot be opened ({e!r}); {_FIX}") from None
        reader = _HashingReader(stream)
        found: dict[int, np.ndarray] = {}
        count = 0
        try:
            with stream:
                files = wds.tariterators.tar_file_expander([{"url": shard.url, "stream": reader}])
                for count, sample in enumerate(wds.tariterators.group_by_keys(files), 1):
                    if count - 1 in wanted:
                        found[count - 1] = self._decode(sample, shard, count - 1)
                while reader.read(1 << 20):  # the tar end padding, for the checksum
                    pass
        except DataError:
            raise
        except Exception as e:  # tarfile, OS and subprocess errors alike mean an unreadable shard
            raise DataError(
                f"shard {shard.url} is unreadable: truncated, corrupt or missing "
                f"({type(e).__name__}: {e.args[0] if e.args else ''}); {_FIX}"
            ) from None
        if count != shard.samples:
            raise DataError(
                f"shard {shard.url} has {count} samples but {self.manifest_location} lists "
                f"{shard.samples}: it is truncated or from another preparation; {_FIX}"
            )
        if self.verify_checksums and reader.sha256.hexdigest() != shard.sha256:
            raise DataError(
                f"shard {shard.url} fails its SHA-256 check against {self.manifest_location}: "
                f"the file is corrupt or was changed; {_FIX}"
            )
        return found

    def _decode(self, sample: dict, shard: Shard, index: int) -> np.ndarray:
        try:
            tokens = np.load(io.BytesIO(sample[self.member]), allow_pickle=False)
        except (KeyError, ValueError, OSError) as e:
            raise DataError(
                f"shard {shard.url}, sample {index} ({sample.get('__key__')}): no readable "
                f"{self.member} member ({e!r}); {_FIX}"
            ) from None
        if tokens.dtype != self.dtype or tokens.shape != (self.seq_len + 1,):
            raise DataError(
                f"shard {shard.url}, sample {index}: {tokens.dtype} array of shape {tokens.shape}, "
                f"expected {self.dtype} of ({self.seq_len + 1},) as {self.manifest_location} says; {_FIX}"
            )
        return tokens


def as_batch(rows: list[np.ndarray], pin: bool = False) -> torch.Tensor:
    """Samples as a LongTensor ``[len(rows), seq_len + 1]``, in pinned memory with ``pin``."""
    if not pin:
        return torch.from_numpy(np.stack(rows).astype(np.int64))
    batch = torch.empty((len(rows), len(rows[0])), dtype=torch.int64, pin_memory=True)
    np.stack(rows, out=batch.numpy())  # widened to int64 straight into the pinned buffer
    return batch


def _put(out: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _substitutes(
    local: np.ndarray, shard_of: np.ndarray, bad: set[int], names: list[str]
) -> np.ndarray:
    """Each window position, or (if its shard is bad) the next position, cyclically, in a readable shard."""
    if not bad:
        return local
    readable = np.flatnonzero(~np.isin(shard_of, list(bad)))
    if len(readable) == 0:
        raise DataError(
            f"every shard of a shuffle window is unreadable ({', '.join(names)}): {_REPAIR}"
        )
    return readable[np.searchsorted(readable, local) % len(readable)]
