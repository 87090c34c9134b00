"""Checkpoints: atomic, sharded saves and exact resume (preemption and crash safe).

A checkpoint is ``RUN/checkpoints/step-XXXXXXXX/``: DeepSpeed's sharded model and
optimizer files (its ``save_checkpoint``, which also keeps the LR scheduler),
with our client state inside — step, tokens seen, the data reader's position
(identical on every rank: the global order does not depend on the rank count),
run config, signature-table content hash, code version, layout — plus one
``rng-rank*.pt`` per rank (python, numpy, torch and CUDA generators).

Atomicity: the directory counts only once ``complete.json`` exists in it. Rank 0
writes that marker after every rank finished writing and the files are fsynced;
it lists every file with its size, so a missing or truncated shard is found
before DeepSpeed reads it. ``RUN/checkpoints/latest`` is then replaced
atomically. A directory without the marker (a rank killed mid-save) is ignored
by ``--resume auto`` with a warning, so the previous checkpoint stays the one
resumed. The newest ``train.keep_checkpoints`` complete checkpoints are kept.

Resuming under another layout (dp, tp or pp changed) goes through DeepSpeed's
universal checkpoint (:mod:`mhf_dist.train.universal`): every combination of
dp, tp and pp (pp = 1 ↔ pp > 1 included) converts; the data position carries
over because the reader's order does not depend on the rank count. The RNG
states are not restored then (they belong to the old ranks).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mhf_dist import __version__
from mhf_dist.config import RunConfig
from mhf_dist.train.universal import convert_for_layout, universal_info

log = logging.getLogger(__name__)

MARKER = "complete.json"
LATEST = "latest"
PREEMPTED_EXIT_CODE = 85  # "saved and stopped on a signal; requeue me" (cluster scripts test for it)
SAVE_PAUSE_ENV = "MHF_DIST_TEST_SAVE_PAUSE"  # seconds to stall mid-save (crash-safety tests)


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, or belongs to another model / signature table."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _set_adam_steps(engine, step: int) -> None:
    """AdamW's bias-correction step count, which DeepSpeed's universal loading leaves unset for ZeRO-3 sources;
    every parameter took every optimizer step, so it is the global step."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if "step" in state:
            state["step"] = torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else step


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are reported and skipped."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob("step-*")):
        if (path / MARKER).is_file():
            found.append(path)
        else:
            log.warning("ignoring incomplete checkpoint %s (no %s: the save was interrupted)", path, MARKER)
    return found


class Checkpointer:
    def __init__(self, run_path: Path, cfg: RunConfig, signatures_hash: str | None, layout: dict,
                 param_names: list[str]):
        self.dir = run_path / "checkpoints"
        self.cfg, self.signatures_hash, self.layout = cfg, signatures_hash, layout
        self.universal = universal_info(param_names, cfg.model, layout["tp"], layout["pp"] > 1)
        self.rank = dist.get_rank()

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.dir)
        return found[-1] if found else None

    # ------------------------------------------------------------------ save
    def save(self, engine, step: int, tokens: int, reader_state: dict, reason: str) -> Path:
        tag = f"step-{step:08d}"
        path = self.dir / tag
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # leftovers of an interrupted save of this step
            self.dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        client = {
            "step": step, "tokens": tokens, "reader": reader_state, "config": self.cfg.model_dump(mode="json"),
            "signatures_hash": self.signatures_hash, "code_version": __version__, "layout": self.layout,
            "universal_checkpoint_info": self.universal,
        }
        engine.save_checkpoint(str(self.dir), tag=tag, client_state=client, save_latest=False)
        torch.save(rng_state(), path / f"rng-rank{self.rank:05d}.pt")
        if os.environ.get(SAVE_PAUSE_ENV):
            time.sleep(float(os.environ[SAVE_PAUSE_ENV]))
        dist.barrier()
        if self.rank == 0:
            files = {}
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                _fsync(f)
                files[str(f.relative_to(path))] = f.stat().st_size
            marker = {"step": step, "tokens": tokens, "reason": reason, "files": files, "model": client["config"]["model"],
                      "signatures_hash": self.signatures_hash, "layout": self.layout, "code_version": __version__}
            _write_atomic(path / MARKER, json.dumps(marker, indent=1))
            _write_atomic(self.dir / LATEST, tag)
            for old in complete_checkpoints(self.dir)[: -self.cfg.train.keep_checkpoints]:
                shutil.rmtree(old)
        dist.barrier()
        return path

    # ------------------------------------------------------------------ load
    def verify(self, path: Path) -> dict:
        """The checkpoint's marker, after checking it is complete and belongs to this model and vocabulary."""
        marker_path = path / MARKER
        if not marker_path.is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER}); resume from another one")
        marker = json.loads(marker_path.read_text())
        for name, size in marker["files"].items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path} is missing {name}; copy it back or resume from an older one")
            if f.stat().st_size != size:
                raise CheckpointError(f"checkpoint {path}: {name} has {f.stat().st_size} bytes, {size} were written "
                                      "(truncated or corrupt); resume from an older checkpoint")
        if marker["signatures_hash"] != self.signatures_hash:
            raise CheckpointError(
                f"checkpoint {path} was trained with signature table {str(marker['signatures_hash'])[:12]}, this run "
                f"has {str(self.signatures_hash)[:12]}: use the run's own signatures/ (or expand-vocab to extend it)")
        ours = self.cfg.model.model_dump(mode="json")
        differ = sorted(k for k in set(ours) | set(marker["model"]) if ours.get(k) != marker["model"].get(k))
        if differ:
            details = "; ".join(f"model.{k}: checkpoint {marker['model'].get(k)!r}, config {ours.get(k)!r}"
                                for k in differ)
            raise CheckpointError(f"checkpoint {path} is of another model ({details}); resume with its config")
        return marker

    def for_this_layout(self, path: Path) -> tuple[Path, bool]:
        """(checkpoint to load, whether it is universal): a checkpoint of another tp/pp/dp layout is converted
        once by rank 0 into ``checkpoints/universal/<tag>`` (DeepSpeed's universal format), then loaded from there."""
        marker = self.verify(path)
        if marker["layout"] == self.layout:
            return path, False
        target = self.dir / "universal" / path.name
        if self.rank == 0 and not (target / MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)
            convert_for_layout(path, target, marker["layout"]["pp"] > 1, self.layout["pp"] > 1,
                               self.cfg.model.n_layers)
            _write_atomic(target / MARKER, json.dumps(marker | {"universal": True, "source": str(path)}, indent=1))
        dist.barrier()
        return target, True

    def load(self, engine, path: Path) -> dict:
        """Load model, optimizer, scheduler and (same layout only) this rank's RNG state; returns the client state."""
        marker = json.loads((path / MARKER).read_text())
        if not marker.get("universal"):
            self.verify(path)
        _, client = engine.load_checkpoint(str(path.parent), tag=path.name, load_module_strict=True)
        if client is None:
            raise CheckpointError(f"DeepSpeed could not load {path}; see the log above")
        if marker.get("universal"):
            _set_adam_steps(engine, client["step"])
        rng = path / f"rng-rank{self.rank:05d}.pt"
        if marker["layout"] == self.layout and rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        return client
