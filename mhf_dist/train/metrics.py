"""Run metrics: ``metrics.jsonl`` (one JSON object per logged step) beside TensorBoard scalars, and optionally
Weights & Biases (``train.wandb``).

``metrics.jsonl`` is a contract: fields are added over time, never renamed
(``step``, ``loss``, ``head_losses``, ``lr``, ``tokens_per_s``, ...). Lists are
logged to TensorBoard and W&B one scalar per element (``head_losses/0``, ...).
It holds complete lines only: a record is appended whole or not at all, and a last line cut short by a crash is
dropped at the next start, so that no record is ever glued to it.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import os
import secrets
import string
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.atomic import write_atomic
from mhf_dist.config import ConfigError
from mhf_dist.errors import MhfError
from mhf_dist.storage.run_dir import RunDir

if TYPE_CHECKING:
    from mhf_dist.config import RunConfig

log = logging.getLogger(__name__)

WANDB_DIR = "wandb"  # W&B's own files (wandb.init(dir=RUN) writes RUN/wandb/)
WANDB_RUN_ID = "run_id"  # in WANDB_DIR: the W&B run every start of this run directory logs to
FIXES = {
    errno.ENOSPC: "free space on its filesystem",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EROFS: "make it writable",
    errno.EACCES: "make it writable",
}


class MetricsWriteError(MhfError, OSError):
    """``metrics.jsonl`` could not be written; the message names the file, the cause and the fix."""


class MetricsLogger:
    """Appends to a run's logs; ``resume_step`` drops what was logged after the checkpoint being resumed. With
    ``cfg.train.wandb`` set, the same scalars also go to W&B."""

    def __init__(self, run: RunDir, resume_step: int = 0, cfg: RunConfig | None = None):
        # first: a missing wandb fails early
        self.wandb = start_wandb(run.path, cfg) if cfg is not None else None
        self.wandb_from = self.wandb.step if self.wandb is not None else 0
        self.path, self.tensorboard_dir = run.metrics_path, run.tensorboard_dir
        self.writer, self.last_step = None, 0
        self.rewind(resume_step)

    def rewind(self, step: int) -> None:
        """Drop what was logged after ``step`` (a resume's or a rollback's checkpoint); the next record follows it."""
        from torch.utils.tensorboard import (
            SummaryWriter,
        )  # here: reading a run's metrics (`status`) needs no torch

        if self.path.exists():
            self._written(
                f"could not drop the cut last line of {self.path}",
                lambda: _drop_cut_line(self.path),
            )
        if step and self.path.exists():
            kept = "".join(json.dumps(r) + "\n" for r in _records(self.path) if r["step"] <= step)
            # whole or not at all: a full disk leaves the file as it was
            self._written(
                f"could not rewrite {self.path}",
                lambda: write_atomic(self.path, kept, durable=False),
            )
        if self.writer is not None:
            self.writer.close()
        self.wandb_from = max(self.wandb_from, self.last_step + 1)  # W&B keeps what it was sent
        self.writer = SummaryWriter(
            str(self.tensorboard_dir), purge_step=step + 1 if step else None
        )

    def log(self, step: int, values: dict) -> None:
        record = {
            "step": step,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **values,
        }
        self.last_step = max(self.last_step, step)
        line = (json.dumps(record) + "\n").encode()
        self._written(
            f"could not log step {step} to {self.path}", lambda: _append_whole(self.path, line)
        )
        scalars = dict(_scalars(values))
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        # a resumed W&B run refuses steps below those it holds (logged after the checkpoint resumed from): skip them
        if self.wandb is not None and step >= self.wandb_from:
            self.wandb.log(scalars, step=step)

    @staticmethod
    def _written(doing: str, write) -> None:
        """``write()``, its OSError raised as ``MetricsWriteError`` naming the file, the cause and the fix."""
        try:
            write()
        except OSError as e:
            fix = FIXES.get(e.errno, "see the cause")
            raise MetricsWriteError(
                f"{doing} ({e.strerror or e}): {fix}, then rerun to resume (--resume auto); "
                "the file keeps its complete records"
            ) from e

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as e:  # a full disk: not to hide the error that ends the run, or its outcome
            log.warning(
                "TensorBoard could not write its events to %s (%s)", self.tensorboard_dir, e
            )
        if self.wandb is not None:
            try:  # a run that ends on an exception is marked failed; W&B trouble never hides the training outcome
                self.wandb.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)
            except Exception as e:
                log.warning("W&B did not finish cleanly: %s", e)


def _scalars(values: dict):
    """(name, value) of each scalar: list elements as ``key/i``, dict entries as ``key/name``, finite numbers as they
    are."""
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield f"{key}/{i}", v
        elif isinstance(value, dict):
            yield from _scalars({f"{key}/{k}": v for k, v in value.items()})
        elif isinstance(value, (int, float)) and math.isfinite(value):
            yield key, value


def start_wandb(run_dir: str | Path, cfg: RunConfig):
    """The W&B run of ``run_dir`` (created, or resumed under the id kept in ``RUN/wandb/run_id``); None when
    ``train.wandb`` is unset or its mode is ``disabled``."""
    wb = cfg.train.wandb
    if wb is None or wb.mode == "disabled":
        return None
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "train.wandb is set but the wandb package is not installed: pip install 'mhf-dist[wandb]' "
            "(or unset train.wandb)"
        )
    import wandb  # here: slow to import, and only needed when enabled

    run_dir = Path(run_dir).resolve()
    try:
        return wandb.init(
            project=wb.project,
            entity=wb.entity,
            name=wb.name or run_dir.name,
            mode=wb.mode,
            id=wandb_run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            config=cfg.model_dump(mode="json"),
        )
    except wandb.errors.Error as e:
        raise ConfigError(
            f"train.wandb: W&B could not start the run: {e} (without network: "
            "--set train.wandb.mode=offline, then `wandb sync`)"
        ) from e


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir``: made once (8 characters, as W&B's own), then read back on every start."""
    path = run_dir / WANDB_DIR / WANDB_RUN_ID
    if path.is_file() and (run_id := path.read_text().strip()):
        return run_id
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, run_id + "\n")
    return run_id


def _append_whole(path: Path, line: bytes) -> None:
    """``line`` at the end of ``path``, whole or not at all: a write cut short (a full disk) is taken back."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):  # a filling disk may take part of it, then refuse the rest
                written += os.write(fd, line[written:])
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def _drop_cut_line(path: Path) -> None:
    """A last line without its newline (a write a crash cut short) is dropped with a warning."""
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            if (at := f.read(end - start).rfind(b"\n")) >= 0:
                end = start + at + 1
                break
            end = start
        if end == size:
            return
        f.truncate(end)
    log.warning(
        "%s ended in a line cut short (%d bytes: a write that never finished); dropped it",
        path,
        size - end,
    )


def _records(path: Path) -> list[dict]:
    """The records of a metrics file; a line cut short by a crash mid-write is left out with a warning."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if line.strip():
                log.warning(
                    "%s line %d is incomplete (a write cut short); leaving it out", path, number
                )
    return records


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of the run directory's ``metrics.jsonl`` (none before its first logged step)."""
    path = RunDir(run_dir).metrics_path
    return _records(path) if path.exists() else []
