"""The run's rollbacks (``train.on_spike=rollback``), recorded in ``RUN/rollbacks.json``.

Once ``train.spike_patience`` spikes fell within the last 50 steps, the run goes back to the newest checkpoint saved
before the first of them and skips the data it read since that checkpoint: the reader goes on where it stands, and
the range of global positions from the checkpoint's position to there is recorded, so that a later resume (from that
checkpoint, or under another layout) never reads it either (:mod:`mhf_dist.data.skipped`). The record is a list, one
entry per rollback, in order::

    {"step": 9, "spikes": [7, 9], "checkpoint": "step-00000006", "checkpoint_step": 6, "skipped": [48, 72], "time": ...}

Its length is what ``train.max_rollbacks`` bounds, over every start of the run.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from mhf_dist.atomic import write_atomic
from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RunDir


def read_rollbacks(run: RunDir) -> list[dict]:
    """The run's rollbacks, oldest first ([] before the first)."""
    try:
        return json.loads(run.rollbacks_path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run.rollbacks_path} cannot be read ({e}): it lists the data ranges this run skipped; "
                          "restore it from a backup, or delete it to read that data again") from e


def skipped_ranges(rollbacks: list[dict]) -> list[tuple[int, int]]:
    """The global position ranges the rollbacks skipped."""
    return [(r["skipped"][0], r["skipped"][1]) for r in rollbacks]


def rollback_entry(step: int, spikes: list[int], checkpoint: str, checkpoint_step: int,
                   skipped: tuple[int, int]) -> dict:
    """One rollback's record: at ``step``, for the ``spikes``, back to ``checkpoint``, ``skipped`` never read."""
    return {"step": step, "spikes": spikes, "checkpoint": checkpoint, "checkpoint_step": checkpoint_step,
            "skipped": list(skipped), "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_rollbacks(run: RunDir, rollbacks: list[dict]) -> None:
    """The record, written whole in place of the old one (rank 0)."""
    write_atomic(run.rollbacks_path, json.dumps(rollbacks, indent=1) + "\n")
