"""The writers of a checkpoint's files: ``RecordingWriter`` (a synchronous save: each file written, fsynced and
digested, a failure recorded instead of raised), ``BackgroundWriter`` (an asynchronous save: the files copied into
host memory, ``HostSnapshot``, then written by a thread). The checkpointer hands them to the backend
(``FileWriter``); docs/design-training.md, "Checkpoints", says how a save uses them."""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from mhf_dist.atomic import fsync, write_atomic
from mhf_dist.train.checkpoint.index import file_digest
from mhf_dist.train.fault_injection import slow_work, write_fails

log = logging.getLogger(__name__)

_COMPLETE, _CUT_SHORT = "complete", "cut short"  # how the queue of a background writer ends


class RecordingWriter:
    """This rank's files of one save (the backend's ``FileWriter``). Each file is written
    (the backend's state dicts by its own ``save_file``), then fsynced and digested; a failed write (DeepSpeed's
    ``torch.save`` reports a full disk as an OSError or a RuntimeError) is recorded instead of raised, so this rank
    still joins the backend's collectives and the ranks can agree on the outcome afterwards. Once one write failed,
    this rank's later writes are skipped. ``bytes`` counts what this rank's part takes, written or not."""

    def __init__(self, rank: int):
        self.digests: dict[Path, str] = {}
        self.error: str | None = None
        self.rank = rank
        self.bytes = 0

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        self.write(path, lambda p: save_file(state, p))
        self.bytes += path.stat().st_size if path in self.digests else state_bytes(state)

    def put(self, path: Path, data: bytes) -> None:
        """A file whose content is ready in memory."""
        self.write(path, lambda p: p.write_bytes(data))
        self.bytes += len(data)

    def makedirs(self, path: Path) -> None:
        """A directory for the files, with its parents."""
        self._recorded(path, lambda p: p.mkdir(parents=True, exist_ok=True), "creating")

    def write(self, path: Path, write_file) -> None:
        def write_and_digest(p: Path) -> None:
            _fail_if_injected(self.rank, p)
            write_file(p)
            fsync(p)
            self.digests[p] = file_digest(p)
            slow_work("checkpoint_file")

        self._recorded(path, write_and_digest)

    def report(self, path: Path, text: str) -> None:
        """A file another rank reads, and may delete, as soon as it exists: it appears whole and synced, and is not
        opened again (no digest of its own)."""

        def write(p: Path) -> None:
            _fail_if_injected(self.rank, p)
            write_atomic(p, text)

        self._recorded(path, write)

    def _recorded(self, path: Path, write, doing: str = "writing") -> None:
        if self.error is not None:
            return
        try:
            write(path)
        except (OSError, RuntimeError) as e:
            log.debug("%s %s failed", doing, path, exc_info=True)
            self.error = f"{doing} {path.name} failed ({str(e).strip().splitlines()[0]})"


def _fail_if_injected(rank: int, path: Path) -> None:
    """A write that fails as on a full disk where a test says so (``write_fails``)."""
    if write_fails(rank, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def state_bytes(state: object) -> int:
    """About what ``torch.save`` writes of ``state``: each tensor storage once, and the rest pickled."""
    return HostSnapshot(state, copy=False).bytes


class HostSnapshot:
    """An object graph as it is now, for a background thread to save later: pickled, with each tensor storage copied
    into host memory once (tensors that share a storage still share its copy; a GPU tensor comes back as a host
    tensor, which every loader of DeepSpeed's files maps to the host or copies into the model anyway)."""

    def __init__(self, obj, copy: bool = True):
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.copy = copy  # False: the storages are only counted (``bytes``), not copied
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._copy
        pickler.dump(obj)
        self.pickled = buffer.getvalue()
        self.bytes = len(self.pickled) + sum(s.nbytes() for s in self.storages.values())

    def _copy(self, obj) -> tuple[int, torch.dtype] | None:
        if not isinstance(obj, torch.storage.TypedStorage):
            return None  # pickled by value
        storage = obj._untyped_storage
        key = storage._cdata  # torch.save's own key: one entry per storage, however many views
        if key not in self.storages:
            if self.copy:
                storage = storage.clone() if storage.device.type == "cpu" else storage.cpu()
            self.storages[key] = storage
        return key, obj.dtype

    def restore(self):
        """The object graph again, its tensors on the copied storages."""
        unpickler = pickle.Unpickler(io.BytesIO(self.pickled))
        unpickler.persistent_load = lambda ref: torch.storage.TypedStorage(
            wrap_storage=self.storages[ref[0]], dtype=ref[1], _internal=True
        )
        return unpickler.load()


class BackgroundWriter(RecordingWriter):
    """The writer of an asynchronous save (``train.checkpoint_async``). On the training thread each file is only
    copied into host memory — the backend's state dicts as a ``HostSnapshot``, the other files as their bytes —
    and queued; a background thread writes them, fsyncs and digests them in order, as
    ``RecordingWriter`` does, then calls ``finish`` with this writer. ``close`` queues the end of the save,
    ``stop`` an end cut short (``finish`` then sees an error)."""

    def __init__(self, rank: int, finish):
        super().__init__(rank)
        self.files: queue.SimpleQueue[tuple[Path, Callable[[Path], None]] | str] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, args=(finish,), name="checkpoint-writer")
        self.thread.start()  # not a daemon: a process stopping on an error still finishes the save in flight

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        snapshot = HostSnapshot(state)  # the copy training waits for
        self.bytes += snapshot.bytes
        self.files.put((path, lambda p: save_file(snapshot.restore(), p)))

    def put(self, path: Path, data: bytes) -> None:
        self.bytes += len(data)
        self.files.put((path, lambda p: p.write_bytes(data)))

    def close(self) -> None:
        self.files.put(_COMPLETE)

    def stop(self) -> None:
        self.files.put(_CUT_SHORT)

    def _run(self, finish) -> None:
        try:
            while isinstance(item := self.files.get(), tuple):
                self.write(*item)
            if item == _CUT_SHORT:
                self.error = self.error or "its save stopped before every file was handed over"
        except Exception as e:  # not a write's OSError (recorded by write): still reported, so no rank counts on it
            log.exception("the background checkpoint writer failed")
            self.error = f"writing in the background failed ({e})"
        finish(self)
