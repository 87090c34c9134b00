"""Commands that write a directory (``export``, ``export-hf``, ``import-hf``, ``expand-vocab``, ``prepare-data``).

Nothing already saved is lost to them: the target must be new or empty unless
``--overwrite`` is given, and even then it may never be, contain or lie inside
a run directory or the command's source. The result is written into a hidden
sibling directory and renamed into place only when complete, so a failed or
interrupted command leaves the target as it was (and nothing half-written).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mhf_dist.config import ConfigError
from mhf_dist.storage.run_dir import RUN_MARKERS

OVERWRITE_HELP = "replace a non-empty output directory (never a run directory or the source)"


def _is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_MARKERS)


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_target(out: str | Path, sources: Sequence[str | Path], overwrite: bool) -> Path:
    """``out``, after checking that writing it loses nothing (see the module docstring); a clear error otherwise."""
    out = Path(out)
    target = out.resolve()
    for source in sources:
        src = Path(source).resolve()
        if _inside(src, target) or _inside(target, src):
            raise ConfigError(
                f"{out} is, holds or lies inside the source {source}; write somewhere else"
            )
    if not out.exists():
        return out
    if not out.is_dir():
        raise ConfigError(f"{out} is a file; name a directory to write (it is created)")
    if _is_run_dir(out) or any(_is_run_dir(p.parent) for m in RUN_MARKERS for p in out.rglob(m)):
        raise ConfigError(
            f"{out} is or holds a run directory; write somewhere else (--overwrite never replaces runs)"
        )
    if any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{out} is not empty; choose a new directory, or pass --overwrite to replace it"
        )
    return out


@contextlib.contextmanager
def staged(out: str | Path, before_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """``with staged(out) as tmp:`` write into ``tmp``; on success it replaces ``out`` (checked with
    ``check_target`` first), on failure it is removed and ``out`` is untouched. ``before_replace(tmp)`` runs
    once ``tmp`` is complete, just before it replaces ``out``: it may refuse (raise), having moved ``tmp`` to keep
    it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if before_replace is not None:
            before_replace(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
