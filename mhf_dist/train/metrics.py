"""Run metrics: ``metrics.jsonl`` (one JSON object per logged step) beside TensorBoard scalars.

``metrics.jsonl`` is a contract: fields are added over time, never renamed
(``step``, ``loss``, ``head_losses``, ``lr``, ``tokens_per_s``, ...). Lists are
logged to TensorBoard one scalar per element (``head_losses/0``, ...).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLogger:
    """Appends to a run's logs; ``resume_step`` drops what was logged after the checkpoint being resumed."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        if resume_step and self.path.exists():
            kept = [r for r in _records(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, values: dict) -> None:
        record = {"step": step, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in values.items():
            if isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    self.writer.add_scalar(f"{key}/{i}", v, step)
            elif isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


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
    path = Path(run_dir) / METRICS_FILE
    return _records(path) if path.exists() else []
