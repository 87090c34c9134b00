"""Documents -> token ids, in parallel: the documents in chunks that never span two files (``file_chunks``),
each tokenized without special tokens with the tokenizer's EOS id after every document and split into training and
held-out ids by a hash of each document's text (``ChunkTokenizer``, ``is_validation``), by spawned worker
processes whose results come back in input order (``tokenized``). docs/design-training.md, "Data preparation",
says why."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from mhf_dist.data.inputs import BadDocuments, documents

_CHUNK_CHARS = 1 << 16  # text per tokenization task
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)  # the array typecode of uint32


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


def _rust_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` to which ``tokenizer(texts, add_special_tokens=False)`` hands the texts as they
    are (a fast tokenizer whose class keeps the generic call: some classes rewrite the text first), set as that call
    sets it (no truncation, no padding, special tokens' text split or not as ``split_special_tokens`` says): a copy
    when that takes a change, so that the tokenizer saved with the shards is the one loaded. ``None`` for another
    tokenizer."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(
        getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerFast, name, None)
        for name in ("__call__", "_encode_plus")
    ):
        return None
    rust = tokenizer.backend_tokenizer
    split = bool(tokenizer.split_special_tokens)
    if (
        rust.truncation is not None
        or rust.padding is not None
        or rust.encode_special_tokens != split
    ):
        rust = type(rust).from_str(rust.to_str())
        rust.no_truncation()
        rust.no_padding()
        rust.encode_special_tokens = split
    return rust


class ChunkTokenizer:
    """Texts -> (train ids, val ids, train documents, val documents), EOS after every document.

    A fast tokenizer's texts go straight to its Rust tokenizer (``_rust_tokenizer``) and its ``encode_batch_fast``:
    the ids of ``tokenizer(texts, add_special_tokens=False)``, without the character offsets, attention masks and
    Python dictionaries that call builds and packing never reads. Another tokenizer is called as that. It pickles
    (for the workers of ``tokenized``) as its Rust tokenizer, EOS id and held-out fraction; one of another tokenizer
    does not pickle."""

    def __init__(self, tokenizer, val_fraction: float):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.val_fraction = val_fraction
        self.rust = _rust_tokenizer(tokenizer)

    def __getstate__(self) -> dict:
        if self.rust is None:
            raise TypeError(
                "a ChunkTokenizer of a tokenizer without a Rust tokenizer is not picklable"
            )
        # a Tokenizer's pickle leaves out whether special tokens' text is split
        return {
            "eos": self.eos,
            "val_fraction": self.val_fraction,
            "rust": self.rust,
            "split_special_tokens": self.rust.encode_special_tokens,
        }

    def __setstate__(self, state: dict) -> None:
        self.tokenizer = None
        self.eos, self.val_fraction, self.rust = state["eos"], state["val_fraction"], state["rust"]
        self.rust.encode_special_tokens = state["split_special_tokens"]

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self.rust is None:
            return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)[
                "input_ids"
            ]
        encode = getattr(self.rust, "encode_batch_fast", self.rust.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
        ids = self._ids(texts)
        # C arrays of 32-bit ids: they take a list's ids several times faster than numpy takes a list
        streams = (array(_UINT32), array(_UINT32))
        if self.val_fraction > 0:
            held_out = [is_validation(text, self.val_fraction) for text in texts]
        else:  # no hash can fall below 0
            held_out = [False] * len(texts)
        for val, doc in zip(held_out, ids):
            stream = streams[val]
            stream.extend(doc)
            stream.append(self.eos)
        n_val = sum(held_out)
        return (
            np.frombuffer(streams[0], dtype=np.uint32),
            np.frombuffer(streams[1], dtype=np.uint32),
            len(texts) - n_val,
            n_val,
        )


_worker: ChunkTokenizer | None = None


def _init_worker(tokenize: ChunkTokenizer | None, tokenizer_path: str, val_fraction: float) -> None:
    """The worker's ``ChunkTokenizer``: the main process's, or (a tokenizer without a Rust tokenizer) one of the
    tokenizer loaded from ``tokenizer_path``."""
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    if tokenize is None:
        from mhf_dist.vocab.tokenizers import load_tokenizer

        tokenize = ChunkTokenizer(load_tokenizer(tokenizer_path), val_fraction)
    _worker = tokenize


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
    # workers get the Rust tokenizer itself: no Hugging Face import or tokenizer conversion each
    sent = tokenize if tokenize.rust is not None else None
    with spawn.Pool(workers, _init_worker, (sent, tokenizer_path, tokenize.val_fraction)) as pool:
        pending: deque = deque()
        for chunk, ends_file in chunks:
            pending.append((len(chunk), ends_file, pool.apply_async(_tokenize_in_worker, (chunk,))))
            if len(pending) >= 2 * workers:
                n, ends, result = pending.popleft()
                yield n, ends, result.get()
        while pending:
            n, ends, result = pending.popleft()
            yield n, ends, result.get()
