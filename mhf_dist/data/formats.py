"""The format of prepared data, shared by its writer (:mod:`mhf_dist.data.prepare`) and its reader
(:mod:`mhf_dist.data.reader`): WebDataset tar shards of packed token ids and their ``manifest.json``; and
:class:`DataError`. How the shards are packed, and why: docs/design.md, "Data preparation".

Shards
    ``{prefix}-000000.tar, ...`` (train) and ``val-000000.tar, ...`` (validation),
    numbered on across the input files; every shard holds ``samples_per_shard``
    samples except the last of each file. A sample is
    one tar member ``{key}.tokens.npy``: a 1-D ``.npy`` array of ``seq_len + 1``
    little-endian ids, ``<u2`` when the vocabulary has at most 65,536 entries,
    else ``<u4``. ``key`` is the sample's index within its split, 10 digits.
    Members have mtime 0 and fixed owner and mode.

``manifest.json`` (written last: a directory without one is incomplete)::

    {"format": "mhf-dist-packed-tokens-v1", "seq_len": L, "sample_tokens": L + 1,
     "dtype": "uint16" | "uint32", "vocab_size": V, "eos_id": E,
     "tokenizer_fingerprint": tokens_fingerprint(vocabulary(tokenizer)),
     "sample_member": "tokens.npy", "samples_per_shard": n, "val_fraction": f,
     "text_field": "text", "inputs": [input files], "skipped_documents": n,
     "splits": {"train": SPLIT, "val": SPLIT (only when val_fraction > 0)},
     "part": {...} (a part only), "parts": ["part-1-of-N", ...] (a merge only)}
    SPLIT = {"documents": d, "input_tokens": t (EOS included), "samples": s,
             "tokens": s * (L + 1), "dropped_tokens": t - s * (L + 1),
             "shards": [{"name": "train-000000.tar", "samples": k, "bytes": b,
                         "sha256": hex}, ...]}
"""

from __future__ import annotations

from collections.abc import Sequence

from mhf_dist.errors import MhfError

FORMAT = "mhf-dist-packed-tokens-v1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SAMPLE_MEMBER = "tokens.npy"
SHARD_SUFFIX = ".tar"
TRAIN_SPLIT = "train"
VAL_SPLIT = "val"  # also the prefix of its shards' names


class DataError(MhfError, ValueError):
    """Input text, shards or a manifest are unusable; the message names the file, the problem and the fix."""


def check_samples(splits: dict, files: Sequence, seq_len: int) -> None:
    """Every split holds at least one sample."""
    for name, split in splits.items():
        if split["samples"] == 0:
            raise DataError(
                f"the {name} split of {', '.join(map(str, files))} has {split['input_tokens']} tokens, fewer than one "
                f"sample of seq_len + 1 = {seq_len + 1}: add text, lower --seq-len"
                + (" or raise --val-fraction" if name == VAL_SPLIT else "")
            )
