"""``mhf-dist export``: one full state dict from any sharded checkpoint, with what it needs to be used.

Writes ``OUT/model.safetensors`` (the LanguageModel's parameter names, see
``mhf_dist.hf.names``), ``OUT/config.yaml`` (the run config), ``OUT/signatures/``,
``OUT/tokenizer/`` and, with Engram memories, ``OUT/engram/`` (the tokenizer
compression, docs/spec.md §8). The weights are the fp32 master weights merged over
every data-, tensor- and pipeline-parallel shard (ZeRO-3 included), cast to
``--dtype``. The merge is ``mhf_dist.train.trained_weights``,
shared with ``export-hf``, ``expand-vocab``, ``generate`` and ``eval``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from safetensors.torch import save_file

from mhf_dist.model.dtypes import DTYPES
from mhf_dist.storage.output_dir import check_target, staged
from mhf_dist.train.trained_weights import check_source, trained_weights


def export(
    checkpoint: str | Path, out: str | Path, dtype: str = "fp32", overwrite: bool = False
) -> Path:
    check_source(checkpoint)  # first: a path that holds no model is named as such
    out = check_target(out, [checkpoint], overwrite)
    trained = trained_weights(checkpoint)
    run, cfg = trained.run, trained.cfg
    with staged(out) as tmp:
        save_file(
            {k: v.to(DTYPES[dtype]).contiguous() for k, v in trained.state.items()},
            str(tmp / "model.safetensors"),
            metadata={"step": str(trained.step), "source": str(trained.checkpoint)},
        )
        sort_metadata(tmp / "model.safetensors")
        (tmp / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        for source in (run.signatures_dir, run.engram_dir):
            if source.is_dir():
                shutil.copytree(source, tmp / source.name)
        tokenizer = Path(run.tokenizer_source(cfg))
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, tmp / "tokenizer")
    return out


def sort_metadata(path: Path) -> None:
    """A safetensors file's metadata in sorted order, rewritten in place: safetensors writes it in a hash map's order,
    which changes from process to process, and one checkpoint should always export to the same bytes."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if (
            len(text) <= size
        ):  # the same content in the same compact form: the same length, padded as before
            f.seek(8)
            f.write(text.ljust(size))
