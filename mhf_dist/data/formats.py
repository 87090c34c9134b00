"""The format of prepared data, shared by its writer (``mhf_dist.data.prepare``) and its reader
(``mhf_dist.data.reader``): WebDataset tar shards of packed token ids and their ``manifest.json``; and
``DataError``.

Here: the format's names (``FORMAT``, ``MANIFEST``, ``SAMPLE_MEMBER``, the split names) and the check that every
split holds a sample (``check_samples``). The shards' members and every key of ``manifest.json``: docs/data.md,
"The shard format"; how the shards are packed, and why: docs/design-training.md, "Data preparation".
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
