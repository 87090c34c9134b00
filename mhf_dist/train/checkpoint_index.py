"""Which checkpoints a run directory holds, and which of them are complete (no torch needed: ``status`` reads it).

A checkpoint is ``RUN/checkpoints/step-XXXXXXXX/``; it counts only once its
``complete.json`` marker exists and lists every file with its size (and
digest), the step, tokens seen, model, run config and layout. ``latest`` names the head of
the run's line of checkpoints; ``abandoned/`` holds lines set aside by a resume
from an older checkpoint. Writing and verifying them is
:mod:`mhf_dist.train.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mhf_dist.errors import MhfError

log = logging.getLogger(__name__)

MARKER = "complete.json"
LATEST = "latest"
ABANDONED = "abandoned"  # checkpoints of abandoned lines of training, one folder per resume that abandoned them
MARKER_FIELDS = {"step": int, "tokens": int, "reason": str, "files": dict, "model": dict, "layout": dict}
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(MhfError, ValueError):
    """A checkpoint is incomplete, corrupt, or belongs to another model / signature table; or a save failed."""


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``step-XXXXXXXX`` directory name (None for other names)."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_directories(directory: Path) -> list[Path]:
    """The ``step-*`` directories in ``directory``, complete or not, by step."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None),
                  key=checkpoint_step)


def _fields_problem(marker) -> str | None:
    """What makes a parsed marker unusable, or None."""
    if not isinstance(marker, dict):
        return "not a JSON object"
    for key, kind in MARKER_FIELDS.items():
        if not isinstance(marker.get(key), kind):
            return f"{key!r} is missing or not of type {kind.__name__}"
    if "signatures_hash" not in marker:
        return "'signatures_hash' is missing"
    files = marker["files"]
    if not files or not all(isinstance(v, int) and _safe_name(k) for k, v in files.items()):
        return "'files' must map the checkpoint's file names to their sizes"
    if not all(isinstance(marker["layout"].get(k), int) for k in ("tp", "pp", "dp")):
        return "'layout' must give tp, pp and dp"
    digests = marker.get("digests")
    if digests is not None and not (isinstance(digests, dict) and digests.keys() == files.keys()
                                    and all(isinstance(v, str) for v in digests.values())):
        return "'digests' must give a digest for every file"
    return None


def _safe_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def marker_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (no marker, or a malformed one), or None when it is."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        return f"no {MARKER}: the save was interrupted"
    try:
        problem = _fields_problem(json.loads(marker_path.read_text()))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        problem = str(e)
    return f"malformed {MARKER}: {problem}" if problem else None


def read_marker(path: Path) -> dict:
    """A checkpoint's ``complete.json``, checked for every field a load uses."""
    if (problem := marker_problem(path)) is not None:
        raise CheckpointError(f"{path} is not a complete checkpoint ({problem}); resume from another one")
    return json.loads((path / MARKER).read_text())


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (by step); incomplete ones are reported and skipped."""
    found = []
    for path in step_directories(directory):
        if (problem := marker_problem(path)) is None:
            found.append(path)
        else:
            log.warning("ignoring incomplete checkpoint %s (%s)", path, problem)
    return found
