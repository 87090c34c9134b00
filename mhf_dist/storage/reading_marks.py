"""Which training runs read a data directory, so that ``prepare-data --overwrite`` never replaces shards under them.

``mark_reading``: a run's first rank on each node marks every local shard directory it reads with
``DATA/.readers/<host>-<pid>.json`` (``run_dir``, ``host``, ``pid``, ``started``), refreshed every
``run_lock.HEARTBEAT_S`` seconds and removed when its training ends. A mark counts while its process runs (judged on
its own host) and its refresh is at most ``run_lock.STALE_S`` seconds old (``live_readers``). Shards read by URL, a
directory the run cannot write and the run's own ``RUN/data`` are not marked. ``refuse_if_read``: ``prepare-data``
names the runs and refuses, before it writes and again once the new preparation is complete (then kept beside as
``DATA.new``). The rules: docs/data.md, "Preparing again data that runs read".
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.config import DataConfig
from mhf_dist.data.formats import DataError
from mhf_dist.data.locations import is_url
from mhf_dist.storage.run_lock import HEARTBEAT_S, STALE_S, running

READERS_DIR = ".readers"


class ReadingMarks:
    """The marks one process holds (``mark_reading``), refreshed until ``release``."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._stop = threading.Event()
        if files:
            threading.Thread(target=self._heartbeat, name="data-reading-marks", daemon=True).start()
            atexit.register(self.release)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for path in self.files:
                try:
                    os.utime(path)
                except OSError:  # removed with its directory: nothing left to mark
                    pass

    def release(self) -> None:
        """Remove the marks (idempotent)."""
        self._stop.set()
        for (
            path
        ) in self.files:  # .readers/ itself stays: another run may be writing its mark into it
            path.unlink(missing_ok=True)
        self.files = []
        atexit.unregister(self.release)


def mark_reading(data: DataConfig, run_dir: str | os.PathLike) -> ReadingMarks:
    """Mark the local shard directories of ``data`` (``data.path``, or each of ``data.sources``) as read by the run
    in ``run_dir``: on the node's first rank only, see the module docstring."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return ReadingMarks([])
    paths = (
        [s.path for s in data.sources]
        if data.sources
        else [data.shard_dir]
        if data.shard_dir
        else []
    )
    mark = {
        "run_dir": str(Path(run_dir).resolve()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    files = []
    for directory in {Path(p).resolve() for p in paths if not is_url(str(p)) and Path(p).is_dir()}:
        path = directory / READERS_DIR / f"{mark['host']}-{mark['pid']}.json"
        try:
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps(mark), durable=False)
        except OSError:  # a read-only dataset: it cannot be re-prepared under the run either
            continue
        files.append(path)
    return ReadingMarks(files)


def live_readers(directory: str | os.PathLike) -> list[dict]:
    """The marks of runs that read ``directory`` now, each with ``age_s`` (since its last heartbeat)."""
    found, host, now = [], socket.gethostname(), time.time()
    for path in sorted((Path(directory) / READERS_DIR).glob("*.json")):
        try:
            mark, age = json.loads(path.read_text()), now - path.stat().st_mtime
            pid = int(mark.get("pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):  # removed meanwhile, or not a mark
            continue
        if age <= STALE_S and (mark.get("host") != host or running(pid)):
            found.append(mark | {"age_s": age})
    return found


def refuse_if_read(
    directory: str | os.PathLike, prepared: Path | None = None, read_through: Sequence[Path] = ()
) -> None:
    """Refuse to replace ``directory`` while runs read it (or a directory in ``read_through``, whose manifest lists
    its shards: a merge of parts), naming them and what to do. ``prepared``: the complete new preparation meant to
    replace it, which is then kept beside it and named."""
    directory = Path(directory)
    readers = [r for d in (directory, *read_through) if Path(d).is_dir() for r in live_readers(d)]
    if not readers:
        return
    runs = "; ".join(
        f"run {r.get('run_dir')} (process {r.get('pid')} on {r.get('host')}, started {r.get('started')}, "
        f"heartbeat {r['age_s']:.0f} s ago)"
        for r in readers
    )
    what = f"{directory} is read by {len(readers)} training run{'s' * (len(readers) > 1)}: {runs}"
    gone = (
        f"a mark in {READERS_DIR}/ stops counting when its process has exited, or {STALE_S // 60} minutes "
        "after its last heartbeat"
    )
    if prepared is None:
        raise DataError(
            f"{what}. Replacing its shards would fail them mid-run, so prepare-data does not: wait for "
            "them to end (or stop them) and rerun; or prepare into another directory (--out NEW) and "
            f"resume them on it with --set data.path=NEW --set data.restart=true ({gone})"
        )
    kept = directory.with_name(f"{directory.name}.new")
    if kept.exists():
        kept = directory.with_name(f"{directory.name}.new-{os.getpid()}")
    prepared.rename(kept)
    raise DataError(
        f"{what}, which started while the new preparation was written, so {directory} was left as it was. "
        f"The new preparation is complete in {kept}: resume those runs on it with --set data.path={kept} "
        f"--set data.restart=true, or once they end replace {directory} with it ({gone})"
    )
