"""Which checkpoints a run directory holds, which of them are complete, and whether their files are as saved (no
torch needed: ``status`` reads it).

A checkpoint is ``RUN/checkpoints/step-XXXXXXXX/``; it counts only once its
``complete.json`` marker exists and lists every file with its size (and
digest), the step, tokens seen, model, run config, layout and package versions. ``latest`` names the head of
the run's line of checkpoints; ``abandoned/`` holds lines set aside by a resume
from an older checkpoint, ``corrupt/`` the checkpoints whose files no longer
match their marker, set aside by ``--resume auto``. Writing them is
``mhf_dist.train.checkpoint.checkpointer``, checking them with every rank ``mhf_dist.train.checkpoint.reading``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mhf_dist.errors import MhfError

log = logging.getLogger(__name__)

MARKER = "complete.json"
LATEST = "latest"
ABANDONED = "abandoned"  # checkpoints of abandoned lines of training, one folder per resume that abandoned them
CORRUPT = "corrupt"  # checkpoints whose files differ from their marker, one folder per resume that set them aside
DIGEST = "sha256"  # hardware-accelerated on current x86 and ARM CPUs, and checkable with sha256sum
DIGEST_CHUNK = 1 << 20
DIGEST_THREADS = 4
MISSING, WRONG_SIZE, WRONG_DIGEST = 1, 2, 3  # what a file check finds (codes summed over the ranks)
MARKER_FIELDS = {
    "step": int,
    "tokens": int,
    "reason": str,
    "files": dict,
    "model": dict,
    "layout": dict,
}
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(MhfError, ValueError):
    """A checkpoint is incomplete, corrupt, or belongs to another model / signature table; or a save failed."""


class CorruptCheckpoint(CheckpointError):
    """A complete checkpoint's file is missing, or differs in size or content from what was saved."""


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``step-XXXXXXXX`` directory name (None for other names)."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_directories(directory: Path) -> list[Path]:
    """The ``step-*`` directories in ``directory``, complete or not, by step."""
    if not directory.is_dir():
        return []
    return sorted(
        (p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p) is not None),
        key=checkpoint_step,
    )


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
    if digests is not None and not (
        isinstance(digests, dict)
        and digests.keys() == files.keys()
        and all(isinstance(v, str) for v in digests.values())
    ):
        return "'digests' must give a digest for every file"
    return None


def _safe_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def version_note(path: Path, marker: dict, running: dict[str, str]) -> str | None:
    """One line when the checkpoint was saved under other versions of the packages in ``running`` (its marker's
    ``versions``), None when they are the same or it recorded none (saved before versions were recorded)."""
    saved = marker.get("versions")
    if not isinstance(saved, dict):
        return None
    differ = [name for name in running if name in saved and saved[name] != running[name]]
    if not differ:
        return None
    then, now = (
        ", ".join(f"{name} {versions[name]}" for name in differ) for versions in (saved, running)
    )
    return f"note: {path.name} was saved under {then}; resuming under {now}"


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
        raise CheckpointError(
            f"{path} is not a complete checkpoint ({problem}); resume from another one"
        )
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


# ---------------------------------------------------------------------------------------------------- file checks
def file_digest(path: Path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB chunks."""
    digest, chunk = hashlib.new(DIGEST), bytearray(DIGEST_CHUNK)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(view[:n])
    return digest.hexdigest()


def file_digests(paths: list[Path]) -> list[str]:
    """The digests of ``paths``, several files at a time (hashing releases the GIL)."""
    if len(paths) < 2:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(min(DIGEST_THREADS, len(paths))) as pool:
        return list(pool.map(file_digest, paths))


def checkpoint_bytes(path: Path) -> int:
    """A complete checkpoint's size on disk, from its marker."""
    return sum(read_marker(path)["files"].values())


def readable_size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def file_problems(
    path: Path, marker: dict, names: list[str], digests: bool = True
) -> dict[str, int]:
    """``{name: MISSING | WRONG_SIZE | WRONG_DIGEST}`` for those of ``names`` that differ from what was saved
    (``digests=False``: sizes only, which reads no file)."""
    problems, to_digest = {}, []
    for name in names:
        f = path / name
        if not f.is_file():
            problems[name] = MISSING
        elif f.stat().st_size != marker["files"][name]:
            problems[name] = WRONG_SIZE
        elif digests and "digests" in marker:
            to_digest.append(name)
    for name, digest in zip(to_digest, file_digests([path / n for n in to_digest])):
        if digest != marker["digests"][name]:
            problems[name] = WRONG_DIGEST
    return problems


def describe_problem(
    path: Path, marker: dict, name: str, problem: int, shown: str | None = None
) -> str:
    """What is wrong with the file ``name`` of ``path`` (named ``shown``: a checkpoint in object storage)."""
    real, path = path, shown or path
    if problem == MISSING:
        return f"checkpoint {path} is missing {name}; copy it back or resume from an older one"
    if problem == WRONG_SIZE:
        return (
            f"checkpoint {path}: {name} has {(real / name).stat().st_size} bytes, {marker['files'][name]} were "
            "written (truncated or corrupt); resume from an older checkpoint"
        )
    return (
        f"checkpoint {path}: {name} does not match its {marker.get('digest_algorithm', DIGEST)} digest in "
        f"{MARKER} (same size, different content: corrupt); copy it back intact or resume from an older checkpoint"
    )


def describe_problems(
    path: Path, marker: dict, problems: dict[str, int], shown: str | None = None
) -> str | None:
    """The first damaged file of ``problems`` (by name) and how many more there are, or None when there are none."""
    if not problems:
        return None
    name = min(problems)
    more = f" ({len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
    return describe_problem(path, marker, name, problems[name], shown) + more


def damage(path: Path, digests: bool = True) -> str | None:
    """What is wrong with a complete checkpoint's files (one process checks them all), or None when every file has
    the size (and, with ``digests``, the content) it was saved with."""
    marker = read_marker(path)
    return describe_problems(
        path, marker, file_problems(path, marker, sorted(marker["files"]), digests)
    )


def intact_note(intact: Path | None, directory: Path | str, shown: str | None = None) -> str:
    """The end of a corrupt checkpoint's error: the newest checkpoint beside it that verifies, to name instead
    (``shown``: how to name it, a checkpoint in object storage)."""
    if intact is None:
        return f"; no other checkpoint in {directory} verifies"
    return (
        f"; the newest checkpoint in {directory} that verifies is {intact.name}: give "
        f"{shown or intact} instead"
    )


def verify_files(path: Path, shown: str | None = None) -> dict:
    """The marker of a complete checkpoint whose every file has the size and digest it was saved with (one process
    checks them all: for tools that read a checkpoint outside training). A damaged one raises
    ``CorruptCheckpoint`` naming the newest checkpoint beside it that verifies; one downloaded from object storage
    (named ``shown``) names itself alone, as the files of the others are not there."""
    marker = read_marker(path)
    warn_if_without_digests(path, marker)
    names = sorted(marker["files"])
    problem = describe_problems(path, marker, file_problems(path, marker, names), shown)
    if problem is not None and shown is not None:
        raise CorruptCheckpoint(problem)
    if problem is not None:
        others = [p for p in complete_checkpoints(path.parent) if p.resolve() != path.resolve()]
        intact = next((p for p in reversed(others) if damage(p) is None), None)
        raise CorruptCheckpoint(problem + intact_note(intact, path.parent))
    return marker


def warn_if_without_digests(path: Path, marker: dict) -> None:
    if "digests" not in marker:
        log.warning(
            "checkpoint %s has no content digests (saved by an older version): only file sizes are checked",
            path,
        )
