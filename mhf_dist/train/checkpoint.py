"""Checkpoints: atomic, sharded, verified saves and exact resume (preemption, crash and disk-full safe).

A checkpoint is ``RUN/checkpoints/step-XXXXXXXX/``: DeepSpeed's sharded model and
optimizer files (its ``save_checkpoint``, which also keeps the LR scheduler),
with our client state inside — step, tokens seen, the data reader's position
(identical on every rank: the global order does not depend on the rank count),
run config, signature-table content hash, code version, layout — plus one
``rng-rank*.safetensors`` per rank (python, numpy, torch and the rank's own GPU generator).

Atomicity and integrity: the directory counts only once ``complete.json``
exists in it. Each rank fsyncs the files it wrote and takes their SHA-256
digests (read back from the page cache, the ranks in parallel); rank 0 writes
the marker after every rank finished, listing every file with its size and
digest, then replaces ``RUN/checkpoints/latest`` atomically. Before DeepSpeed
reads a checkpoint, every file's size and digest are checked (the ranks share
the files), so a missing, truncated or overwritten shard is named instead of
loaded; checkpoints saved before digests were recorded get the size check only,
with a warning. A directory without the marker (a rank killed mid-save) is
ignored with a warning and removed by rank 0 at the next start; a malformed
marker also counts as incomplete, but that directory is kept (its files may be
intact). A save that fails on any rank (disk full, file size limit) fails on
every rank together: the ranks agree on it through an all-reduce, rank 0
removes the incomplete directory, and a :class:`CheckpointError` names the
space a checkpoint needs, and the ``train.keep_checkpoints`` that would make
room when that is a fix; the previous checkpoint stays the newest.

Asynchronous saves (``train.checkpoint_async``): training waits only while
each rank copies its files into host memory (:class:`HostSnapshot`); a
background thread per rank writes them (DeepSpeed's files by its engine), fsyncs and
digests them (:class:`BackgroundWriter`), then reports to rank 0 through a
file (its digests, or an empty ``failed-rank*`` file: no collectives off the
training thread). Rank 0's thread waits for every report and, when none
failed, commits as above (marker last, then ``latest``, then retention). The
ranks wait for that save (:meth:`Checkpointer.wait`) before the next one, at
the end of training and before a preempted exit, and agree on its outcome
there exactly as after a synchronous save; a process stopping on an error
exits once its writer finished (the thread is not a daemon), and one killed
before the marker leaves an incomplete directory, as above.

Lineage: ``--resume auto`` continues from the newest complete checkpoint whose
files verify, normally the one ``latest`` names (a warning says when a crash
between the two writes left them apart); newer ones with a damaged file are
moved to ``checkpoints/corrupt/<time>/`` with a warning naming each, never
deleted. A checkpoint named with ``--resume PATH`` that does not verify is
refused, naming the newest one that does. Resuming from an
older checkpoint abandons the newer ones: before training continues, rank 0
moves them to ``checkpoints/abandoned/<time>/`` and logs it, so
``checkpoints/`` holds one line of history and ``latest`` names its head.
Retention keeps the newest ``train.keep_checkpoints`` of that line, by step,
and never deletes the checkpoint just written. It runs after each save, and
also before one when the filesystem has less free space than the newest
checkpoint takes (then it is waited for, and never deletes the newest).

Pickle: our own files are read without it — RNG states are safetensors (torch
and CUDA states) with JSON metadata (python's and numpy's), and checkpoints
from before that format have their ``rng-rank*.pt`` read with
``torch.load(weights_only=True)`` (numpy arrays allowed). What still goes
through pickle is DeepSpeed's own model and optimizer files, with our client
state inside them: DeepSpeed writes them with ``torch.save`` and reads them
with its checkpoint engine's ``torch.load(weights_only=False)``, and keeping
the client state there keeps the step, the scheduler and the data position in
one atomic write. A checkpoint directory must therefore come from a trusted
source; the digests guard against corruption, not against someone who can also
rewrite ``complete.json``.

Resuming under another layout (dp, tp or pp changed) goes through DeepSpeed's
universal checkpoint (:func:`mhf_dist.backend.convert_for_layout`): every combination of
dp, tp and pp (pp = 1 ↔ pp > 1 included, but a pipeline's under ZeRO-1/2 only:
:meth:`Checkpointer.for_this_layout`) converts; the data position carries
over because the reader's order does not depend on the rank count. The RNG
states are not restored then (they belong to the old ranks).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import queue
import random
import resource
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from mhf_dist import __version__
from mhf_dist.backend import Trainer, convert_for_layout, universal_info
from mhf_dist.config import ModelConfig, RunConfig
from mhf_dist.parallel.rank0_work import on_rank0
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.checkpoint_index import (
    ABANDONED,
    CORRUPT,
    DIGEST,
    LATEST,
    MARKER,
    CheckpointError,
    CorruptCheckpoint,
    checkpoint_bytes,
    checkpoint_step,
    complete_checkpoints,
    describe_problems,
    file_digest,
    file_digests,
    file_problems,
    intact_note,
    marker_problem,
    read_marker,
    step_directories,
    warn_if_without_digests,
)
from mhf_dist.train.fault_injection import free_bytes, pause_conversion, pause_save, write_fails
from mhf_dist.train.host_tables import HOST_TABLES_FILE, HostTablesStep
from mhf_dist.train.job_estimates import grace_seconds
from mhf_dist.train.preemption import GRACE_ENV

log = logging.getLogger(__name__)

UNIVERSAL = "universal"  # conversions for other layouts
DELETING = ".deleting"  # checkpoints on their way out, deleted in the background
RNG_FILE = "rng-rank{:05d}.safetensors"
LEGACY_RNG_FILE = "rng-rank{:05d}.pt"
RANK_DIGESTS = "digests-rank{:05d}.json"  # each rank's digests during a save, merged into the marker by rank 0
RANK_FAILED = "failed-rank{:05d}"  # an asynchronous save's report of a rank whose part failed (empty: fits a full disk)
REPORT_POLL_SECONDS = 0.1  # how often rank 0's writer looks for the other ranks' reports
_COMPLETE, _CUT_SHORT = "complete", "cut short"  # how the queue of a background writer ends


# ---------------------------------------------------------------------------------------------------- files
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def readable_size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------------- RNG states
def rng_state_bytes(cuda: bool) -> bytes:
    """This process's generator states as a file's content, without pickle: torch's and, for a rank on a GPU
    (``cuda``), its GPU's (uint8 tensors) as safetensors, python's and numpy's (integers and a float) as JSON in its
    metadata. A rank on the CPU asks CUDA nothing, also where a GPU is visible."""
    version, internal, gauss_next = random.getstate()
    generator, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    metadata = {"python": json.dumps([version, list(internal), gauss_next]),
                "numpy": json.dumps([generator, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian)])}
    tensors = {"torch": torch.get_rng_state()}
    if cuda:  # the rank's own GPU only: a resume may see fewer GPUs (one bound to each task)
        tensors["cuda"] = torch.cuda.get_rng_state()
    return save(tensors, metadata=metadata)


def read_rng_state(path: Path) -> dict:
    """The states of a file holding :func:`rng_state_bytes`, in the form :func:`set_rng_state` takes."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        version, internal, gauss_next = json.loads(metadata["python"])
        generator, key, pos, has_gauss, cached_gaussian = json.loads(metadata["numpy"])
        state = {"python": (version, tuple(internal), gauss_next),
                 "numpy": (generator, np.array(key, dtype=np.uint32), pos, has_gauss, cached_gaussian),
                 "torch": tensors["torch"]}
    except Exception as e:  # a damaged header (SafetensorError), missing or malformed states
        raise CheckpointError(f"{path} is not a readable RNG state ({e}); resume from another checkpoint") from e
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    elif any(k.startswith("cuda.") for k in tensors):  # saved with every visible GPU's state, cuda.0, cuda.1, ...
        state["cuda"] = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")),
                                                    key=lambda k: int(k.split(".")[1]))]
    return state


def read_legacy_rng_state(path: Path) -> dict:
    """An ``rng-rank*.pt`` of a checkpoint saved before RNG states were safetensors, unpickled with
    ``weights_only=True``: tensors, tuples and numpy arrays only, so the file cannot run code."""
    reconstruct = np.array(0).__reduce__()[0]  # numpy.core.multiarray's (numpy 1) or numpy._core's (numpy 2)
    allowed = [(reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")]
    allowed += [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True)
        if not (isinstance(state, dict) and {"python", "numpy", "torch"} <= state.keys()):
            raise ValueError("not a dict of python, numpy and torch states")
    except Exception as e:  # the unpickler refuses anything else with UnpicklingError, RuntimeError or others
        raise CheckpointError(
            f"{path} is not a plain RNG state ({_refusal(e)}), so it was not loaded (unpickling it without "
            "restrictions could run code from it): resume from a checkpoint from a trusted source") from e
    return state


def _refusal(error: Exception) -> str:
    """The line of a ``weights_only`` refusal that names what the file holds (not torch's advice to unpickle it)."""
    lines = str(error).splitlines()
    named = [line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line]
    if named:
        return named[0][:200]
    return "refused by the restricted unpickler" if "weights_only" in str(error) else (lines or ["?"])[0][:200]


def set_rng_state(state: dict, cuda: bool) -> None:
    """Restore ``state``; its GPU generator's only for a rank on a GPU (``cuda``)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda:
        torch.cuda.set_rng_state(current_device_rng(state["cuda"]))


def current_device_rng(cuda: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """This rank's GPU generator state from a checkpoint: the one saved state, or, from checkpoints that saved every
    visible GPU's, the entry of the current device (the first when the resume sees fewer GPUs than the save did)."""
    if torch.is_tensor(cuda):
        return cuda
    index = torch.cuda.current_device()
    return cuda[index] if index < len(cuda) else cuda[0]


# ---------------------------------------------------------------------------------------------------- deleting
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
        if self.thread is None:  # daemon: an exit does not wait for it (the next start finishes the job)
            self.thread = threading.Thread(target=self._delete, name="checkpoint-deleter", daemon=True)
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


# ---------------------------------------------------------------------------------------------------- saving
def log_save(path: Path, reason: str, stall: float, background: float | None = None, step_s: float = 0.0) -> None:
    """Rank 0: the save with its size, duration (an asynchronous save's ``stall`` of training and its ``background``
    time) and write rate; a warning when a step (``step_s``) and a save like this one would not fit in the job's grace
    period (the time between SLURM's warning signal and the time limit), naming the grace that would
    (:func:`~mhf_dist.train.job_estimates.grace_seconds`)."""
    seconds = stall if background is None else stall + background
    size = checkpoint_bytes(path)
    per_node = size / max(seconds, 1e-9) / int(os.environ.get("SLURM_JOB_NUM_NODES", 1)) / 1e9
    took = f"{stall:.1f} s" if background is None else f"{stall:.1f} s stall, {background:.1f} s in the background"
    tqdm.write(f"saved {path} ({reason}, {readable_size(size)} in {took}, {per_node:.3g} GB/s per node)")
    grace = float(os.environ.get(GRACE_ENV, "inf"))
    if (needed := grace_seconds(step_s, seconds)) > grace:
        tqdm.write(f"warning: a save on SLURM's signal (the step in progress, {step_s:.1f} s, then a save like this "
                   f"one) needs a grace of about {needed} s, and this job has {grace:.0f} s: submit with --grace "
                   f"{needed}, or set storage_gb_per_s: {per_node:.3g} (this save's rate) in the cluster profile, "
                   "from which submit sizes the grace")


class RecordingWriter:
    """This rank's files of one save (the backend's :class:`~mhf_dist.backend.FileWriter`). Each file is written
    (the backend's state dicts by its own ``save_file``), then fsynced and digested; a failed write (DeepSpeed's
    ``torch.save`` reports a full disk as an OSError or a RuntimeError) is recorded instead of raised, so this rank
    still joins the backend's collectives and the ranks can agree on the outcome afterwards. Once one write failed,
    this rank's later writes are skipped."""

    def __init__(self, rank: int):
        self.digests: dict[Path, str] = {}
        self.error: str | None = None
        self.rank = rank

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        self.write(path, lambda p: save_file(state, p))

    def put(self, path: Path, data: bytes) -> None:
        """A file whose content is ready in memory."""
        self.write(path, lambda p: p.write_bytes(data))

    def write(self, path: Path, write_file) -> None:
        def write_and_digest(p: Path) -> None:
            write_file(p)
            _fsync(p)
            self.digests[p] = file_digest(p)

        self._recorded(path, write_and_digest)

    def report(self, path: Path, text: str) -> None:
        """A file another rank reads, and may delete, as soon as it exists: it appears whole and synced, and is not
        opened again (no digest of its own)."""
        self._recorded(path, lambda p: _write_atomic(p, text))

    def _recorded(self, path: Path, write) -> None:
        if self.error is not None:
            return
        try:
            if write_fails(self.rank, path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            write(path)
        except (OSError, RuntimeError) as e:
            log.debug("writing %s failed", path, exc_info=True)
            self.error = f"writing {path.name} failed ({str(e).strip().splitlines()[0]})"


class HostSnapshot:
    """An object graph as it is now, for a background thread to save later: pickled, with each tensor storage copied
    into host memory once (tensors that share a storage still share its copy; a GPU tensor comes back as a host
    tensor, which every loader of DeepSpeed's files maps to the host or copies into the model anyway)."""

    def __init__(self, obj):
        self.storages: dict[int, torch.UntypedStorage] = {}
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._copy
        pickler.dump(obj)
        self.pickled = buffer.getvalue()

    def _copy(self, obj) -> tuple[int, torch.dtype] | None:
        if not isinstance(obj, torch.storage.TypedStorage):
            return None  # pickled by value
        storage = obj._untyped_storage
        if storage._cdata not in self.storages:  # torch.save's own key: one entry per storage, however many views
            self.storages[storage._cdata] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        return storage._cdata, obj.dtype

    def restore(self):
        """The object graph again, its tensors on the copied storages."""
        unpickler = pickle.Unpickler(io.BytesIO(self.pickled))
        unpickler.persistent_load = lambda ref: torch.storage.TypedStorage(
            wrap_storage=self.storages[ref[0]], dtype=ref[1], _internal=True)
        return unpickler.load()


class BackgroundWriter(RecordingWriter):
    """The writer of an asynchronous save (``train.checkpoint_async``). On the training thread each file is only
    copied into host memory — the backend's state dicts as a :class:`HostSnapshot`, the other files as their bytes —
    and queued; a background thread writes them, fsyncs and digests them in order, as
    :class:`RecordingWriter` does, then calls ``finish`` with this writer. :meth:`close` queues the end of the save,
    :meth:`stop` an end cut short (``finish`` then sees an error)."""

    def __init__(self, rank: int, finish):
        super().__init__(rank)
        self.files: queue.SimpleQueue[tuple[Path, Callable[[Path], None]] | str] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(finish,), name="checkpoint-writer")
        self.thread.start()  # not a daemon: a process stopping on an error still finishes the save in flight

    def save(self, state: object, path: Path, save_file: Callable[[object, Path], None]) -> None:
        snapshot = HostSnapshot(state)  # the copy training waits for
        self.files.put((path, lambda p: save_file(snapshot.restore(), p)))

    def put(self, path: Path, data: bytes) -> None:
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


@dataclass
class InFlightSave:
    """An asynchronous save, from its hand-over to the background writer until every rank waited for it."""

    path: Path
    reason: str
    marker: dict | None  # what rank 0 commits (None on the other ranks)
    began: float  # time.perf_counter() at the start of the save
    step_s: float  # a training step's seconds, for the grace a save needs (:func:`log_save`)
    writer: BackgroundWriter | None = None
    stall: float = 0.0  # seconds the training thread spent in the save
    commit_error: str | None = None  # rank 0: why its writer could not commit (set on that thread)


class Checkpointer:
    """Saves and loads this run's checkpoints; made on every rank at the start of training, when rank 0 removes the
    directories that interrupted saves left behind."""

    def __init__(self, run_path: Path, cfg: RunConfig, signatures_hash: str | None, layout: dict,
                 param_names: list[str]):
        self.dir = run_path / "checkpoints"
        self.cfg, self.signatures_hash, self.layout = cfg, signatures_hash, layout
        self.universal = universal_info(param_names, cfg.model, layout["tp"], layout["pp"] > 1)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.scalars = ScalarCollectives()
        self.verified: set[Path] = set()
        self.deleter = BackgroundDeleter(self.dir) if self.rank == 0 else None
        self.in_flight: InFlightSave | None = None  # train.checkpoint_async: the save its writer is finishing
        if self.rank == 0:
            self._remove_interrupted_saves()
        dist.barrier()

    def _remove_interrupted_saves(self) -> None:
        for path in step_directories(self.dir):
            if not (path / MARKER).exists():
                log.warning("ignoring incomplete checkpoint %s (no %s: the save was interrupted); removing it",
                            path, MARKER)
                self.deleter.discard(path)

    def close(self) -> None:
        """At the end of training: rank 0 waits until the retired checkpoints are deleted (no other rank waits)."""
        if self.deleter is not None:
            self.deleter.finish()

    # ------------------------------------------------------------------ lineage
    def _latest_name(self) -> str | None:
        try:
            return (self.dir / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def latest(self) -> Path | None:
        """The newest complete checkpoint, None when there is none (``--resume auto`` continues from it when its files
        verify: :meth:`resumable`). It is the one ``latest`` names, since a resume from an older one sets the newer
        ones aside; they differ only when a crash fell between a checkpoint's ``complete.json`` and ``latest`` (warned
        about)."""
        found = self._complete_line()
        return found[-1] if found else None

    def _complete_line(self) -> list[Path]:
        """This run's complete checkpoints, oldest first, with a warning when ``latest`` does not name the newest."""
        found = complete_checkpoints(self.dir)
        name = self._latest_name()
        if found and name != found[-1].name and self.rank == 0:
            named = f"names {name!r}" if name else "is missing"
            log.warning("%s %s; resuming from the newest complete checkpoint, %s", self.dir / LATEST, named, found[-1])
        return found

    def resumable(self) -> Path | None:
        """``--resume auto``: the newest complete checkpoint whose files are as saved (every rank calls this), None
        when there is none. Newer ones whose files are damaged are moved to ``checkpoints/corrupt/<time>/`` (never
        deleted), each with a warning naming it; when no checkpoint verifies, nothing moves and the newest one's
        damage is raised."""
        intact, damaged = self._newest_intact(self._complete_line())
        if damaged and intact is None:
            raise CorruptCheckpoint(f"{damaged[0][1]}; no older checkpoint in {self.dir} verifies either: copy the "
                                    "damaged files back intact, or start over in a new --run-dir")
        if damaged and self.rank == 0:
            target = self._move_aside([path for path, _ in damaged], CORRUPT)
            for path, problem in damaged:
                log.warning("%s. Moved %s to %s; resuming from %s, the newest checkpoint that verifies", problem,
                            path.name, target, intact)
        return intact

    def continue_from(self, resumed: Path) -> None:
        """Make ``resumed`` the head of this run's line of checkpoints before training continues from it: rank 0
        moves the run's newer checkpoints (an abandoned line of training, which retention and ``--resume auto``
        would otherwise mix in) to ``checkpoints/abandoned/<time>/`` and points ``latest`` at ``resumed``."""
        if self.rank == 0:
            step = read_marker(resumed)["step"]
            newer = [p for p in step_directories(self.dir) if checkpoint_step(p) > step]
            if newer:
                self._set_aside(newer, f"they are newer than {resumed}, the checkpoint this run continues from")
            self._point_latest_at(resumed)
        dist.barrier()

    def _set_aside(self, paths: list[Path], why: str) -> Path:
        """Move checkpoints (and their conversions for other layouts) into a new ``abandoned/<time>`` folder."""
        target = self._move_aside(paths, ABANDONED)
        log.warning("moved %s to %s: %s (resume from one of them with --resume PATH, or delete them)",
                    ", ".join(p.name for p in paths), target, why)
        return target

    def _move_aside(self, paths: list[Path], folder: str) -> Path:
        """Move checkpoints (and their conversions for other layouts) into a new ``<folder>/<time>`` folder."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = self.dir / folder / stamp, 1
        while target.exists():
            target, n = self.dir / folder / f"{stamp}-{n}", n + 1
        target.mkdir(parents=True)
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
            _write_atomic(self.dir / LATEST, head)

    def _retire_old(self, saved: Path) -> None:
        """Delete the complete checkpoints before the newest ``train.keep_checkpoints`` (``saved`` among them)."""
        self._discard_all(self._beyond_retention(checkpoint_step(saved), self.cfg.train.keep_checkpoints - 1))

    def _beyond_retention(self, step: int, kept: int) -> list[Path]:
        """The complete checkpoints before ``step`` but the newest ``kept`` of them, oldest first."""
        older = [p for p in complete_checkpoints(self.dir) if checkpoint_step(p) < step]
        return older[: max(0, len(older) - kept)]

    def _discard_all(self, paths: list[Path]) -> None:
        for old in paths:
            try:
                self.deleter.discard(old)
            except OSError as e:
                log.warning("could not delete the old checkpoint %s (%s); delete it by hand", old, e)

    def _retire_to_fit(self, path: Path) -> None:
        """Rank 0, before saving ``path``: when the free space is less than the newest checkpoint's size, retention
        runs now instead of after the save, and is waited for — if deleting what ``train.keep_checkpoints`` lets go
        makes room. The newest checkpoint always stays (the save may still fail), and nothing is deleted in vain."""
        found = complete_checkpoints(self.dir)
        if not found or (need := checkpoint_bytes(found[-1])) <= free_bytes(self.dir):
            return
        self.deleter.finish()  # what earlier deletes left pending frees space too
        free = free_bytes(self.dir)
        retired = self._beyond_retention(checkpoint_step(path), max(1, self.cfg.train.keep_checkpoints - 1))
        if need <= free or free + sum(map(checkpoint_bytes, retired)) < need:
            return
        log.warning("deleting %s before saving %s to make room (train.keep_checkpoints=%d): a checkpoint takes "
                    "about %s, %s are free", ", ".join(p.name for p in retired), path.name,
                    self.cfg.train.keep_checkpoints, readable_size(need), readable_size(free))
        self._discard_all(retired)
        self.deleter.finish()

    def _keep_that_fits(self, found: list[Path], free: int) -> int | None:
        """The highest ``train.keep_checkpoints`` whose deletes before a save (:meth:`_retire_to_fit`) make room for
        a checkpoint the size of the newest of ``found``, or None when even 1 would not."""
        need, freed = checkpoint_bytes(found[-1]), free
        for deleted, old in enumerate(found[:-1], start=1):
            freed += checkpoint_bytes(old)
            if freed >= need:
                return len(found) - deleted + 1
        return None

    # ------------------------------------------------------------------ save
    def save(self, trainer: Trainer, step: int, tokens: int, reader_state: dict, reason: str,
             step_s: float = 0.0) -> Path:
        """Write ``trainer``'s checkpoint ``step`` (every rank calls this); a failure on any rank raises CheckpointError
        on all. With ``train.checkpoint_async`` this returns once this rank's files are in host memory, and the save
        ends in the background; the save still in flight is waited for first (:meth:`wait`), so one is in flight at
        most."""
        began = time.perf_counter()
        self.wait()
        path = self.dir / f"step-{step:08d}"
        if self.rank == 0:
            self._clear_for_save(path)
        dist.barrier()
        client = {
            "step": step, "tokens": tokens, "reader": reader_state, "config": self.cfg.model_dump(mode="json"),
            "signatures_hash": self.signatures_hash, "code_version": __version__, "layout": self.layout,
            "universal_checkpoint_info": self.universal,
        }
        marker = None
        if self.rank == 0:
            marker = {"step": step, "tokens": tokens, "reason": reason, "model": client["config"]["model"],
                      "config": client["config"],  # what a resume from config.yaml is checked against
                      "signatures_hash": self.signatures_hash, "layout": self.layout, "code_version": __version__}
        if self.cfg.train.checkpoint_async:
            self._hand_over(trainer, client, InFlightSave(path, reason, marker, began, step_s))
            return path
        writer = RecordingWriter(self.rank)
        self._write_files(trainer, path, client, writer)
        self._write_digests(path, writer)
        pause_save()
        self._agree_on_writes(path, writer.error)
        error = self._commit(path, marker) if self.rank == 0 else None
        self._agree_on_commit(path, error)
        if self.rank == 0:
            log_save(path, reason, time.perf_counter() - began, step_s=step_s)
        return path

    def _hand_over(self, trainer: Trainer, client: dict, save: InFlightSave) -> None:
        """An asynchronous save: this rank's files into host memory, handed to a background writer that writes them,
        reports to rank 0 and (rank 0) commits; the save stays in flight until :meth:`wait`."""
        save.writer = BackgroundWriter(self.rank, lambda _: self._finish_in_background(save))
        self.in_flight = save
        try:
            self._write_files(trainer, save.path, client, save.writer)
        except BaseException:
            save.writer.stop()
            raise
        save.stall = time.perf_counter() - save.began
        save.writer.close()

    def _finish_in_background(self, save: InFlightSave) -> None:
        """The writer thread, once this rank's files are written: its report to rank 0 (its digests file, as a
        synchronous save writes it, or an empty failed-rank file); rank 0 then waits for every rank's report and,
        when none failed, commits as a synchronous save does."""
        writer = save.writer
        self._write_digests(save.path, writer)
        pause_save()
        if writer.error is not None:
            with contextlib.suppress(OSError):  # not even an empty file fits: rank 0 stops waiting at its timeout
                (save.path / RANK_FAILED.format(self.rank)).touch()
            return
        if self.rank != 0:
            return
        try:
            if not self._await_reports(save.path):
                return  # a rank's part failed: the wait fails the save on every rank
            save.commit_error = self._commit(save.path, save.marker)
        except Exception as e:  # a rank that never reported, or a fault of its own: the save fails at the wait
            save.commit_error = f"finishing the save failed ({e})"
        if save.commit_error is None:
            log_save(save.path, save.reason, save.stall, time.perf_counter() - save.began - save.stall, save.step_s)

    def _await_reports(self, path: Path) -> bool:
        """Rank 0's writer thread: whether every rank wrote its part, once each reported (its digests file, or a
        failed-rank file). Files, not collectives: the training threads may be in theirs. A rank silent for
        ``train.dist_timeout_minutes`` is an error."""
        waiting = set(range(self.world))
        deadline = time.monotonic() + self.cfg.train.dist_timeout_minutes * 60
        while True:
            if any((path / RANK_FAILED.format(r)).exists() for r in waiting):
                return False
            waiting = {r for r in waiting if not (path / RANK_DIGESTS.format(r)).exists()}
            if not waiting:
                return True
            if time.monotonic() > deadline:
                raise CheckpointError(f"rank {min(waiting)} did not report its part within "
                                      f"train.dist_timeout_minutes ({self.cfg.train.dist_timeout_minutes:g})")
            time.sleep(REPORT_POLL_SECONDS)

    def wait(self) -> None:
        """Every rank, before the next save and at the end of training: wait for the asynchronous save in flight,
        then agree on its outcome as after a synchronous save (a failure on any rank raises CheckpointError on
        all, the incomplete directory removed)."""
        if (save := self.in_flight) is None:
            return
        self.in_flight = None
        save.writer.thread.join()
        self._agree_on_writes(save.path, save.writer.error)
        self._agree_on_commit(save.path, save.commit_error)

    def _clear_for_save(self, path: Path) -> None:
        """Rank 0: make room for ``path`` — leftovers of an interrupted save of this step are removed; a directory
        with a marker (complete, or malformed but perhaps intact) is set aside, never deleted; older checkpoints are
        retired first when the disk has no room for another (:meth:`_retire_to_fit`)."""
        if (path / MARKER).exists():
            self._set_aside([path], "a new save of the same step replaces it")
        elif path.exists():
            self.deleter.discard(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._retire_to_fit(path)

    def _write_files(self, trainer: Trainer, path: Path, client: dict, writer: RecordingWriter) -> None:
        """This rank's part of the checkpoint through ``writer``: the backend's files, the RNG state and (rank 0,
        ``model.engram.offload``) the host tables."""
        trainer.save_files(path, client, writer)
        writer.put(path / RNG_FILE.format(self.rank), rng_state_bytes(cuda=trainer.device.type == "cuda"))
        if trainer.host_tables is not None and self.rank == 0:  # tp = pp = 1: every rank holds the same host tables
            tensors, metadata = trainer.host_tables.state()
            writer.put(path / HOST_TABLES_FILE, save(tensors, metadata=metadata))

    def _write_digests(self, path: Path, writer: RecordingWriter) -> None:
        """This rank's report to rank 0: the digests of the files it wrote, which rank 0 merges into the marker (and
        then deletes: an asynchronous save's rank 0 does so as soon as the report appears)."""
        digests = {str(p.relative_to(path)): d for p, d in writer.digests.items() if p.is_relative_to(path)}
        writer.report(path / RANK_DIGESTS.format(self.rank), json.dumps(digests))

    def _agree_on_writes(self, path: Path, error: str | None) -> None:
        """Every rank, once each wrote its files: a failure on any rank fails the save on all."""
        if failed := self._ranks_where(error is not None):
            self._fail_save(path, failed, error)

    def _agree_on_commit(self, path: Path, error: str | None) -> None:
        """Every rank, once rank 0 committed (or failed to): its failure fails the save on all."""
        if self.scalars.any(error is not None)[0]:
            self._fail_save(path, [0], error)

    def _ranks_where(self, flag: bool) -> list[int]:
        """The ranks on which ``flag`` holds (the same list on every rank)."""
        raised = [0.0] * self.world
        raised[self.rank] = float(flag)
        return [r for r, v in enumerate(self.scalars.sum(raised)) if v]

    def _commit(self, path: Path, marker: dict) -> str | None:
        """Rank 0, once every rank wrote its files: the marker (every file's size and digest), ``latest``, then
        retention. Returns what failed, or None."""
        try:
            digests = {}
            for part in sorted(path.glob(RANK_DIGESTS.replace("{:05d}", "*"))):
                digests |= json.loads(part.read_text())
                part.unlink()
            files = sorted(p for p in path.rglob("*") if p.is_file())
            names = [str(f.relative_to(path)) for f in files]
            unknown = [f for f, name in zip(files, names) if name not in digests]  # not written through a writer
            for f in unknown:
                _fsync(f)
            digests |= {str(f.relative_to(path)): d for f, d in zip(unknown, file_digests(unknown))}
            marker |= {"files": {n: f.stat().st_size for n, f in zip(names, files)},
                       "digest_algorithm": DIGEST, "digests": {n: digests[n] for n in names}}
            _write_atomic(path / MARKER, json.dumps(marker, indent=1))
            _write_atomic(self.dir / LATEST, path.name)
        except (OSError, ValueError) as e:
            return f"finishing the save failed ({e})"
        self._retire_old(path)
        return None

    def _fail_save(self, path: Path, failed: list[int], error: str | None) -> None:
        """Every rank, after they agreed a save failed: rank 0 removes what was written; all raise the same error."""
        if self.rank == 0:
            if path.exists():
                self.deleter.discard(path)
                self.deleter.finish()  # so that the free space the message names counts the removed files
            (self.dir / (LATEST + ".tmp")).unlink(missing_ok=True)
        dist.barrier()
        raise CheckpointError(self._failure_message(path, failed, error))

    def _failure_message(self, path: Path, failed: list[int], error: str | None) -> str:
        ranks = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        cause = f"{ranks}: {error}" if error else f"{ranks} could not write its part (see its message)"
        previous, free = complete_checkpoints(self.dir), free_bytes(self.dir)
        if previous:
            need = f"about {readable_size(checkpoint_bytes(previous[-1]))} (the size of {previous[-1].name})"
            resume = f"{previous[-1]} stays the newest checkpoint"
        else:
            need, resume = "an unknown amount (the run has no earlier checkpoint to measure)", "the run has none yet"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limited = limit != resource.RLIM_INFINITY
        return (f"could not save checkpoint {path}: {cause}. A checkpoint takes {need}; {readable_size(free)} are free "
                "on its filesystem" + (f", and this process may write files of at most {readable_size(limit)} "
                                       "(ulimit -f)" if limited else "")
                + f". The incomplete {path.name} was removed and {resume}: {self._space_fix(previous, free, limited)}")

    def _space_fix(self, previous: list[Path], free: int, limited: bool) -> str:
        """How to make room for the next save: free space (or raise ``ulimit -f``), or rerun with a lower
        ``train.keep_checkpoints`` when the deletes it allows before a save would make room."""
        fix = "free space" + (" (or raise ulimit -f)" if limited else "")
        if not previous or checkpoint_bytes(previous[-1]) <= free:
            return f"{fix}, then rerun to resume (--resume auto)"
        if (keep := self._keep_that_fits(previous, free)) is None:
            return (f"{fix}, then rerun to resume (--resume auto); deleting older checkpoints would not make room "
                    f"({previous[-1].name}, the newest, is always kept)")
        return (f"{fix} and rerun to resume (--resume auto), or rerun with --set train.keep_checkpoints={keep} (older "
                f"checkpoints are then deleted before the save, {previous[-1].name} kept)")

    # ------------------------------------------------------------------ load
    def verify(self, path: Path) -> dict:
        """The checkpoint's marker, after checking it is complete, unchanged since it was saved (every file's size
        and digest, the files shared among the ranks) and of this model and vocabulary. Every rank calls this."""
        marker = read_marker(path)
        if self.rank == 0:
            warn_if_without_digests(path, marker)
        if path not in self.verified:  # a fallback of --resume auto checked it already
            self._check_files_together(path, marker)
        if marker["signatures_hash"] != self.signatures_hash:
            raise CheckpointError(
                f"checkpoint {path} was trained with signature table {str(marker['signatures_hash'])[:12]}, this run "
                f"has {str(self.signatures_hash)[:12]}: use the run's own signatures/ (or expand-vocab to extend it)")
        ours = _model_identity(self.cfg.model.model_dump(mode="json"))
        theirs = _model_identity(_as_written_now(marker["model"]))
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            details = "; ".join(f"model.{k}: checkpoint {theirs.get(k)!r}, config {ours.get(k)!r}" for k in differ)
            raise CheckpointError(f"checkpoint {path} is of another model ({details}); resume with its config")
        return marker

    def _check_files_together(self, path: Path, marker: dict) -> None:
        """Raise :class:`CorruptCheckpoint` when a file differs from what was saved, naming the newest of this run's
        other checkpoints that verifies."""
        if (problem := self._damage_together(path, marker)) is None:
            return
        others = [p for p in complete_checkpoints(self.dir) if p.resolve() != path.resolve()]
        raise CorruptCheckpoint(problem + intact_note(self._newest_intact(others)[0], self.dir))

    def _damage_together(self, path: Path, marker: dict) -> str | None:
        """What is wrong with the checkpoint's files, or None (then it counts as verified): each rank checks every
        world-th file and the ranks sum what they found, so every rank names the same one."""
        names = sorted(marker["files"])
        found = file_problems(path, marker, names[self.rank::self.world])
        codes = self.scalars.sum([float(found.get(n, 0)) for n in names])
        problem = describe_problems(path, marker, {n: int(c) for n, c in zip(names, codes) if c})
        if problem is None:
            self.verified.add(path)
        return problem

    def _newest_intact(self, candidates: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
        """(the newest of ``candidates`` whose files are as saved, or None; the newer damaged ones, newest first,
        each with what is wrong). Every rank calls this."""
        damaged = []
        for path in reversed(candidates):
            if (problem := self._damage_together(path, read_marker(path))) is None:
                return path, damaged
            damaged.append((path, problem))
        return None, damaged

    def for_this_layout(self, path: Path, zero3: bool) -> tuple[Path, bool]:
        """(checkpoint to load, whether it is universal): a checkpoint of another tp/pp/dp layout is converted
        once by rank 0 into ``checkpoints/universal/<tag>`` (DeepSpeed's universal format), then loaded from there;
        a conversion of another checkpoint of the same name (an abandoned line) is redone. The other ranks wait for
        the conversion outside any collective (:func:`on_rank0`): it takes as long as the checkpoint is large.
        ``zero3``: this run's engine is ZeRO-3, which DeepSpeed 0.19.8 cannot load a pipeline checkpoint's
        conversion into (it looks for per-rank ZeRO-3 model-state files the conversion does not have): refused
        with the layouts that do resume it."""
        marker = self.verify(path)
        if marker["layout"] == self.layout:
            return path, False
        if zero3 and marker["layout"]["pp"] > 1:
            raise CheckpointError(
                f"checkpoint {path} was saved by a pipeline (pp={marker['layout']['pp']}); DeepSpeed converts it for "
                "ZeRO-1/2 but cannot load it under ZeRO-3: resume with --set parallel.zero_stage=1 (or with pp > 1), "
                "then switch to ZeRO-3 from a checkpoint that run saves")
        target = self.dir / UNIVERSAL / path.name
        source = hashlib.new(DIGEST, (path / MARKER).read_bytes()).hexdigest()

        def convert() -> None:
            if self._converted(target, source):
                return
            if target.exists():
                self.deleter.discard(target)
            tqdm.write(f"converting {path} for this layout ({marker['layout']} -> {self.layout})")
            convert_for_layout(path, target, marker["layout"]["pp"] > 1, self.layout["pp"] > 1,
                               self.cfg.model.n_layers)
            pause_conversion()
            _write_atomic(target / MARKER, json.dumps(
                marker | {"universal": True, "source": str(path), "source_marker": source}, indent=1))

        on_rank0(convert, self.dir / UNIVERSAL, path.name, self.scalars, CheckpointError)
        return target, True

    @staticmethod
    def _converted(target: Path, source: str) -> bool:
        if marker_problem(target) is not None:
            return False
        return json.loads((target / MARKER).read_text()).get("source_marker") == source

    def _load_host_tables(self, host_tables: HostTablesStep, path: Path, marker: dict) -> None:
        """The offloaded Engram tables and their AdamW state (from the source of a universal conversion)."""
        source = Path(marker["source"]) if marker.get("universal") else path
        try:
            tensors = load_file(str(source / HOST_TABLES_FILE))
        except Exception as e:  # missing (a run without model.engram.offload) or unreadable
            raise CheckpointError(f"checkpoint {source} has no readable {HOST_TABLES_FILE} ({e}), which "
                                  "model.engram.offload needs; resume with the config it was saved with") from e
        host_tables.load(tensors)

    def load(self, trainer: Trainer, path: Path) -> dict:
        """Load ``trainer``'s model, optimizer, scheduler and (same layout only) this rank's RNG state; returns the
        client state."""
        marker = read_marker(path)
        if not marker.get("universal") and path not in self.verified:
            self.verify(path)
        client = trainer.load_files(path, bool(marker.get("universal")))
        if client is None:
            raise CheckpointError(f"DeepSpeed could not load {path}; see the log above")
        if trainer.host_tables is not None:
            self._load_host_tables(trainer.host_tables, path, marker)
        if marker["layout"] == self.layout:
            cuda = trainer.device.type == "cuda"
            if (rng := path / RNG_FILE.format(self.rank)).is_file():
                set_rng_state(read_rng_state(rng), cuda)
            elif (legacy := path / LEGACY_RNG_FILE.format(self.rank)).is_file():
                set_rng_state(read_legacy_rng_state(legacy), cuda)
        return client


def _model_identity(model: dict) -> dict:
    """A model section without ``engram.offload_update``: how the host tables step, not what the model is (both
    rules keep the same AdamW state, so a checkpoint resumes with either)."""
    if isinstance(model.get("engram"), dict):
        return model | {"engram": {k: v for k, v in model["engram"].items() if k != "offload_update"}}
    return model


def _as_written_now(model: dict) -> dict:
    """A marker's model section as this version writes it (a former spelling, such as the Engram hash mode
    ``seed``, reads as today's); one that no longer validates is compared as stored, naming what differs."""
    try:
        return ModelConfig.model_validate(model).model_dump(mode="json")
    except ValidationError:
        return model
