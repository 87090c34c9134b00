"""Run metrics: ``metrics.jsonl`` (one JSON object per logged step) beside TensorBoard scalars, and optionally
Weights & Biases (``train.wandb``).

``metrics.jsonl`` is a contract: fields are added over time, never renamed
(``step``, ``loss``, ``head_losses``, ``lr``, ``tokens_per_s``, ...). Lists are
logged to TensorBoard and W&B one scalar per element (``head_losses/0``, ...).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import secrets
import string
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from mhf_dist.atomic import write_atomic
from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RunDir

if TYPE_CHECKING:
    from mhf_dist.config import RunConfig

log = logging.getLogger(__name__)

WANDB_DIR = "wandb"  # W&B's own files (wandb.init(dir=RUN) writes RUN/wandb/)
WANDB_RUN_ID = "run_id"  # in WANDB_DIR: the W&B run every start of this run directory logs to


class MetricsLogger:
    """Appends to a run's logs; ``resume_step`` drops what was logged after the checkpoint being resumed. With
    ``cfg.train.wandb`` set, the same scalars also go to W&B."""

    def __init__(self, run: RunDir, resume_step: int = 0, cfg: RunConfig | None = None):
        self.wandb = start_wandb(run.path, cfg) if cfg is not None else None  # first: a missing wandb fails early
        self.wandb_from = self.wandb.step if self.wandb is not None else 0
        self.path, self.tensorboard_dir = run.metrics_path, run.tensorboard_dir
        self.writer, self.last_step = None, 0
        self.rewind(resume_step)

    def rewind(self, step: int) -> None:
        """Drop what was logged after ``step`` (a resume's or a rollback's checkpoint); the next record follows it."""
        from torch.utils.tensorboard import SummaryWriter  # here: reading a run's metrics (`status`) needs no torch

        if step and self.path.exists():
            kept = [r for r in _records(self.path) if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if self.writer is not None:
            self.writer.close()
        self.wandb_from = max(self.wandb_from, self.last_step + 1)  # W&B keeps what it was sent
        self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=step + 1 if step else None)

    def log(self, step: int, values: dict) -> None:
        record = {"step": step, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **values}
        self.last_step = max(self.last_step, step)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = dict(_scalars(values))
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        # a resumed W&B run refuses steps below those it holds (logged after the checkpoint resumed from): skip them
        if self.wandb is not None and step >= self.wandb_from:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.writer.close()
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
        raise ConfigError("train.wandb is set but the wandb package is not installed: pip install 'mhf-dist[wandb]' "
                          "(or unset train.wandb)")
    import wandb  # here: slow to import, and only needed when enabled

    run_dir = Path(run_dir).resolve()
    try:
        return wandb.init(project=wb.project, entity=wb.entity, name=wb.name or run_dir.name, mode=wb.mode,
                          id=wandb_run_id(run_dir), resume="allow", dir=str(run_dir),
                          config=cfg.model_dump(mode="json"))
    except wandb.errors.Error as e:
        raise ConfigError(f"train.wandb: W&B could not start the run: {e} (without network: "
                          "--set train.wandb.mode=offline, then `wandb sync`)") from e


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir``: made once (8 characters, as W&B's own), then read back on every start."""
    path = run_dir / WANDB_DIR / WANDB_RUN_ID
    if path.is_file() and (run_id := path.read_text().strip()):
        return run_id
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, run_id + "\n")
    return run_id


def _records(path: Path) -> list[dict]:
    """The records of a metrics file; a line cut short by a crash mid-write is left out with a warning."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if line.strip():
                log.warning("%s line %d is incomplete (a write cut short); leaving it out", path, number)
    return records


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of the run directory's ``metrics.jsonl`` (none before its first logged step)."""
    path = RunDir(run_dir).metrics_path
    return _records(path) if path.exists() else []
