"""The ``prepare-data`` command that prepares a dataset again for another tokenizer, with the inputs and settings its
manifest records: the fix a run is told when its data was tokenized by another tokenizer than its own (a resume on
data of another tokenizer, the run directory ``expand-vocab`` writes)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from mhf_dist.data.formats import MANIFEST, TRAIN_SPLIT, DataError
from mhf_dist.data.inputs import expand_inputs
from mhf_dist.data.locations import is_url, read_json

LISTED_INPUTS = 8  # more input files are named by their directory, when it holds exactly them


def prepared_again(shard_dir: str, suffix: str) -> str:
    """Where to prepare ``shard_dir``'s data again: a sibling named with ``suffix`` (for a URL, a local directory)."""
    name = shard_dir.rstrip("/")
    return f"{Path(name).name if is_url(name) else name}-{suffix}"


def prepare_command(shard_dir: str, tokenizer: str | os.PathLike, out: str) -> str:
    """``mhf-dist prepare-data`` of the inputs ``shard_dir``'s manifest lists, with its settings, for ``tokenizer``
    into ``out``; what the manifest does not say (an unreadable one) is left as a placeholder in capitals."""
    try:
        meta = read_json(f"{shard_dir.rstrip('/')}/{MANIFEST}")
    except DataError:
        meta = {}
    args = [
        "mhf-dist",
        "prepare-data",
        *_inputs(meta.get("inputs")),
        "--tokenizer",
        str(tokenizer),
        "--out",
        out,
        "--seq-len",
        str(meta.get("seq_len", "SEQ_LEN")),
    ]
    if "samples_per_shard" in meta:
        args += ["--samples-per-shard", str(meta["samples_per_shard"])]
    shards = meta.get("splits", {}).get(TRAIN_SPLIT, {}).get("shards", [])
    if shards and (prefix := shards[0]["name"].rsplit("-", 1)[0]) != TRAIN_SPLIT:
        args += ["--prefix", prefix]
    if meta.get("text_field", "text") != "text":
        args += ["--text-field", meta["text_field"]]
    if meta.get("skipped_documents"):
        args += ["--on-bad-document", "skip"]
    if meta.get("val_fraction"):
        args += ["--val-fraction", str(meta["val_fraction"])]
    return shlex.join(args)


def _inputs(inputs: list[str] | None) -> list[str]:
    if not inputs:
        return ["INPUTS"]
    if len(inputs) > LISTED_INPUTS:
        try:
            common = os.path.commonpath(inputs)
            if [str(f) for f in expand_inputs([common])] == inputs:
                return [common]
        except (DataError, ValueError):  # not one directory's files: every one is named
            pass
    return list(inputs)
