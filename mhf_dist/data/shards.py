"""Packing: one split's token stream cut into samples of ``seq_len + 1`` ids and written into tar shards
(``SplitWriter``). A file's trailing partial sample is dropped and its last shard closed, so no sample or shard
spans two files. The format: ``mhf_dist.data.formats``; why a file is the unit of packing:
docs/design-training.md, "Data preparation"."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import webdataset as wds

from mhf_dist.data.formats import SAMPLE_MEMBER, SHARD_SUFFIX


class SplitWriter:
    """Packs one split's token stream into ``seq_len + 1`` samples and writes them into shards."""

    def __init__(
        self,
        out_dir: Path,
        prefix: str,
        sample_tokens: int,
        dtype: np.dtype,
        samples_per_shard: int,
    ):
        self.out_dir, self.prefix = out_dir, prefix
        self.sample_tokens, self.dtype, self.samples_per_shard = (
            sample_tokens,
            dtype,
            samples_per_shard,
        )
        self.rest = np.zeros(0, dtype=np.uint32)
        self.documents = self.input_tokens = self.samples = 0
        self.shards: list[dict] = []
        self.file = self.tar = None
        self.in_shard = 0

    def add(self, ids: np.ndarray, documents: int) -> None:
        self.documents += documents
        self.input_tokens += len(ids)
        stream = np.concatenate([self.rest, ids])
        full = len(stream) // self.sample_tokens * self.sample_tokens
        for sample in stream[:full].reshape(-1, self.sample_tokens):
            self._write(sample)
        self.rest = stream[full:]

    def end_file(self) -> None:
        """Drop the file's trailing partial sample and close its last shard: nothing spans two files."""
        self.rest = self.rest[:0]
        if self.tar is not None:
            self._close_shard()

    def _write(self, sample: np.ndarray) -> None:
        if self.tar is None:
            self.file = open(self.out_dir / self._name(len(self.shards)), "wb")
            self.tar = wds.TarWriter(
                self.file, encoder=False, mtime=0, user="mhf-dist", group="mhf-dist"
            )
        buf = io.BytesIO()
        np.save(buf, sample.astype(self.dtype), allow_pickle=False)
        self.tar.write({"__key__": f"{self.samples:010d}", SAMPLE_MEMBER: buf.getvalue()})
        self.samples += 1
        self.in_shard += 1
        if self.in_shard == self.samples_per_shard:
            self._close_shard()

    def _name(self, index: int) -> str:
        return f"{self.prefix}-{index:06d}{SHARD_SUFFIX}"

    def _close_shard(self) -> None:
        self.tar.close()
        self.file.close()
        path = self.out_dir / self._name(len(self.shards))
        data = path.read_bytes()
        self.shards.append(
            {
                "name": path.name,
                "samples": self.in_shard,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
        self.file = self.tar = None
        self.in_shard = 0

    def finish(self) -> dict:
        self.end_file()
        tokens = self.samples * self.sample_tokens
        return {
            "documents": self.documents,
            "input_tokens": self.input_tokens,
            "samples": self.samples,
            "tokens": tokens,
            "dropped_tokens": self.input_tokens - tokens,
            "shards": self.shards,
        }
