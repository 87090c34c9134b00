"""``prepare-data``'s library: text files -> WebDataset tar shards of packed token ids, plus ``manifest.json``
(``prepare``). The inputs and their documents are ``inputs.py``, their tokenization ``tokenizing.py``, the
shards ``shards.py``, the format ``formats.py``, a part of the inputs and the merge of parts ``parts.py``. How and
why: docs/design-training.md, "Data preparation"."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from mhf_dist.data.formats import (
    FORMAT,
    MANIFEST,
    SAMPLE_MEMBER,
    TOKENIZER_DIR,
    TRAIN_SPLIT,
    VAL_SPLIT,
    DataError,
    check_samples,
)
from mhf_dist.data.inputs import BadDocuments, expand_inputs
from mhf_dist.data.parts import inputs_digest, part_files
from mhf_dist.data.shards import SplitWriter
from mhf_dist.data.tokenizing import ChunkTokenizer, file_chunks, tokenized
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary
from mhf_dist.vocab.tokenizers import load_tokenizer


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seq_len: int,
    samples_per_shard: int = 8192,
    prefix: str = "train",
    text_field: str = "text",
    val_fraction: float = 0.0,
    workers: int = 1,
    progress: bool = True,
    on_bad_document: str = "error",
    part: tuple[int, int] | None = None,
) -> dict:
    """Tokenize ``inputs`` and write packed shards and ``manifest.json`` into ``out_dir``; returns the manifest.

    ``tokenizer`` is a tokenizer directory (or ``mistral-v0.3``, see
    ``mhf_dist.vocab.tokenizers.load_tokenizer``). ``out_dir`` must be new or empty. ``part=(I, N)``
    prepares only part I of N of the inputs (``parts.py``).
    """
    if seq_len < 1 or samples_per_shard < 1 or workers < 1:
        raise DataError(
            f"seq_len={seq_len}, samples_per_shard={samples_per_shard} and workers={workers} must be >= 1"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    if prefix == VAL_SPLIT or not prefix or "/" in prefix:
        raise DataError(
            f"prefix {prefix!r}: pick a plain name other than {VAL_SPLIT!r} (used by the validation shards)"
        )
    all_files = expand_inputs(inputs)
    files = part_files(all_files, *part) if part else all_files
    bad = BadDocuments(on_bad_document)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise DataError(f"output directory {out} is not empty; remove it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)

    tok = load_tokenizer(tokenizer)
    if tok.eos_token_id is None:
        raise DataError(
            f"tokenizer {tokenizer} has no EOS token; documents are separated by EOS, use one that has it"
        )
    vocab_size = len(tok)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
    writers = [SplitWriter(out, prefix, seq_len + 1, dtype, samples_per_shard)]
    if val_fraction > 0:
        writers.append(SplitWriter(out, VAL_SPLIT, seq_len + 1, dtype, samples_per_shard))

    chunks = file_chunks(files, text_field, bad)
    results = tokenized(chunks, ChunkTokenizer(tok, val_fraction), str(tokenizer), workers)
    kept = 0  # documents tokenized
    with tqdm(desc="tokenizing", unit="doc", disable=not progress) as bar:
        for n_docs, ends_file, (train_ids, val_ids, n_train, n_val) in results:
            kept += n_docs
            writers[0].add(train_ids, n_train)
            if val_fraction > 0:
                writers[1].add(val_ids, n_val)
            if ends_file:
                for writer in writers:
                    writer.end_file()
            bar.update(n_docs)
            bar.set_postfix(samples=sum(w.samples for w in writers), refresh=False)
    splits = dict(zip((TRAIN_SPLIT, VAL_SPLIT), (w.finish() for w in writers)))
    if part is None:  # a part's split may be empty: the merge checks the whole
        bad.check_kept(kept)
        check_samples(splits, files, seq_len)

    # shards carry their tokenizer: a run on them needs no other
    tok.save_pretrained(str(out / TOKENIZER_DIR))
    manifest = {
        "format": FORMAT,
        "tokenizer": TOKENIZER_DIR,
        "seq_len": seq_len,
        "sample_tokens": seq_len + 1,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": tok.eos_token_id,
        "tokenizer_fingerprint": tokens_fingerprint(vocabulary(tok)),
        "sample_member": SAMPLE_MEMBER,
        "samples_per_shard": samples_per_shard,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "inputs": [str(f) for f in files],
        "skipped_documents": bad.skipped,
        "splits": splits,
    }
    if part:
        manifest["part"] = {
            "index": part[0],
            "count": part[1],
            "inputs_sha256": inputs_digest(all_files),
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
