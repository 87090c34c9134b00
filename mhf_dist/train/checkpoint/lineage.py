"""The run's line of checkpoints: ``latest``, the checkpoints a resume sets aside (``abandoned/``, ``corrupt/``),
retention (``train.keep_checkpoints``, after a save and, when the disk is short, before one) and the background
deletes (``BackgroundDeleter``). ``Lineage`` is a base of
``Checkpointer``; docs/design-training.md, "Checkpoints", says why a
resume sets checkpoints aside and when retention runs."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import torch.distributed as dist

from mhf_dist.atomic import write_atomic
from mhf_dist.config import RunConfig
from mhf_dist.train.checkpoint.index import (
    ABANDONED,
    LATEST,
    MARKER,
    checkpoint_bytes,
    checkpoint_step,
    complete_checkpoints,
    read_marker,
    readable_size,
    step_directories,
)
from mhf_dist.train.checkpoint.store import CheckpointStore, local_share
from mhf_dist.train.fault_injection import free_bytes

log = logging.getLogger(__name__)

UNIVERSAL = "universal"  # conversions for other layouts
DELETING = ".deleting"  # checkpoints on their way out, deleted in the background


class BackgroundDeleter:
    """Rank 0 deletes checkpoint directories off the ranks' path: each is first renamed into
    ``checkpoints/.deleting/`` (instant, and gone from the run's view at once), then removed by a background
    thread while training goes on, so no rank waits in a collective for a delete that takes as long as the
    checkpoint is large. What an exit cuts short there is removed at the next start."""

    def __init__(self, root: Path):
        self.root = root / DELETING
        self.queue: queue.SimpleQueue[Path | None] = queue.SimpleQueue()  # None: stop
        self.thread: threading.Thread | None = None
        if self.root.is_dir():
            for leftover in self.root.iterdir():
                self._enqueue(leftover)

    def discard(self, path: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        moved = self.root / f"{path.name}-{time.time_ns():x}"
        os.replace(path, moved)
        self._enqueue(moved)

    def _enqueue(self, path: Path) -> None:
        self.queue.put(path)
        if (
            self.thread is None
        ):  # daemon: an exit does not wait for it (the next start finishes the job)
            self.thread = threading.Thread(
                target=self._delete, name="checkpoint-deleter", daemon=True
            )
            self.thread.start()

    def finish(self) -> None:
        """Return once everything discarded so far is deleted (at the end of training, when nothing waits)."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
            with contextlib.suppress(OSError):
                self.root.rmdir()

    def _delete(self) -> None:
        while (path := self.queue.get()) is not None:
            try:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError as e:
                log.warning("could not delete %s (%s); delete it by hand", path, e)


class Lineage:
    """Which checkpoints make up the run's line, and which are retired; a base of
    ``Checkpointer`` (through
    ``Reading``), which sets the attributes below."""

    dir: Path  # RUN/checkpoints, or the staging directory of a remote store
    store: CheckpointStore  # where the checkpoints are kept: each change to ``dir`` below is repeated there
    cfg: RunConfig
    rank: int
    deleter: BackgroundDeleter | None  # rank 0's

    # ------------------------------------------------------------------ lineage
    def _remove_interrupted_saves(self) -> None:
        for path in step_directories(self.dir):
            if not (path / MARKER).exists():
                log.warning(
                    "ignoring incomplete checkpoint %s (no %s: the save was interrupted); removing it",
                    path,
                    MARKER,
                )
                self.deleter.discard(path)
        for name, problem in self.store.listing():
            if problem is not None:
                log.warning(
                    "ignoring incomplete checkpoint %s/%s (%s); removing it",
                    self.store.url,
                    name,
                    problem,
                )
                self.store.remove(name)

    def _latest_name(self) -> str | None:
        try:
            return (self.dir / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def latest(self) -> Path | None:
        """The newest complete checkpoint, None when there is none (``--resume auto`` continues from it when its files
        verify: ``Checkpointer.resumable <mhf_dist.train.checkpoint.checkpointer.Checkpointer.resumable>``). It is
        the one ``latest`` names, since a resume from an older one sets the newer ones aside; they differ only when a
        crash fell between a checkpoint's ``complete.json`` and ``latest`` (warned about)."""
        found = self._complete_line()
        return found[-1] if found else None

    def _complete_line(self) -> list[Path]:
        """This run's complete checkpoints, oldest first, with a warning when ``latest`` does not name the newest."""
        found = complete_checkpoints(self.dir)
        name = self._latest_name()
        if found and name != found[-1].name and self.rank == 0:
            named = f"names {name!r}" if name else "is missing"
            log.warning(
                "%s %s; resuming from the newest complete checkpoint, %s",
                self.dir / LATEST,
                named,
                found[-1],
            )
        return found

    def newest_before(self, step: int) -> Path | None:
        """The newest complete checkpoint of this run's line saved before ``step`` (a rollback's target)."""
        found = [p for p in self._complete_line() if checkpoint_step(p) < step]
        return found[-1] if found else None

    def continue_from(self, resumed: Path) -> None:
        """Make ``resumed`` the head of this run's line of checkpoints before training continues from it: rank 0
        moves the run's newer checkpoints (an abandoned line of training, which retention and ``--resume auto``
        would otherwise mix in) to ``checkpoints/abandoned/<time>/`` and points ``latest`` at ``resumed``."""
        if self.rank == 0:
            step = read_marker(resumed)["step"]
            newer = [p for p in step_directories(self.dir) if checkpoint_step(p) > step]
            if newer:
                self._set_aside(
                    newer, f"they are newer than {resumed}, the checkpoint this run continues from"
                )
            self._point_latest_at(resumed)
        dist.barrier()
        self.share_line()

    def share_line(self) -> None:
        """After a save and after a start or a rollback set checkpoints aside (every rank), with a remote store: the
        staging directory of each node shows what rank 0's shows (``latest``, its marker, and only the checkpoints
        rank 0 kept), so that every rank reads the same line of checkpoints (a rollback's target, a later
        resume's). Nothing to do when every node sees the checkpoints themselves."""
        if self.store.url is None:
            return
        shared = [None, None, None]
        if self.rank == 0:
            head = self._latest_name()
            marker = (self.dir / head / MARKER).read_text() if head else None
            shared = [head, marker, [p.name for p in complete_checkpoints(self.dir)]]
        dist.broadcast_object_list(shared, src=0)
        if self.rank == 0 or local_share()[0] != 0:
            return  # rank 0 made the line; each other node's first rank follows it
        head, marker, kept = shared
        if head is None:
            (self.dir / LATEST).unlink(missing_ok=True)
        else:
            if not (self.dir / head / MARKER).exists():  # a save's: its marker is rank 0's to write
                (self.dir / head).mkdir(parents=True, exist_ok=True)
                write_atomic(self.dir / head / MARKER, marker)
            write_atomic(self.dir / LATEST, head)
        for old in step_directories(self.dir):
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)

    def _set_aside(self, paths: list[Path], why: str) -> Path:
        """Move checkpoints (and their conversions for other layouts) into a new ``abandoned/<time>`` folder."""
        target = self._move_aside(paths, ABANDONED)
        log.warning(
            "moved %s to %s: %s (resume from one of them with --resume PATH, or delete them)",
            ", ".join(p.name for p in paths),
            target,
            why,
        )
        return target

    def _move_aside(self, paths: list[Path], folder: str) -> Path:
        """Move checkpoints (and their conversions for other layouts) into a new ``<folder>/<time>`` folder."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = self.dir / folder / stamp, 1
        while target.exists():
            target, n = self.dir / folder / f"{stamp}-{n}", n + 1
        target.mkdir(parents=True)
        self.store.set_aside(
            [p.name for p in paths if p.parent == self.dir], f"{folder}/{target.name}"
        )
        for path in paths:
            os.replace(path, target / path.name)
            if (converted := self.dir / UNIVERSAL / path.name).is_dir():
                (target / UNIVERSAL).mkdir(exist_ok=True)
                os.replace(converted, target / UNIVERSAL / path.name)
        return target

    def _point_latest_at(self, resumed: Path) -> None:
        """``latest`` names ``resumed`` when it is one of this run's checkpoints, else this run's newest one."""
        if resumed.resolve().parent == self.dir.resolve():
            head = resumed.name
        else:
            found = complete_checkpoints(self.dir)
            head = found[-1].name if found else None
        if head is None:
            (self.dir / LATEST).unlink(missing_ok=True)
        elif self._latest_name() != head:
            write_atomic(self.dir / LATEST, head)
        else:
            return
        self.store.point_latest(head)

    # ------------------------------------------------------------------ retention
    def _retire_old(self, saved: Path) -> None:
        """Delete the complete checkpoints before the newest ``train.keep_checkpoints`` (``saved`` among them)."""
        self._discard_all(
            self._beyond_retention(checkpoint_step(saved), self.cfg.train.keep_checkpoints - 1)
        )

    def _beyond_retention(self, step: int, kept: int) -> list[Path]:
        """The complete checkpoints before ``step`` but the newest ``kept`` of them, oldest first."""
        older = [p for p in complete_checkpoints(self.dir) if checkpoint_step(p) < step]
        return older[: max(0, len(older) - kept)]

    def _discard_all(self, paths: list[Path]) -> None:
        for old in paths:
            self.store.remove(old.name)  # a remote store: its marker first
            try:
                self.deleter.discard(old)
            except OSError as e:
                log.warning(
                    "could not delete the old checkpoint %s (%s); delete it by hand", old, e
                )

    def _retire_to_fit(self, path: Path) -> None:
        """Rank 0, before saving ``path``: when the free space is less than the newest checkpoint's size, retention
        runs now instead of after the save, and is waited for — if deleting what ``train.keep_checkpoints`` lets go
        makes room. The newest checkpoint always stays (the save may still fail), and nothing is deleted in vain."""
        found = complete_checkpoints(self.dir)
        if not found or (need := checkpoint_bytes(found[-1])) <= free_bytes(self.dir):
            return
        self.deleter.finish()  # what earlier deletes left pending frees space too
        free = free_bytes(self.dir)
        retired = self._beyond_retention(
            checkpoint_step(path), max(1, self.cfg.train.keep_checkpoints - 1)
        )
        if need <= free or free + sum(map(checkpoint_bytes, retired)) < need:
            return
        log.warning(
            "deleting %s before saving %s to make room (train.keep_checkpoints=%d): a checkpoint takes "
            "about %s, %s are free",
            ", ".join(p.name for p in retired),
            path.name,
            self.cfg.train.keep_checkpoints,
            readable_size(need),
            readable_size(free),
        )
        self._discard_all(retired)
        self.deleter.finish()

    def _keep_that_fits(self, found: list[Path], free: int) -> int | None:
        """The highest ``train.keep_checkpoints`` whose deletes before a save (``_retire_to_fit``) make room for
        a checkpoint the size of the newest of ``found``, or None when even 1 would not."""
        need, freed = checkpoint_bytes(found[-1]), free
        for deleted, old in enumerate(found[:-1], start=1):
            freed += checkpoint_bytes(old)
            if freed >= need:
                return len(found) - deleted + 1
        return None

    def _space_fix(self, previous: list[Path], free: int, limited: bool) -> str:
        """How to make room for the next save: free space (or raise ``ulimit -f``), or rerun with a lower
        ``train.keep_checkpoints`` when the deletes it allows before a save would make room."""
        fix = "free space" + (" (or raise ulimit -f)" if limited else "")
        if not previous or checkpoint_bytes(previous[-1]) <= free:
            return f"{fix}, then rerun to resume (--resume auto)"
        if (keep := self._keep_that_fits(previous, free)) is None:
            return (
                f"{fix}, then rerun to resume (--resume auto); deleting older checkpoints would not make room "
                f"({previous[-1].name}, the newest, is always kept)"
            )
        return (
            f"{fix} and rerun to resume (--resume auto), or rerun with --set train.keep_checkpoints={keep} (older "
            f"checkpoints are then deleted before the save, {previous[-1].name} kept)"
        )
