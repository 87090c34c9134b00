"""A content-hashed integer table on disk: the storage shared by the signature table (docs/spec.md §1) and the Engram
compression table (docs/spec.md §8).

One ``int32`` array in a safetensors file and its metadata in a JSON file, which also holds a SHA-256
content hash over the metadata and the array. Each file is written to ``.tmp`` and renamed into place, and a
load refuses a missing, unreadable or modified table with the way to recover it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

T = TypeVar("T")


def content_hash(meta: dict, array: torch.Tensor) -> str:
    """SHA-256 over the canonical JSON of ``meta`` and the little-endian int32 bytes of ``array``."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True, ensure_ascii=False).encode())
    h.update(array.numpy().astype("<i4").tobytes())
    return h.hexdigest()


class ContentHashed:
    """Base of a stored table's frozen dataclass: its ``content_hash`` field, left empty, is filled with
    ``self._compute_hash()``."""

    def __post_init__(self):
        if not self.content_hash:
            object.__setattr__(self, "content_hash", self._compute_hash())


@dataclass(frozen=True)
class StoredTable:
    """Where one kind of table is stored and what a user is told when it cannot be loaded."""

    what: str  # "signature table"
    array_file: str
    meta_file: str
    key: str  # the array's name inside the safetensors file
    error: type[ValueError]
    fix: str  # how to recover, appended to every load error

    def save(
        self, directory: str | os.PathLike, array: torch.Tensor, meta: dict, digest: str
    ) -> Path:
        """Write ``array`` and ``meta`` (with ``content_hash = digest``) into ``directory``, each file atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp_array, tmp_meta = (
            directory / (self.array_file + ".tmp"),
            directory / (self.meta_file + ".tmp"),
        )
        save_file({self.key: array.numpy()}, str(tmp_array))
        tmp_meta.write_text(json.dumps(meta | {"content_hash": digest}, ensure_ascii=False))
        os.replace(tmp_array, directory / self.array_file)
        os.replace(tmp_meta, directory / self.meta_file)
        return directory

    def load(self, directory: str | os.PathLike, build: Callable[[torch.Tensor, dict], T]) -> T:
        """``build(array, meta)`` from the files in ``directory``; refused unless the built table's
        ``content_hash`` equals the stored one."""
        directory = Path(directory)
        for p in (directory / self.array_file, directory / self.meta_file):
            if not p.is_file():
                raise self.error(f"{self.what} file {p} is missing; {self.fix}")
        try:
            meta = json.loads((directory / self.meta_file).read_text())
            array = torch.from_numpy(
                load_file(str(directory / self.array_file))[self.key].astype(np.int32)
            )
            table = build(array, meta)
        except Exception as e:  # truncated or garbled files
            raise self.error(f"{self.what} in {directory} is unreadable ({e}); {self.fix}") from e
        if table.content_hash != meta.get("content_hash"):
            raise self.error(
                f"{self.what} in {directory} fails its content check (stored {meta.get('content_hash')}, "
                f"computed {table.content_hash}): a file was modified or truncated; {self.fix}"
            )
        return table
