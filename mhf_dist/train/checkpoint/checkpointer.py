"""The checkpointer: every rank's save (synchronous, or handed to a background writer), rank 0's commit (the
``complete.json`` marker, then ``latest``, then retention), the ranks' agreement on a save's outcome, and the
verification, conversion for another layout and load of a checkpoint. The files it writes are the backend's (with the
client state, :mod:`~mhf_dist.train.client_state`, inside), the RNG states (:mod:`~mhf_dist.train.checkpoint.rng`)
and the host tables; the marker's format is
:mod:`~mhf_dist.train.checkpoint.index`, the line of checkpoints :mod:`~mhf_dist.train.checkpoint.lineage`.
docs/design-training.md, "Checkpoints", says how a save is made atomic and verified."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import ValidationError
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from mhf_dist import __version__
from mhf_dist.atomic import fsync, write_atomic
from mhf_dist.backend import Trainer, convert_for_layout, universal_info, versions
from mhf_dist.config import ModelConfig, RunConfig
from mhf_dist.parallel.rank0_work import on_rank0
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import (
    CORRUPT,
    DIGEST,
    LATEST,
    MARKER,
    CheckpointError,
    CorruptCheckpoint,
    checkpoint_bytes,
    complete_checkpoints,
    describe_problems,
    file_digests,
    file_problems,
    intact_note,
    marker_problem,
    read_marker,
    readable_size,
    version_note,
    warn_if_without_digests,
)
from mhf_dist.train.checkpoint.lineage import UNIVERSAL, BackgroundDeleter, Lineage
from mhf_dist.train.checkpoint.rng import (
    LEGACY_RNG_FILE,
    RNG_FILE,
    read_legacy_rng_state,
    read_rng_state,
    rng_state_bytes,
    set_rng_state,
)
from mhf_dist.train.checkpoint.writers import BackgroundWriter, RecordingWriter
from mhf_dist.train.client_state import ClientState
from mhf_dist.train.fault_injection import free_bytes, pause_conversion, pause_save
from mhf_dist.train.host_tables import HOST_TABLES_FILE, HostTablesStep
from mhf_dist.train.preemption import GRACE_ENV, grace_seconds

log = logging.getLogger(__name__)

RANK_DIGESTS = "digests-rank{:05d}.json"  # each rank's digests during a save, merged into the marker by rank 0
RANK_FAILED = "failed-rank{:05d}"  # an asynchronous save's report of a rank whose part failed (empty: fits a full disk)
REPORT_POLL_SECONDS = 0.1  # how often rank 0's writer looks for the other ranks' reports


def log_save(path: Path, reason: str, stall: float, background: float | None = None, step_s: float = 0.0) -> None:
    """Rank 0: the save with its size, duration (an asynchronous save's ``stall`` of training and its ``background``
    time) and write rate; a warning when a step (``step_s``) and a save like this one would not fit in the job's grace
    period (the time between the scheduler's warning signal and the time limit), naming the grace that would
    (:func:`~mhf_dist.train.preemption.grace_seconds`)."""
    seconds = stall if background is None else stall + background
    size = checkpoint_bytes(path)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # the nodes of the job (its scheduler or launcher says)
    per_node = size / max(seconds, 1e-9) / nodes / 1e9
    took = f"{stall:.1f} s" if background is None else f"{stall:.1f} s stall, {background:.1f} s in the background"
    tqdm.write(f"saved {path} ({reason}, {readable_size(size)} in {took}, {per_node:.3g} GB/s per node)")
    grace = float(os.environ.get(GRACE_ENV, "inf"))
    if (needed := grace_seconds(step_s, seconds)) > grace:
        tqdm.write(f"warning: a save on SLURM's signal (the step in progress, {step_s:.1f} s, then a save like this "
                   f"one) needs a grace of about {needed} s, and this job has {grace:.0f} s: submit with --grace "
                   f"{needed}, or set storage_gb_per_s: {per_node:.3g} (this save's rate) in the cluster profile, "
                   "from which submit sizes the grace")


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


class Checkpointer(Lineage):
    """Saves and loads this run's checkpoints; made on every rank at the start of training, when rank 0 removes the
    directories that interrupted saves left behind."""

    def __init__(self, run: RunDir, cfg: RunConfig, signatures_hash: str | None, layout: dict,
                 param_names: list[str]):
        self.dir = run.checkpoints_dir
        self.cfg, self.signatures_hash, self.layout = cfg, signatures_hash, layout
        self.universal = universal_info(param_names, cfg.model, layout["tp"], layout["pp"] > 1)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.scalars = ScalarCollectives()
        self.verified: set[Path] = set()
        self.deleter = BackgroundDeleter(self.dir) if self.rank == 0 else None
        self.in_flight: InFlightSave | None = None  # train.checkpoint_async: the save its writer is finishing
        self.versions = {"mhf_dist": __version__, "torch": torch.__version__} | versions()
        if self.rank == 0:
            self._remove_interrupted_saves()
        dist.barrier()

    def close(self) -> None:
        """At the end of training: rank 0 waits until the retired checkpoints are deleted (no other rank waits)."""
        if self.deleter is not None:
            self.deleter.finish()

    def state_dict(self) -> dict:
        """The checkpointer's part of the client state: what a checkpoint was saved with (the run config, the
        signature table's hash, the code version, the layout, and each parameter's split for a conversion)."""
        return {"config": self.cfg.model_dump(mode="json"), "signatures_hash": self.signatures_hash,
                "code_version": __version__, "layout": self.layout, "universal_checkpoint_info": self.universal}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to take: a resume reads the saved config in the client state :meth:`load` returns."""

    # ------------------------------------------------------------------ save
    def save(self, trainer: Trainer, state: ClientState, reason: str, step_s: float = 0.0) -> Path:
        """Write ``trainer``'s checkpoint of the step ``state`` holds (every rank calls this), with every registered
        part of the client state; a failure on any rank raises CheckpointError on all. With
        ``train.checkpoint_async`` this returns once this rank's files are in host memory, and the save ends in the
        background; the save still in flight is waited for first (:meth:`wait`), so one is in flight at most.
        ``step_s``: a step's seconds, for the grace a save needs (:func:`log_save`)."""
        began = time.perf_counter()
        self.wait()
        client = state.state_dict()
        step = client["step"]
        path = self.dir / f"step-{step:08d}"
        if self.rank == 0:
            self._clear_for_save(path)
        dist.barrier()
        marker = None
        if self.rank == 0:
            marker = {"step": step, "tokens": client["tokens"], "reason": reason, "model": client["config"]["model"],
                      "config": client["config"],  # what a resume from config.yaml is checked against
                      "signatures_hash": self.signatures_hash, "layout": self.layout, "code_version": __version__,
                      "versions": self.versions}
        if self.cfg.train.checkpoint_async:
            self._hand_over(trainer, client, InFlightSave(path, reason, marker, began, step_s))
            return path
        writer = RecordingWriter(self.rank)
        self._write_files(trainer, path, client, writer)
        self._write_digests(path, writer)
        pause_save()
        size = self._agree_on_writes(path, writer)
        error = self._commit(path, marker) if self.rank == 0 else None
        self._agree_on_commit(path, error, size)
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
        size = self._agree_on_writes(save.path, save.writer)
        self._agree_on_commit(save.path, save.commit_error, size)

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

    def _agree_on_writes(self, path: Path, writer: RecordingWriter) -> float:
        """Every rank, once each wrote its files: a failure on any rank fails the save on all. Returns the bytes of
        every rank's part, written or not (what the checkpoint takes)."""
        raised = [0.0] * self.world
        raised[self.rank] = float(writer.error is not None)
        *raised, size = self.scalars.sum(raised + [float(writer.bytes)])
        if failed := [r for r, v in enumerate(raised) if v]:
            self._fail_save(path, failed, writer.error, size)
        return size

    def _agree_on_commit(self, path: Path, error: str | None, size: float) -> None:
        """Every rank, once rank 0 committed (or failed to): its failure fails the save on all."""
        if self.scalars.any(error is not None)[0]:
            self._fail_save(path, [0], error, size)

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
                fsync(f)
            digests |= {str(f.relative_to(path)): d for f, d in zip(unknown, file_digests(unknown))}
            marker |= {"files": {n: f.stat().st_size for n, f in zip(names, files)},
                       "digest_algorithm": DIGEST, "digests": {n: digests[n] for n in names}}
            write_atomic(path / MARKER, json.dumps(marker, indent=1))
            write_atomic(self.dir / LATEST, path.name)
        except (OSError, ValueError) as e:
            return f"finishing the save failed ({e})"
        self._retire_old(path)
        return None

    def _fail_save(self, path: Path, failed: list[int], error: str | None, size: float) -> None:
        """Every rank, after they agreed a save failed: rank 0 removes what was written; all raise the same error."""
        if self.rank == 0:
            self.deleter.finish()  # so that the free space the message names counts what was deleted before
            # not moved aside first: on a full disk not even a directory fits; what stays, the next start removes
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(self._failure_message(path, failed, error, size))

    def _failure_message(self, path: Path, failed: list[int], error: str | None, size: float) -> str:
        ranks = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        cause = f"{ranks}: {error}" if error else f"{ranks} could not write its part (see its message)"
        previous, free = complete_checkpoints(self.dir), free_bytes(self.dir)
        resume = f"{previous[-1]} stays the newest checkpoint" if previous else "the run has none yet"
        if error and any(f"[Errno {code}]" in error for code in (errno.EROFS, errno.EACCES, errno.EPERM)):
            return (f"could not save checkpoint {path}: {cause}. Nothing of {path.name} stays and {resume}: make "
                    f"{self.dir} writable, then rerun to resume (--resume auto)")  # no space to free
        if previous:
            need = f"about {readable_size(checkpoint_bytes(previous[-1]))} (the size of {previous[-1].name})"
        else:
            need = f"about {readable_size(size)} (this save's files)"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limited = limit != resource.RLIM_INFINITY
        return (f"could not save checkpoint {path}: {cause}. A checkpoint takes {need}; {readable_size(free)} are free "
                "on its filesystem" + (f", and this process may write files of at most {readable_size(limit)} "
                                       "(ulimit -f)" if limited else "")
                + f". The incomplete {path.name} was removed and {resume}: {self._space_fix(previous, free, limited)}")

    # ------------------------------------------------------------------ load
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
            convert_for_layout(path, target, marker["layout"]["pp"] > 1, self.layout["pp"] > 1, self.cfg.model,
                               self.layout["tp"] if zero3 else 1)
            pause_conversion()
            write_atomic(target / MARKER, json.dumps(
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

    def load(self, trainer: Trainer, path: Path, state: ClientState) -> dict:
        """Load ``trainer``'s model, optimizer, scheduler, (same layout only) this rank's RNG state and every part of
        ``state``: the one way a resume and a rollback load a checkpoint. Returns the client state."""
        marker = read_marker(path)
        if not marker.get("universal") and path not in self.verified:
            self.verify(path)
        client = trainer.load_files(path, bool(marker.get("universal")))
        if client is None:
            raise CheckpointError(f"DeepSpeed could not load {path}; see the log above")
        if self.rank == 0 and (note := version_note(path, marker, self.versions)):
            tqdm.write(note)
        if trainer.host_tables is not None:
            self._load_host_tables(trainer.host_tables, path, marker)
        if marker["layout"] == self.layout:
            cuda = trainer.device.type == "cuda"
            if (rng := path / RNG_FILE.format(self.rank)).is_file():
                set_rng_state(read_rng_state(rng), cuda)
            elif (legacy := path / LEGACY_RNG_FILE.format(self.rank)).is_file():
                set_rng_state(read_legacy_rng_state(legacy), cuda)
        state.load_state_dict(client)
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
