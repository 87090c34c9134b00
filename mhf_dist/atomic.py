"""Files replaced whole: a reader (another rank, ``status``, a resumed job) sees the old content or the new, never half.

No torch here: ``status``, ``submit`` and ``gpu-check`` write through it without loading the training stack.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` through a temporary file beside it (named for this process, so that two
    processes writing the same file never share one). ``durable``: the file and its directory entry are flushed
    before this returns, so that the new content survives a power loss (checkpoint markers, manifests, reports);
    files rewritten every few seconds (heartbeats, the run lock) pass ``durable=False``."""
    tmp = _temporary(path)
    try:
        tmp.write_text(text)
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no stray temporary file
        raise
    if durable:
        fsync(path.parent)


def create_whole(path: Path, text: str) -> bool:
    """Write ``path`` whole unless it exists (another process wrote it first): whether this call wrote it."""
    tmp = _temporary(path)
    try:
        tmp.write_text(text)
        # fails where the file exists: the first writer wins, a reader never sees half
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _temporary(path: Path) -> Path:
    """The temporary file beside ``path`` that this process writes it through."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")
