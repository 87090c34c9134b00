"""``mhf-dist export``: one full state dict from any sharded checkpoint, with what it needs to be used.

Writes ``OUT/model.safetensors`` (the LanguageModel's parameter names, see
:mod:`mhf_dist.hf.layout`), ``OUT/config.yaml`` (the run config), ``OUT/signatures/``,
``OUT/tokenizer/`` and, with Engram memories, ``OUT/engram/`` (the tokenizer
compression, docs/spec.md §8). The weights are the fp32 master weights merged over
every data-, tensor- and pipeline-parallel shard (ZeRO-3 included), cast to
``--dtype``. :func:`trained_weights` is the merge, shared with ``export-hf``
and ``expand-vocab``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from mhf_dist.config import RunConfig
from mhf_dist.output_dir import check_target, staged
from mhf_dist.run_dir import RunDir
from mhf_dist.train.checkpoint_index import MARKER, CheckpointError, complete_checkpoints, verify_files
from mhf_dist.train.host_tables import host_table_weights
from mhf_dist.train.universal import consolidate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest complete checkpoint)."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    found = complete_checkpoints(path / "checkpoints")
    if not found:
        raise CheckpointError(f"{path} is neither a complete checkpoint nor a run directory with one")
    return found[-1]


@dataclass
class TrainedWeights:
    checkpoint: Path
    step: int
    run: RunDir
    cfg: RunConfig
    state: dict[str, torch.Tensor]  # full fp32 LanguageModel state dict


def trained_weights(checkpoint: str | Path) -> TrainedWeights:
    """The full weights of a checkpoint (or a run directory's newest), merged over every shard."""
    ckpt = resolve_checkpoint(checkpoint)
    marker = verify_files(ckpt)  # every file's size and digest, before DeepSpeed's loader reads any
    run = RunDir(ckpt.parent.parent)
    raw = yaml.safe_load(run.config_path.read_text())
    cfg = RunConfig.model_validate(raw | {"model": marker["model"]})  # the shapes the weights were saved with
    state = consolidate(ckpt, pipeline=marker["layout"]["pp"] > 1) | host_table_weights(ckpt)
    if cfg.train.init_from:  # frozen parameters (train.trainable_blocks) are not in the checkpoint
        state = load_file(str(run.path / cfg.train.init_from)) | state
    return TrainedWeights(ckpt, marker["step"], run, cfg, state)


def export(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", overwrite: bool = False) -> Path:
    out = check_target(out, [checkpoint], overwrite)
    trained = trained_weights(checkpoint)
    run, cfg = trained.run, trained.cfg
    with staged(out) as tmp:
        save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in trained.state.items()},
                  str(tmp / "model.safetensors"),
                  metadata={"step": str(trained.step), "source": str(trained.checkpoint)})
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        for source in (run.signatures_dir, run.engram_dir):
            if source.is_dir():
                shutil.copytree(source, tmp / source.name)
        tokenizer = Path(run.tokenizer_source(cfg))
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, tmp / "tokenizer")
    return out
