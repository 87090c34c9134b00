"""A model's full weights from what training leaves: a checkpoint of any layout, or a run directory (its newest
complete checkpoint, downloaded first when the run keeps its checkpoints in object storage, or, before the first, its
initial weights). What ``export``, ``export-hf``, ``expand-vocab``, ``generate`` and ``eval`` read a model from."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from mhf_dist.backend import consolidate
from mhf_dist.config import RunConfig
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import (
    MARKER,
    CheckpointError,
    read_marker,
    verify_files,
)
from mhf_dist.train.checkpoint.store import CheckpointStore, run_store
from mhf_dist.train.host_tables import host_table_weights

MODEL_SOURCES = (
    "a run directory (the --run-dir of train or import-hf) or a checkpoint (RUN/checkpoints/step-N)"
)


def holds_weights(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory or a run directory."""
    return (path / MARKER).is_file() or RunDir(path).config_path.is_file()


def check_source(path: str | Path, accepted: str = MODEL_SOURCES) -> Path:
    """``path`` when it is a checkpoint or a run directory, else an error saying what is ``accepted``. Commands check
    this first, so a path that holds no model is named as such rather than as a problem of their output."""
    path = Path(path)
    if not holds_weights(path):
        what = (
            f"holds no model (no {MARKER}, no config.yaml)" if path.exists() else "does not exist"
        )
        raise CheckpointError(f"{path} {what}: pass {accepted}")
    return path


def resolve_weights(path: str | Path) -> tuple[Path, RunDir, CheckpointStore]:
    """(where the weights of ``path`` (``check_source``) are, the run they belong to, where that run keeps its
    checkpoints). The weights: a checkpoint
    directory (``path`` itself, or a run directory's newest complete checkpoint: ``fetched_newest``), or, for a run
    without a checkpoint yet, the file of its initial weights (``train.init_from``: a fresh ``import-hf`` or
    ``expand-vocab`` run, whose initial weights are the model). The run: ``path`` itself, or the RUN of a checkpoint
    ``RUN/checkpoints/step-N``."""
    path = check_source(path)
    if (path / MARKER).is_file():
        run = RunDir(path.parent.parent)
        return path, run, run_store(run)
    run = RunDir(path)
    store = run_store(run)
    newest = fetched_newest(store)
    if newest is not None:
        return newest, run, store
    init_from = (yaml.safe_load(run.config_path.read_text()).get("train") or {}).get("init_from")
    if init_from is None or not (path / init_from).is_file():
        raise CheckpointError(
            f"{path} has no complete checkpoint yet, nor initial weights (train.init_from): train "
            "it until it saves one (at the end, or every train.checkpoint_interval steps)"
        )
    return path / init_from, run, store


def fetched_newest(store: CheckpointStore) -> Path | None:
    """The store's newest complete checkpoint (None: none yet); from a remote store, downloaded into the staging
    directory (created when missing; files already there as saved are kept), as a resume does with one rank. Storage
    that cannot be used raises ``CheckpointError`` naming why."""
    if store.url is None:
        return store.newest()
    store.check()
    newest = store.newest()
    if newest is not None:
        print(f"fetching {store.where(newest)} into {newest}", file=sys.stderr)
        store.fetch(newest, read_marker(newest))
    return newest


@dataclass
class TrainedWeights:
    checkpoint: Path  # the checkpoint directory, or the file of a run's initial weights
    step: int
    run: RunDir
    cfg: RunConfig
    state: dict[str, torch.Tensor]  # full fp32 LanguageModel state dict


def trained_weights(checkpoint: str | Path) -> TrainedWeights:
    """The full weights of a checkpoint (or a run directory's newest), merged over every shard; a run without a
    checkpoint yet gives its initial weights, at step 0 (``resolve_weights``)."""
    ckpt, run, store = resolve_weights(checkpoint)
    if ckpt.is_file():
        return initial_weights(run, ckpt)
    shown = store.where(ckpt) if store.url is not None and ckpt.parent == store.local else None
    # every file's size and digest, before DeepSpeed's loader reads any
    marker = verify_files(ckpt, shown)
    raw = yaml.safe_load(run.config_path.read_text())
    # the shapes the weights were saved with
    cfg = RunConfig.model_validate(raw | {"model": marker["model"]})
    state = consolidate(ckpt, pipeline=marker["layout"]["pp"] > 1) | host_table_weights(ckpt)
    if cfg.train.init_from:  # frozen parameters (train.trainable_blocks) are not in the checkpoint
        state = load_file(str(run.path / cfg.train.init_from)) | state
    return TrainedWeights(ckpt, marker["step"], run, cfg, state)


def initial_weights(run: RunDir, weights: Path) -> TrainedWeights:
    """A run's initial weights (``train.init_from``) as its model, at step 0; said on stderr, as it is not a
    trained checkpoint."""
    print(
        f"note: {run.path} has no checkpoint yet; its initial weights {weights} (train.init_from) are the model",
        file=sys.stderr,
    )
    cfg = RunConfig.model_validate(yaml.safe_load(run.config_path.read_text()))
    return TrainedWeights(weights, 0, run, cfg, load_file(str(weights)))
