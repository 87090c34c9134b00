"""Real filesystems that fail as users' do, mounted over a directory for one test and unmounted after: a small tmpfs
(full once its pages are used: writes fail with ENOSPC) or a read-only bind mount. Mounting needs root; elsewhere
the test is skipped, saying so."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = os.sysconf("SC_PAGE_SIZE")  # a tmpfs counts its size in pages: each file takes whole pages


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def _mounted(path: Path, *args: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a filesystem needs root and mount(8)")
    try:
        _mount(*args, str(path))
    except OSError as e:
        pytest.skip(str(e))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def small_filesystem(path: Path, size: int) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs of ``size`` bytes (whole pages) mounted at ``path``."""
    return _mounted(path, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def resize(path: Path, size: int) -> None:
    """The tmpfs at ``path`` grown (or shrunk) to ``size`` bytes, its files kept: a disk with space freed."""
    _mount("-o", f"remount,size={size}", str(path))


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` as a read-only bind mount of itself (writes fail with EROFS, as root's too)."""
    with _mounted(path, "--bind", str(path)):
        _mount("-o", "remount,bind,ro", str(path))
        yield path


def pages(size: int) -> int:
    """The bytes a tmpfs takes for a file of ``size`` bytes."""
    return -(-size // PAGE) * PAGE
