"""The checkpointer: every rank's save (synchronous, or handed to a background writer), rank 0's commit (the
``complete.json`` marker, then ``latest``, then retention) and the ranks' agreement on a save's outcome. The files it
writes are the backend's (with the client state, ``client_state``, inside), the RNG states
(``rng``) and the host tables; the marker's format is
``index``, the line of checkpoints ``lineage``, and the
verification, conversion for another layout and load of a checkpoint ``reading``.
docs/design-training.md, "Checkpoints", says how a save is made atomic and verified."""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save

from mhf_dist import __version__
from mhf_dist.atomic import fsync, write_atomic
from mhf_dist.backend import Trainer, universal_info, versions
from mhf_dist.config import RunConfig
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import (
    DIGEST,
    LATEST,
    MARKER,
    CheckpointError,
    checkpoint_bytes,
    complete_checkpoints,
    file_digests,
    readable_size,
)
from mhf_dist.train.checkpoint.lineage import BackgroundDeleter
from mhf_dist.train.checkpoint.reading import Reading
from mhf_dist.train.checkpoint.rng import RNG_FILE, rng_state_bytes
from mhf_dist.train.checkpoint.save_log import log_save
from mhf_dist.train.checkpoint.store import checkpoint_store, local_share
from mhf_dist.train.checkpoint.writers import BackgroundWriter, RecordingWriter
from mhf_dist.train.client_state import ClientState
from mhf_dist.train.fault_injection import free_bytes, pause_save

RANK_DIGESTS = (
    "digests-rank{:05d}.json"  # each rank's digests during a save, merged into the marker by rank 0
)
RANK_FAILED = "failed-rank{:05d}"  # an asynchronous save's report of a rank whose part failed (empty: fits a full disk)
REPORT_POLL_SECONDS = 0.1  # how often rank 0's writer looks for the other ranks' reports


@dataclass
class InFlightSave:
    """An asynchronous save, from its hand-over to the background writer until every rank waited for it."""

    path: Path
    reason: str
    marker: dict | None  # what rank 0 commits (None on the other ranks)
    began: float  # time.perf_counter() at the start of the save
    step_s: float  # a training step's seconds, for the grace a save needs (``log_save``)
    writer: BackgroundWriter | None = None
    stall: float = 0.0  # seconds the training thread spent in the save
    commit_error: str | None = None  # rank 0: why its writer could not commit (set on that thread)


class Checkpointer(Reading):
    """Saves and loads this run's checkpoints; made on every rank at the start of training, when rank 0 removes the
    directories that interrupted saves left behind."""

    def __init__(
        self,
        run: RunDir,
        cfg: RunConfig,
        signatures_hash: str | None,
        layout: dict,
        param_names: list[str],
    ):
        self.store = checkpoint_store(run, cfg.train)
        self.dir = self.store.local  # RUN/checkpoints, or the staging directory of a remote store
        self.cfg, self.signatures_hash, self.layout = cfg, signatures_hash, layout
        self.universal = universal_info(param_names, cfg.model, layout["tp"], layout["pp"] > 1)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.scalars = ScalarCollectives()
        self.verified: set[Path] = set()
        self.deleter = BackgroundDeleter(self.dir) if self.rank == 0 else None
        self.in_flight: InFlightSave | None = (
            None  # train.checkpoint_async: the save its writer is finishing
        )
        self.versions = {"mhf_dist": __version__, "torch": torch.__version__} | versions()
        if self.store.url is not None:
            self._open_store()
        if self.rank == 0:
            self._remove_interrupted_saves()
        dist.barrier()

    def _open_store(self) -> None:
        """A remote store, at the start (every rank): it can be reached, and the staging directory of each node
        shows its checkpoints (one rank per node copies their markers)."""
        error = None
        try:
            self.store.check()
            if local_share()[0] == 0:
                self.store.mirror()
        except CheckpointError as e:
            error = e
        if self.scalars.any(error is not None)[0]:
            raise error or CheckpointError(
                f"another rank could not use train.checkpoint_dir={self.store.url} (see its message)"
            )

    def close(self) -> None:
        """At the end of training: rank 0 waits until the retired checkpoints are deleted (no other rank waits)."""
        if self.deleter is not None:
            self.deleter.finish()

    def state_dict(self) -> dict:
        """The checkpointer's part of the client state: what a checkpoint was saved with (the run config, the
        signature table's hash, the code version, the layout, and each parameter's split for a conversion)."""
        return {
            "config": self.cfg.model_dump(mode="json"),
            "signatures_hash": self.signatures_hash,
            "code_version": __version__,
            "layout": self.layout,
            "universal_checkpoint_info": self.universal,
        }

    def load_state_dict(self, state: dict) -> None:
        """Nothing to take: a resume reads the saved config in the client state ``load`` returns."""

    # ------------------------------------------------------------------ save
    def save(self, trainer: Trainer, state: ClientState, reason: str, step_s: float = 0.0) -> Path:
        """Write ``trainer``'s checkpoint of the step ``state`` holds (every rank calls this), with every registered
        part of the client state; a failure on any rank raises CheckpointError on all. With
        ``train.checkpoint_async`` this returns once this rank's files are in host memory, and the save ends in the
        background; the save still in flight is waited for first (``wait``), so one is in flight at most.
        ``step_s``: a step's seconds, for the grace a save needs (``log_save``)."""
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
            marker = {
                "step": step,
                "tokens": client["tokens"],
                "reason": reason,
                "model": client["config"]["model"],
                "config": client["config"],  # what a resume from config.yaml is checked against
                "signatures_hash": self.signatures_hash,
                "layout": self.layout,
                "code_version": __version__,
                "versions": self.versions,
            }
        if self.cfg.train.checkpoint_async:
            self._hand_over(trainer, client, InFlightSave(path, reason, marker, began, step_s))
            return path
        writer = RecordingWriter(self.rank)
        self._write_files(trainer, path, client, writer)
        if self.store.url is None:
            self._write_digests(path, writer)
        pause_save()
        self._upload(path, writer)
        size = self._agree_on_writes(path, writer)
        reports = self._gather_reports(path, writer) if self.store.url is not None else None
        error = self._commit(path, marker, reports) if self.rank == 0 else None
        self._agree_on_commit(path, error, size)
        self.share_line()
        if self.rank == 0:
            shown = self.store.where(path)
            log_save(path, reason, time.perf_counter() - began, step_s=step_s, shown=shown)
        return path

    @staticmethod
    def _own_files(path: Path, writer: RecordingWriter) -> dict[Path, str]:
        """{file: digest} of the files of ``path`` this rank wrote."""
        return {p: d for p, d in writer.digests.items() if p.is_relative_to(path)}

    def _upload(self, path: Path, writer: RecordingWriter) -> None:
        """A remote store: this rank's files of ``path`` uploaded unless its writes failed (an upload that fails is
        the writer's error); nothing to do for local checkpoints."""
        if writer.error is None:
            writer.error = self.store.upload(path, sorted(self._own_files(path, writer)))

    def _files_report(self, path: Path, writer: RecordingWriter) -> dict[str, list]:
        """``{name: [size, digest]}`` of the files of ``path`` this rank wrote: its report to rank 0 in a save into
        a remote store, from which rank 0 writes the marker (it cannot list the other nodes' staging
        directories)."""
        return {
            str(p.relative_to(path)): [p.stat().st_size, d]
            for p, d in self._own_files(path, writer).items()
        }

    def _gather_reports(self, path: Path, writer: RecordingWriter) -> list[dict]:
        """Every rank, once its files are uploaded to a remote store (a synchronous save): each rank's
        ``_files_report``."""
        reports: list[dict] = [{}] * self.world
        dist.all_gather_object(reports, self._files_report(path, writer))
        return reports

    def _hand_over(self, trainer: Trainer, client: dict, save: InFlightSave) -> None:
        """An asynchronous save: this rank's files into host memory, handed to a background writer that writes them,
        reports to rank 0 and (rank 0) commits; the save stays in flight until ``wait``."""
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
        synchronous save writes it, or an empty failed-rank file; a remote store's ranks first upload their files
        and post their report to the store); rank 0 then waits for every rank's report and, when none failed,
        commits as a synchronous save does."""
        writer = save.writer
        if self.store.url is None:
            self._write_digests(save.path, writer)
        pause_save()
        if self.store.url is not None:
            self._report_to_store(save.path, writer)
        elif writer.error is not None:
            with contextlib.suppress(
                OSError
            ):  # not even an empty file fits: rank 0 stops waiting at its timeout
                (save.path / RANK_FAILED.format(self.rank)).touch()
        if writer.error is not None or self.rank != 0:
            return
        try:
            reports = self._await_reports(save.path, writer)
            if reports is None:
                return  # a rank's part failed: the wait fails the save on every rank
            save.commit_error = self._commit(
                save.path, save.marker, reports if self.store.url is not None else None
            )
        except (
            Exception
        ) as e:  # a rank that never reported, or a fault of its own: the save fails at the wait
            save.commit_error = f"finishing the save failed ({e})"
        if save.commit_error is None:
            log_save(
                save.path,
                save.reason,
                save.stall,
                time.perf_counter() - save.began - save.stall,
                save.step_s,
                self.store.where(save.path),
            )

    def _report_to_store(self, path: Path, writer: RecordingWriter) -> None:
        """An asynchronous save into a remote store, on the writer thread: this rank's files uploaded, then its
        report posted to the store (rank 0 keeps its own); an upload or report that fails is this rank's error."""
        self._upload(path, writer)
        if self.rank == 0:
            return
        try:
            self.store.post_report(
                path, self.rank, self._files_report(path, writer) if writer.error is None else None
            )
        except CheckpointError as e:
            writer.error = writer.error or str(e)

    def _await_reports(self, path: Path, writer: RecordingWriter) -> list[dict] | None:
        """Rank 0's writer thread: once every rank reported, their files (``_gather_reports``'s form; a local
        store's are read by ``_commit``), or None when a rank's part failed. Files, not collectives: the training
        threads may be in theirs. A rank silent for ``train.dist_timeout_minutes`` is an error."""
        waiting, reports = set(range(self.world)), [{}] * self.world
        if self.store.url is not None:
            reports[0] = self._files_report(path, writer)
            waiting.discard(0)
        deadline = time.monotonic() + self.cfg.train.dist_timeout_minutes * 60
        while True:
            if self.store.url is None:
                if any((path / RANK_FAILED.format(r)).exists() for r in waiting):
                    return None
                waiting = {r for r in waiting if not (path / RANK_DIGESTS.format(r)).exists()}
            else:
                posted = self.store.reports(path, waiting)
                if any(files is None for files in posted.values()):
                    return None
                for rank, files in posted.items():
                    reports[rank] = files
                waiting -= set(posted)
            if not waiting:
                return reports
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank {min(waiting)} did not report its part within "
                    f"train.dist_timeout_minutes ({self.cfg.train.dist_timeout_minutes:g})"
                )
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
        self.share_line()

    def _clear_for_save(self, path: Path) -> None:
        """Rank 0: make room for ``path`` — leftovers of an interrupted save of this step are removed; a directory
        with a marker (complete, or malformed but perhaps intact) is set aside, never deleted; older checkpoints are
        retired first when the disk has no room for another (``_retire_to_fit``)."""
        if (path / MARKER).exists():
            self._set_aside([path], "a new save of the same step replaces it")
        elif path.exists():
            self.deleter.discard(path)
        # a remote store: what an interrupted save of this step left there
        self.store.remove(path.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._retire_to_fit(path)

    def _write_files(
        self, trainer: Trainer, path: Path, client: dict, writer: RecordingWriter
    ) -> None:
        """This rank's part of the checkpoint through ``writer``: the backend's files, the RNG state and (rank 0,
        ``model.engram.offload``) the host tables."""
        trainer.save_files(path, client, writer)
        writer.put(
            path / RNG_FILE.format(self.rank), rng_state_bytes(cuda=trainer.device.type == "cuda")
        )
        host = trainer.host_tables
        if host is not None and (name := host.checkpoint_file(self.rank)) is not None:
            tensors, metadata = host.state()
            writer.put(path / name, save(tensors, metadata=metadata))

    def _write_digests(self, path: Path, writer: RecordingWriter) -> None:
        """This rank's report to rank 0: the digests of the files it wrote, which rank 0 merges into the marker (and
        then deletes: an asynchronous save's rank 0 does so as soon as the report appears)."""
        digests = {
            str(p.relative_to(path)): d for p, d in writer.digests.items() if p.is_relative_to(path)
        }
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

    def _commit(self, path: Path, marker: dict, reports: list[dict] | None = None) -> str | None:
        """Rank 0, once every rank wrote its files: the marker (every file's size and digest), ``latest``, then
        retention. Returns what failed, or None. ``reports``: a remote store's, each rank's files (``_gather_reports``),
        whose marker and ``latest`` go to the store after the staging directory's."""
        if reports is not None:
            return self._commit_remote(path, marker, reports)
        try:
            digests = {}
            for part in sorted(path.glob(RANK_DIGESTS.replace("{:05d}", "*"))):
                digests |= json.loads(part.read_text())
                part.unlink()
            files = sorted(p for p in path.rglob("*") if p.is_file())
            names = [str(f.relative_to(path)) for f in files]
            # not written through a writer
            unknown = [f for f, name in zip(files, names) if name not in digests]
            for f in unknown:
                fsync(f)
            digests |= {str(f.relative_to(path)): d for f, d in zip(unknown, file_digests(unknown))}
            marker |= {
                "files": {n: f.stat().st_size for n, f in zip(names, files)},
                "digest_algorithm": DIGEST,
                "digests": {n: digests[n] for n in names},
            }
            write_atomic(path / MARKER, json.dumps(marker, indent=1))
            write_atomic(self.dir / LATEST, path.name)
        except (OSError, ValueError) as e:
            return f"finishing the save failed ({e})"
        self._retire_old(path)
        return None

    def _commit_remote(self, path: Path, marker: dict, reports: list[dict]) -> str | None:
        """``_commit`` of a remote store: the marker from the ranks' reports, in the staging directory and then in
        the store (``publish``), then ``latest`` and retention."""
        files = {name: entry for report in reports for name, entry in report.items()}
        names = sorted(files)
        marker |= {
            "files": {n: files[n][0] for n in names},
            "digest_algorithm": DIGEST,
            "digests": {n: files[n][1] for n in names},
        }
        try:
            write_atomic(path / MARKER, json.dumps(marker, indent=1))
            self.store.publish(path)
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
            self.store.remove(path.name)
        dist.barrier()
        raise CheckpointError(self._failure_message(path, failed, error, size))

    def _failure_message(
        self, path: Path, failed: list[int], error: str | None, size: float
    ) -> str:
        ranks = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        cause = (
            f"{ranks}: {error}" if error else f"{ranks} could not write its part (see its message)"
        )
        previous, free = complete_checkpoints(self.dir), free_bytes(self.dir)
        resume = (
            f"{self.store.where(previous[-1])} stays the newest checkpoint"
            if previous
            else "the run has none yet"
        )
        if self.store.url is not None and not (error or "").startswith("writing"):
            return (
                f"could not save checkpoint {self.store.where(path)}: {cause}. {path.name} was not marked "
                f"complete and {resume}: once {self.store.url} can be written, rerun to resume (--resume auto)"
            )
        if error and any(
            f"[Errno {code}]" in error for code in (errno.EROFS, errno.EACCES, errno.EPERM)
        ):
            return (
                f"could not save checkpoint {path}: {cause}. Nothing of {path.name} stays and {resume}: make "
                f"{self.dir} writable, then rerun to resume (--resume auto)"
            )  # no space to free
        if previous:
            need = f"about {readable_size(checkpoint_bytes(previous[-1]))} (the size of {previous[-1].name})"
        else:
            need = f"about {readable_size(size)} (this save's files)"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limited = limit != resource.RLIM_INFINITY
        return (
            f"could not save checkpoint {path}: {cause}. A checkpoint takes {need}; {readable_size(free)} are free "
            "on its filesystem"
            + (
                f", and this process may write files of at most {readable_size(limit)} (ulimit -f)"
                if limited
                else ""
            )
            + f". The incomplete {path.name} was removed and {resume}: {self._space_fix(previous, free, limited)}"
        )
