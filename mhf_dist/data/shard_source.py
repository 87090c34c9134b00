"""A shard source resolved for ``ShardReader``: its manifest, where that came from, and
the split's shards with their URLs (a local directory, the URL of a directory of object storage, or shard URLs with a
manifest); the checks of the manifest against the run's ``seq_len`` and tokenizer; and the manifest's digest, by
which the reader sees data prepared again under a run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import webdataset as wds

from mhf_dist.data.formats import FORMAT, MANIFEST, SHARD_SUFFIX, DataError
from mhf_dist.data.locations import is_url, read_json, refuse_pipe


@dataclass(frozen=True)
class Shard:
    index: int  # position in the manifest's split: seeds its in-shard shuffle
    name: str
    url: str
    samples: int
    sha256: str


def manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def resolve(source, manifest, split: str, allow_pipe: bool) -> tuple[dict, str, list[Shard]]:
    """The manifest, where it came from, and the split's shards with their URLs (manifest order)."""
    local_dir = (
        isinstance(source, (str, os.PathLike)) and not is_url(source) and Path(source).is_dir()
    )
    # a URL that is neither a shard nor a pattern names a directory of object storage, its manifest inside
    remote_dir = (
        is_url(source)
        and manifest is None
        and not source.endswith(SHARD_SUFFIX)
        and "{" not in source
        and "::" not in source
    )
    if local_dir:
        source = Path(source).resolve()
        location = str(manifest or source / MANIFEST)
    elif remote_dir:
        source = source.rstrip("/")
        location = f"{source}/{MANIFEST}"
    elif manifest is None:
        raise DataError(
            f"shard URLs {source!r} need the manifest: pass manifest= (a path or URL of manifest.json)"
        )
    else:
        location = str(manifest)
    refuse_pipe(location, allow_pipe)
    meta = read_json(location)
    if meta.get("format") != FORMAT:
        raise DataError(
            f"{location} is not a {FORMAT} manifest (format {meta.get('format')!r}); "
            "prepare the shards with mhf-dist prepare-data"
        )
    if split not in meta["splits"]:
        raise DataError(
            f"{location} has no {split!r} split (it has {sorted(meta['splits'])}); "
            "choose one of those, or prepare with --val-fraction for a validation split"
        )
    entries = meta["splits"][split]["shards"]
    if local_dir:
        urls = {k: str(source / e["name"]) for k, e in enumerate(entries)}
    elif remote_dir:
        urls = {k: f"{source}/{e['name']}" for k, e in enumerate(entries)}
    else:
        urls = {}
        for url in wds.shardlists.expand_urls(source) if isinstance(source, str) else list(source):
            matches = [k for k, e in enumerate(entries) if e["name"] in url]
            if len(matches) != 1 or matches[0] in urls:
                raise DataError(
                    f"shard URL {url!r} names {'no' if not matches else 'an ambiguous or repeated'} "
                    f"{split} shard of {location}; give each shard of the manifest at most once"
                )
            refuse_pipe(url, allow_pipe)
            urls[matches[0]] = url
    shards = [
        Shard(k, entries[k]["name"], urls[k], entries[k]["samples"], entries[k]["sha256"])
        for k in sorted(urls)
    ]
    if not shards:
        raise DataError(f"no {split} shards to read from {source!r} ({location})")
    return meta, location, shards


def check_expectations(
    meta: dict, location: str, seq_len: int | None, fingerprint: str | None
) -> None:
    if seq_len is not None and meta["seq_len"] != seq_len:
        raise DataError(
            f"{location} holds samples for seq_len={meta['seq_len']} but the run uses seq_len={seq_len}: "
            f"prepare the data again with --seq-len {seq_len} or set data.seq_len={meta['seq_len']}"
        )
    if fingerprint is not None and meta["tokenizer_fingerprint"] != fingerprint:
        raise DataError(
            f"{location} was tokenized by another tokenizer (fingerprint "
            f"{meta['tokenizer_fingerprint'][:12]}..., the run's is {fingerprint[:12]}...): prepare the "
            "data with the run's tokenizer, or set tokenizer.path to the one the data was prepared with"
        )
