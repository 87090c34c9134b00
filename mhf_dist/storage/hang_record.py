"""What the hang watchdog ended a job on, ``RUN/hangs/<time>/hang.json``: the step and phase that made no progress,
for how long, under which budget and setting, and whether that budget was already a retry's. The next start reads
the newest one, so a phase that was ended does not end the same way again (``mhf_dist.train.watchdog``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.storage.run_dir import RunDir

HANG_RECORD = "hang.json"


@dataclass(frozen=True)
class HangRecord:
    step: int
    phase: str  # as in the heartbeats: step, eval, save, rollback, end
    stuck_s: float  # seconds without progress when the job was ended
    budget_s: float  # what that phase was allowed
    # the setting that gave the budget: train.hang_timeout_s or train.first_step_timeout_s
    setting: str
    retried: bool  # the budget was already twice that of an earlier start ended at the same place

    @property
    def retry_budget_s(self) -> float:
        """What the next start allows the same step and phase: twice what this one had."""
        return 2 * self.budget_s

    def at(self, step: int, phase: str) -> bool:
        return (self.step, self.phase) == (step, phase)

    def write(self, folder: Path) -> None:
        write_atomic(folder / HANG_RECORD, json.dumps(asdict(self)))


def read_hang_record(folder: Path) -> HangRecord | None:
    """The record in one hang's folder, or None (none written, or not one of ours)."""
    try:
        return HangRecord(**json.loads((folder / HANG_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def newest_hang_record(run: RunDir) -> HangRecord | None:
    """The record of the run's newest hang (the folders are named by time), or None."""
    folders = (
        sorted(p for p in run.hangs_dir.glob("*") if p.is_dir()) if run.hangs_dir.is_dir() else []
    )
    return read_hang_record(folders[-1]) if folders else None
