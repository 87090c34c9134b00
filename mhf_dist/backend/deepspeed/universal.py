"""DeepSpeed universal checkpoints: layout-free copies of a sharded checkpoint, for consolidation (``export``: one full
state dict in the ``LanguageModel``'s naming, ``consolidate``) and for resuming under another layout
(``convert_for_layout``).

``ds_to_universal`` merges every data-, tensor- and pipeline-parallel shard into one fp32 tensor (plus Adam moments)
per parameter, under ``zero/<name>/``. ``universal_info`` tells it how tensor-parallel shards join, for every
parameter as the engine names it (DeepSpeed joins an unlisted one on dim 0 silently), from the table the
tensor-parallel plan shards with (``tp_split_dims``): row-parallel and bucket-table shards on dim 1, column-parallel
ones on dim 0, the rest replicated; the tied bucket tables train on two pipeline stages and are taken once.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mhf_dist.backend.deepspeed.pipeline import canonical_name, pipeline_name
from mhf_dist.config import ModelConfig
from mhf_dist.parallel.state_dict import split_dim
from mhf_dist.parallel.tensor_parallel import tp_split_dims


def universal_info(param_names: list[str], cfg: ModelConfig, tp: int, pipeline: bool) -> dict:
    """Merge patterns for every parameter of the model (``param_names`` in the LanguageModel's naming; each
    stage's file must describe all of them, whichever stage DeepSpeed reads them from)."""
    dims = tp_split_dims(cfg, tp)

    def exact(names) -> list[str]:
        return [re.escape(pipeline_name(n, cfg.n_layers) if pipeline else n) + "$" for n in names]

    return {
        "universal_checkpoint_version": 0.2,
        "tp_replicated_parameter_patterns": exact(
            n for n in param_names if split_dim(n, dims) is None
        ),
        "parameter_with_row_parallelism_patterns": exact(
            n for n in param_names if split_dim(n, dims) == 1
        ),
        # trained on the first and the last stage alike: taken from the first (the decoder's mixers train
        # only on the last stage and the encoder only on the first, so each has one copy)
        "pipeline_replicated_parameter_patterns": exact(["vocab.tables.weight"]),
    }


def conversion_workers() -> tuple[int, int]:
    """(extract, merge) processes for ``ds_to_universal``: one extract worker per core this process may use (up
    to 16; each holds one rank's optimizer shard), half as many merge workers (each holds every tp slice of one
    parameter, the more memory-hungry step)."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    extract = max(1, min(16, cores))
    return extract, max(1, extract // 2)


def to_universal(checkpoint: Path, out: Path) -> Path:
    """Convert a complete checkpoint directory with DeepSpeed's ``ds_to_universal``, in parallel processes."""
    extract, merge = conversion_workers()
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(checkpoint),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        str(extract),
        "--num_merge_workers",
        str(merge),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(
            f"ds_to_universal failed on {checkpoint}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return out


def read_universal(universal: Path, pipeline: bool) -> dict[str, torch.Tensor]:
    """``{name: fp32 tensor}`` in the LanguageModel's naming from a universal checkpoint.

    ZeRO-3's universal files hold flat tensors; their shapes come from the saved ``param_shapes``.
    """
    shapes = zero3_shapes(universal)
    out = {}
    for folder in sorted(p for p in (universal / "zero").iterdir() if p.is_dir()):
        value = torch.load(folder / "fp32.pt", map_location="cpu", weights_only=False)
        # ZeRO-3: flat
        tensor = value["param"] if isinstance(value, dict) else value.reshape(shapes[folder.name])
        out[canonical_name(folder.name) if pipeline else folder.name] = tensor
    return out


def zero3_shapes(universal: Path) -> dict[str, torch.Size]:
    """The parameter shapes ZeRO-3's model-state files record (its universal tensors are flat)."""
    shapes = {}
    for states in universal.glob("*model_states.pt"):
        for group in (
            torch.load(states, map_location="cpu", weights_only=False).get("param_shapes") or []
        ):
            shapes |= group
    return shapes


def consolidate(checkpoint: Path, pipeline: bool) -> dict[str, torch.Tensor]:
    """One full fp32 state dict from any sharded checkpoint (ZeRO-3 included)."""
    with tempfile.TemporaryDirectory() as tmp:
        return read_universal(to_universal(checkpoint, Path(tmp) / "universal"), pipeline)


def convert_for_layout(
    checkpoint: Path,
    out: Path,
    source_pipeline: bool,
    target_pipeline: bool,
    cfg: ModelConfig,
    zero3_tp: int = 1,
) -> Path:
    """A universal copy of ``checkpoint`` whose parameter folders carry the target engine's names; ``zero3_tp``:
    the target's tensor-parallel size when its engine is ZeRO-3 (see ``split_for_zero3``)."""
    to_universal(checkpoint, out)
    if source_pipeline != target_pipeline:
        for folder in [p for p in (out / "zero").iterdir() if p.is_dir()]:
            name = canonical_name(folder.name) if source_pipeline else folder.name
            folder.rename(
                folder.with_name(pipeline_name(name, cfg.n_layers) if target_pipeline else name)
            )
    if zero3_tp > 1:
        split_for_zero3(out, cfg, zero3_tp)
    return out


def split_for_zero3(universal: Path, cfg: ModelConfig, tp: int) -> None:
    """ZeRO-3 loads a universal parameter whole and partitions it over the data-parallel ranks only (DeepSpeed
    slices tensor-parallel shards for its own AutoTP layers, not for ours), so each tensor-parallel rank gets its own
    copy, ``tp-R/``: the parameters the plan splits hold that rank's shard (weights and Adam moments), everything
    else is linked. ``copy_for_rank`` picks it."""
    dims = tp_split_dims(cfg, tp)
    shapes = zero3_shapes(universal)
    copies = [universal / f"tp-{r}" for r in range(tp)]
    split = [
        f
        for f in (universal / "zero").iterdir()
        if f.is_dir() and split_dim(f.name, dims) is not None
    ]
    for copy in copies:
        (copy / "zero").mkdir(parents=True)
        for item in [*universal.iterdir(), *(universal / "zero").iterdir()]:
            if item.is_file() or (
                item.is_dir() and item.parent.name == "zero" and item not in split
            ):
                _link(item, copy / item.relative_to(universal))
    for folder in split:
        dim = split_dim(folder.name, dims)
        for state in folder.glob("*.pt"):
            targets = [copy / "zero" / folder.name / state.name for copy in copies]
            for target in targets:
                target.parent.mkdir(exist_ok=True)
            value = torch.load(state, map_location="cpu", weights_only=False)
            # ZeRO-3 without tp: the tensor alone
            full = value["param"] if isinstance(value, dict) else value
            if full.numel() == 1:  # a step count: the same for every rank
                for target in targets:
                    _link(state, target)
                continue
            if full.dim() == 1 and math.prod(shapes.get(folder.name, ())) == full.numel():
                full = full.reshape(shapes[folder.name])  # ZeRO-3 without tp stores it flat
            for shard, target in zip(full.chunk(tp, dim=dim), targets, strict=True):
                torch.save(
                    value | {"param": shard.clone()} if isinstance(value, dict) else shard.clone(),
                    target,
                )


def _link(item: Path, link: Path) -> None:
    link.symlink_to(os.path.relpath(item, link.parent))


def copy_for_rank(universal: Path, tp_rank: int) -> Path:
    """The universal checkpoint tensor-parallel rank ``tp_rank`` loads: its own copy where
    ``split_for_zero3`` made one, else ``universal``."""
    own = universal / f"tp-{tp_rank}"
    return own if own.is_dir() else universal
