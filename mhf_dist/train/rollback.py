"""The run's rollbacks (``train.on_spike=rollback``), recorded in ``RUN/rollbacks.json``.

Once ``train.spike_patience`` spikes fell within the last 50 steps, the run goes back to the newest checkpoint saved
before the first of them and skips the data it read since that checkpoint: the reader goes on where it stands, and
the range of global positions from the checkpoint's position to there is recorded, so that a later resume (from that
checkpoint, or under another layout) never reads it either (``mhf_dist.data.skipped``). The record is a list, one
entry per rollback, in order::

    {"step": 9, "spikes": [7, 9], "checkpoint": "step-00000006", "checkpoint_step": 6, "skipped": [48, 72], "time": ...}

Its length is what ``train.max_rollbacks`` bounds, over every start of the run.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from mhf_dist.atomic import write_atomic
from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.divergence import SPIKE_WINDOW, DivergenceSettings, TrainingDiverged

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from mhf_dist.data.reader import ShardReader
    from mhf_dist.train.checkpoint import Checkpointer


def read_rollbacks(run: RunDir) -> list[dict]:
    """The run's rollbacks, oldest first ([] before the first)."""
    try:
        return json.loads(run.rollbacks_path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{run.rollbacks_path} cannot be read ({e}): it lists the data ranges this run skipped; "
            "restore it from a backup, or delete it to read that data again"
        ) from e


def skipped_ranges(run: RunDir) -> list[tuple[int, int]]:
    """The global position ranges the run's rollbacks skipped, which its readers never read."""
    return [(r["skipped"][0], r["skipped"][1]) for r in read_rollbacks(run)]


def rollback_entry(
    step: int, spikes: list[int], checkpoint: str, checkpoint_step: int, skipped: tuple[int, int]
) -> dict:
    """One rollback's record: at ``step``, for the ``spikes``, back to ``checkpoint``, ``skipped`` never read."""
    return {
        "step": step,
        "spikes": spikes,
        "checkpoint": checkpoint,
        "checkpoint_step": checkpoint_step,
        "skipped": list(skipped),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_rollbacks(run: RunDir, rollbacks: list[dict]) -> None:
    """The record, written whole in place of the old one (rank 0)."""
    write_atomic(run.rollbacks_path, json.dumps(rollbacks, indent=1) + "\n")


class Rollbacks:
    """The run's rollbacks: those recorded (read at start) and going back once one is due."""

    def __init__(self, run: RunDir, cfg: DivergenceSettings, rank: int):
        self.run, self.cfg, self.rank = run, cfg, rank
        self.done = read_rollbacks(run)

    def due(self, spikes: list[int]) -> bool:
        """Whether ``spikes`` (the steps of the spikes within the last ``SPIKE_WINDOW`` steps) roll the run back."""
        return self.cfg.on_spike == "rollback" and len(spikes) >= self.cfg.spike_patience

    def go_back(
        self,
        step: int,
        spikes: list[int],
        checkpointer: Checkpointer,
        reader: ShardReader,
        load: Callable[[Path], dict],
    ) -> None:
        """At ``step``: ``load`` the newest checkpoint saved before ``spikes[0]`` as a resume loads it (the
        checkpoints since are set aside) and have ``reader`` pass over the data from that checkpoint's position to
        where it stood, recorded. Every rank calls this alike (the spikes are judged on global numbers). Past
        ``train.max_rollbacks``, or without a checkpoint before the spikes, raises ``TrainingDiverged``."""
        checkpointer.wait()  # an asynchronous save in flight joins the line first
        target = checkpointer.newest_before(spikes[0])
        plural = "s" if len(spikes) > 1 else ""
        said = (
            f"{len(spikes)} spike{plural} within the last {SPIKE_WINDOW} steps (step{plural} "
            f"{', '.join(map(str, spikes))})"
        )
        if target is None or len(self.done) >= self.cfg.max_rollbacks:
            why = (
                f"no checkpoint was saved before step {spikes[0]} to roll back to"
                if target is None
                else f"the run made its {self.cfg.max_rollbacks} rollback(s) (train.max_rollbacks; "
                f"{self.run.rollbacks_path})"
            )
            raise TrainingDiverged(
                f"{said}, and {why}; stopped without saving step {step}. Resume from "
                f"{target or checkpointer.latest()} with a lower optimizer.lr or a longer optimizer.warmup_steps "
                "(changes apply on resume), or raise train.max_rollbacks"
            )
        position = reader.global_position()
        checkpointer.continue_from(target)
        # the reader too, at the checkpoint's position: from there it passes over the data
        client = load(target)
        skipped = (reader.global_position(client["reader"]), position)
        reader.skip(*skipped)
        self.done.append(rollback_entry(step, spikes, target.name, client["step"], skipped))
        if self.rank == 0:
            write_rollbacks(self.run, self.done)
            tqdm.write(
                f"rollback {len(self.done)}/{self.cfg.max_rollbacks}: {said}; back to {target} (step "
                f"{client['step']}); the data read since it (global samples {skipped[0]}-{skipped[1] - 1}) "
                f"is skipped, recorded in {self.run.rollbacks_path}"
            )
