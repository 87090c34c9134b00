"""Documents -> token ids, in parallel: the documents in chunks that never span two files (``file_chunks``),
each tokenized without special tokens with the tokenizer's EOS id after every document and split into training and
held-out ids by a hash of each document's text (``ChunkTokenizer``, ``is_validation``), by spawned worker
processes whose results come back in input order (``tokenized``). docs/design-training.md, "Data preparation",
says why."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from mhf_dist.data.inputs import BadDocuments, documents
from mhf_dist.vocab.tokenizers import load_tokenizer

_CHUNK_CHARS = 1 << 16  # text per tokenization task


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def file_chunks(
    files: Sequence[Path], text_field: str, bad: BadDocuments
) -> Iterator[tuple[list[str], bool]]:
    """Chunks of documents that never span two files, each with whether it is the last of its file."""
    for path in files:
        chunks = _chunks(documents([path], text_field, bad))
        chunk = next(chunks, None)
        while chunk is not None:
            following = next(chunks, None)
            yield chunk, following is None
            chunk = following


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the held-out split (a hash of its text below ``val_fraction``)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


class ChunkTokenizer:
    """Texts -> (train ids, val ids, train documents, val documents), EOS after every document."""

    def __init__(self, tokenizer, val_fraction: float):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.val_fraction = val_fraction

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)[
            "input_ids"
        ]
        held_out = [is_validation(text, self.val_fraction) for text in texts]
        streams: tuple[list[int], list[int]] = ([], [])
        for val, doc in zip(held_out, ids):
            streams[val].extend(doc)
            streams[val].append(self.eos)
        n_val = sum(held_out)
        return (
            np.asarray(streams[0], dtype=np.uint32),
            np.asarray(streams[1], dtype=np.uint32),
            len(texts) - n_val,
            n_val,
        )


_worker: ChunkTokenizer | None = None


def _init_worker(tokenizer_path: str, val_fraction: float) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker = ChunkTokenizer(load_tokenizer(tokenizer_path), val_fraction)


def _tokenize_in_worker(texts: list[str]):
    return _worker(texts)


def tokenized(
    chunks: Iterator[tuple[list[str], bool]],
    tokenize: ChunkTokenizer,
    tokenizer_path: str,
    workers: int,
):
    """(chunk size, last of its file, result) in input order; at most ``2 * workers`` chunks in flight."""
    if workers <= 1:
        for chunk, ends_file in chunks:
            yield len(chunk), ends_file, tokenize(chunk)
        return
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, _init_worker, (tokenizer_path, tokenize.val_fraction)) as pool:
        pending: deque = deque()
        for chunk, ends_file in chunks:
            pending.append((len(chunk), ends_file, pool.apply_async(_tokenize_in_worker, (chunk,))))
            if len(pending) >= 2 * workers:
                n, ends, result = pending.popleft()
                yield n, ends, result.get()
        while pending:
            n, ends, result = pending.popleft()
            yield n, ends, result.get()
