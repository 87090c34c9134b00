"""Where a run's checkpoints are kept (``train.checkpoint_dir``), behind one interface: ``CheckpointStore``.
Every save writes, and every load reads, a local directory (``local``): ``CheckpointStore`` itself keeps the
checkpoints there, in ``RUN/checkpoints``, as before; ``RemoteStore`` keeps them in object storage
(``s3://bucket/prefix``, any scheme fsspec knows), with ``local`` a node-local staging directory
(``train.checkpoint_staging``) that a save uploads from and a resume downloads into. The checkpointer's rules (the
marker, ``latest``, retention, setting checkpoints aside) stay those of the local directory; a remote store repeats
each of them in the bucket. No torch here: ``status`` reads it. docs/design-training.md, "Checkpoints", says why."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mhf_dist.atomic import write_atomic
from mhf_dist.remote import StorageError, check_bucket, filesystem, is_url, storage_error
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.checkpoint.index import (
    LATEST,
    MARKER,
    CheckpointError,
    checkpoint_step,
    complete_checkpoints,
    file_digest,
    marker_problem,
    step_directories,
)

log = logging.getLogger(__name__)

RANK_REPORT = "report-rank{:05d}.json"  # an asynchronous save's report of one rank, in the store
TRANSFER_ATTEMPTS = (
    3  # an upload or download of one file, before its failure fails the save or the resume
)
RETRY_SECONDS = 1.0  # the wait before the second attempt, doubled before each further one
UPLOAD_THREADS = 8  # the files of one rank uploaded at once


class CheckpointStore:
    """A run's checkpoints in ``local`` (``RUN/checkpoints``, or a local ``train.checkpoint_dir``): what every method
    below does beyond that is nothing."""

    url: str | None = None

    def __init__(self, local: Path):
        self.local = local

    def where(self, path: Path) -> str:
        """How messages name the checkpoint ``path`` (a directory of ``local``)."""
        return str(path)

    def check(self) -> None:
        """At the start: the store can be used (raises ``CheckpointError`` naming why not)."""

    def upload(self, path: Path, files: list[Path]) -> str | None:
        """Every rank, after writing its files of the checkpoint ``path``: copy them to the store. What failed, or
        None."""
        return None

    def publish(self, path: Path) -> None:
        """Rank 0, once every rank's files are in the store: the marker of ``path``, then ``latest``."""

    def point_latest(self, name: str | None) -> None:
        """Rank 0: ``latest`` names ``name`` (None: no checkpoint) in the store too."""

    def remove(self, name: str) -> None:
        """Rank 0: delete the checkpoint ``name`` from the store (its marker first); a failure is a warning."""

    def set_aside(self, names: list[str], folder: str) -> None:
        """Rank 0: move the checkpoints ``names`` into ``folder`` (``abandoned/<time>``, ``corrupt/<time>``) of the
        store, as the local directory's ``_move_aside`` does."""

    def mirror(self) -> None:
        """Each node, at the start: ``local`` shows the store's checkpoints (their markers, and ``latest``)."""

    def fetch(self, path: Path, marker: dict, share: int = 0, shares: int = 1) -> None:
        """Before the files of ``path`` are checked: this rank's ``share`` of the ``shares`` its node's ranks split
        them into, copied from the store into ``path`` (those already there with the size and digest of ``marker``
        are kept)."""

    def newest(self) -> Path | None:
        """The newest complete checkpoint (None: none yet), a directory of ``local`` holding at least its marker;
        nothing else in ``local`` changes (a run may be saving there)."""
        found = complete_checkpoints(self.local)
        return found[-1] if found else None

    def resolve(self, given: str) -> Path:
        """The local directory of the checkpoint ``--resume`` names."""
        return Path(given)

    def listing(self) -> list[tuple[str, str | None]]:
        """(name, why it is incomplete or None) of each checkpoint in the store beyond ``local``, by step."""
        return []


class RemoteStore(CheckpointStore):
    """Checkpoints in object storage at ``url``, written and read through the node-local ``staging``."""

    def __init__(self, url: str, staging: Path):
        super().__init__(staging)
        self.url = url.rstrip("/")

    @property
    def fs(self):
        fs, self.root = filesystem(self.url, CheckpointError, **NAMED)
        return fs

    def where(self, path: Path) -> str:
        return f"{self.url}/{path.name}"

    def _error(self, what: str, e: Exception) -> str:
        named = storage_error(self.url, e, CheckpointError, **NAMED)
        return f"{what} failed ({named if named is not e else repr(e)})"

    @contextlib.contextmanager
    def _failing_as(self, what: str) -> Iterator[None]:
        """A failure inside (a ``CheckpointError`` as it is) raised as a ``CheckpointError`` naming ``what`` and
        why it failed."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(self._error(what, e)) from None

    def _copy_marker(self, name: str) -> Path:
        """The store's marker of the checkpoint ``name`` in the staging directory (written when it differs); the
        checkpoint's directory there."""
        marker = self.fs.cat_file(f"{self.root}/{name}/{MARKER}")
        local = self.local / name / MARKER
        if not local.is_file() or local.read_bytes() != marker:
            local.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(local, marker.decode())
        return local.parent

    def check(self) -> None:
        check_bucket(self.url, CheckpointError, **NAMED)
        try:
            self.local.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"train.checkpoint_staging={self.local} cannot be created ({e}); give a writable node-local "
                "directory"
            ) from None

    def _transfer(self, what: str, move) -> None:
        """``move()``, tried ``TRANSFER_ATTEMPTS`` times with a doubling wait between; each failure but the last
        is a warning naming it, the last raises."""
        for attempt in range(1, TRANSFER_ATTEMPTS + 1):
            try:
                return move()
            except FileNotFoundError:
                raise
            except Exception as e:
                if attempt == TRANSFER_ATTEMPTS:
                    raise
                wait = RETRY_SECONDS * 2 ** (attempt - 1)
                log.warning(
                    "%s; trying again in %g s (attempt %d of %d)",
                    self._error(what, e),
                    wait,
                    attempt + 1,
                    TRANSFER_ATTEMPTS,
                )
                time.sleep(wait)

    def upload(self, path: Path, files: list[Path]) -> str | None:
        from fsspec.callbacks import Callback

        fs = self.fs
        # each chunk sent touches the checkpoint's directory: the hang watch's sign that a save makes progress
        sent = Callback(hooks={"progress": lambda *_: os.utime(path)})

        def put(f: Path) -> str | None:
            target = f"{self.root}/{path.name}/{f.relative_to(path).as_posix()}"
            what = f"uploading {f.relative_to(path)} to {self.where(path)}"
            try:
                self._transfer(what, lambda: fs.put_file(str(f), target, callback=sent))
            except Exception as e:
                return self._error(what, e)
            return None

        # the files side by side, as s3fs's own put of several files sends them
        with ThreadPoolExecutor(max(1, min(UPLOAD_THREADS, len(files)))) as pool:
            return next((error for error in pool.map(put, files) if error is not None), None)

    def post_report(self, path: Path, rank: int, files: dict[str, list] | None) -> None:
        """An asynchronous save's report of ``rank`` to rank 0, in the store beside the checkpoint's files (the
        nodes share no directory): ``{name: [size, digest]}`` of the files it uploaded, or None when its part
        failed. Raises ``CheckpointError`` when the store cannot take it."""
        text = json.dumps({"files": files} if files is not None else {"failed": True})
        what = f"reporting rank {rank}'s part of {self.where(path)}"
        with self._failing_as(what):
            self._transfer(
                what,
                lambda: self.fs.pipe_file(
                    f"{self.root}/{path.name}/{RANK_REPORT.format(rank)}", text.encode()
                ),
            )

    def reports(self, path: Path, ranks: set[int]) -> dict[int, dict | None]:
        """Those of ``ranks`` that posted their report of ``path`` (``post_report``): {rank: files, or None when
        its part failed}. Raises ``CheckpointError`` when the store cannot be read."""
        fs, found = self.fs, {}
        with self._failing_as(f"reading the ranks' reports of {self.where(path)}"):
            for rank in sorted(ranks):
                report = f"{self.root}/{path.name}/{RANK_REPORT.format(rank)}"
                try:
                    found[rank] = json.loads(fs.cat_file(report)).get("files")
                except FileNotFoundError:
                    continue
        return found

    def publish(self, path: Path) -> None:
        fs = self.fs
        with self._failing_as(f"writing {MARKER} of {self.where(path)}"):
            fs.put_file(str(path / MARKER), f"{self.root}/{path.name}/{MARKER}")
            fs.pipe_file(f"{self.root}/{LATEST}", path.name.encode())
        try:  # an asynchronous save's reports, merged into the marker
            fs.invalidate_cache(f"{self.root}/{path.name}")
            if reports := fs.glob(f"{self.root}/{path.name}/{RANK_REPORT.replace('{:05d}', '*')}"):
                fs.rm(reports)
        except Exception as e:
            log.warning("%s", self._error(f"deleting the ranks' reports in {self.where(path)}", e))

    def point_latest(self, name: str | None) -> None:
        fs = self.fs
        try:
            if name is None:
                fs.rm(f"{self.root}/{LATEST}")
            else:
                fs.pipe_file(f"{self.root}/{LATEST}", name.encode())
        except FileNotFoundError:
            pass

    def remove(self, name: str) -> None:
        fs = self.fs
        try:
            if fs.exists(marker := f"{self.root}/{name}/{MARKER}"):
                fs.rm(marker)
            if fs.exists(f"{self.root}/{name}"):
                fs.rm(f"{self.root}/{name}", recursive=True)
        except Exception as e:
            log.warning("%s; delete it by hand", self._error(f"deleting {self.url}/{name}", e))

    def set_aside(self, names: list[str], folder: str) -> None:
        fs = self.fs
        for name in names:
            source = f"{self.root}/{name}"
            try:
                fs.copy(source, f"{self.root}/{folder}/{name}", recursive=True)
            except Exception as e:
                log.warning(
                    "%s", self._error(f"copying {self.url}/{name} to {self.url}/{folder}", e)
                )
                continue
            self.remove(name)

    def _steps(self) -> dict[str, bool]:
        """{name: whether it has a marker} of the store's step directories."""
        fs, found = self.fs, {}
        with self._failing_as(f"listing the checkpoints in {self.url}"):
            try:
                entries = fs.ls(self.root, detail=True, refresh=True)
            except FileNotFoundError:
                return {}
            for entry in entries:
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if entry["type"] == "directory" and checkpoint_step(Path(name)) is not None:
                    found[name] = fs.exists(f"{self.root}/{name}/{MARKER}")
        return dict(sorted(found.items(), key=lambda item: checkpoint_step(Path(item[0]))))

    def mirror(self) -> None:
        steps = self._steps()
        with self._failing_as(f"reading the checkpoints in {self.url}"):
            self.local.mkdir(parents=True, exist_ok=True)
            for path in step_directories(
                self.local
            ):  # not (or no longer) a complete checkpoint of the store
                if not steps.get(path.name):
                    shutil.rmtree(path, ignore_errors=True)
            for name, complete in steps.items():
                if complete:
                    self._copy_marker(name)
            try:
                write_atomic(
                    self.local / LATEST, self.fs.cat_file(f"{self.root}/{LATEST}").decode()
                )
            except FileNotFoundError:
                (self.local / LATEST).unlink(missing_ok=True)

    def fetch(self, path: Path, marker: dict, share: int = 0, shares: int = 1) -> None:
        fs, digests = self.fs, marker.get("digests", {})
        for name in sorted(marker["files"])[share::shares]:
            local = path / name
            if (
                local.is_file()
                and local.stat().st_size == marker["files"][name]
                and digests.get(name) == file_digest(local)
            ):
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            partial = local.with_name(f".{local.name}.{os.getpid()}.partial")
            source = f"{self.root}/{path.name}/{name}"
            try:
                self._transfer(
                    f"downloading {name} of {self.where(path)}",
                    lambda: fs.get_file(source, str(partial)),  # noqa: B023
                )
                os.replace(partial, local)
            except FileNotFoundError:
                partial.unlink(missing_ok=True)  # missing: the file check names it
            except Exception as e:
                partial.unlink(missing_ok=True)
                raise CheckpointError(
                    self._error(f"downloading {name} of {self.where(path)}", e)
                ) from None

    def newest(self) -> Path | None:
        complete = [name for name, done in self._steps().items() if done]
        if not complete:
            return None
        with self._failing_as(f"reading {self.url}/{complete[-1]}/{MARKER}"):
            return self._copy_marker(complete[-1])

    def resolve(self, given: str) -> Path:
        if not is_url(given):
            return Path(given)
        name = given.rstrip("/").rsplit("/", 1)[-1]
        if given.rstrip("/") != f"{self.url}/{name}" or checkpoint_step(Path(name)) is None:
            raise CheckpointError(
                f"--resume {given}: a checkpoint in object storage resumes only from this run's "
                f"train.checkpoint_dir ({self.url}/step-XXXXXXXX)"
            )
        return self.local / name

    def resumed_marker(self, resume: str) -> tuple[str | None, dict | None]:
        """(the checkpoint ``--resume`` names, as a URL, and its marker; read from the store), (None, None) when
        there is none (``none``, or ``auto`` before the first save)."""
        if resume == "none":
            return None, None
        if resume == "auto":
            complete = [name for name, done in self._steps().items() if done]
            if not complete:
                return None, None
            name = complete[-1]
        else:
            name = self.resolve(resume).name
        try:
            marker = json.loads(self.fs.cat_file(f"{self.root}/{name}/{MARKER}"))
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.url}/{name} is not a complete checkpoint (no {MARKER}); resume from another one"
            ) from None
        except Exception as e:
            raise CheckpointError(self._error(f"reading {self.url}/{name}/{MARKER}", e)) from None
        if not isinstance(marker, dict):
            raise CheckpointError(f"{self.url}/{name}/{MARKER} is not a JSON object")
        return f"{self.url}/{name}", marker

    def listing(self) -> list[tuple[str, str | None]]:
        return [
            (name, None if complete else f"no {MARKER}: the save was interrupted or failed")
            for name, complete in self._steps().items()
        ]


NAMED = {
    "instead": "or keep the checkpoints in RUN/checkpoints (leave train.checkpoint_dir unset)",
    "access": "read and write access to it",
}


def checkpoint_store(run: RunDir, train) -> CheckpointStore:
    """The store of a run whose ``train`` section (a ``TrainConfig``, or the raw dict of config.yaml) is given."""
    get = train.get if isinstance(train, dict) else lambda k: getattr(train, k, None)
    where, staging = get("checkpoint_dir"), get("checkpoint_staging")
    if is_url(where) and staging:
        return RemoteStore(where, Path(staging))
    if where and not is_url(where):
        return CheckpointStore(Path(where))
    return CheckpointStore(run.checkpoints_dir)


def run_store(run: RunDir) -> CheckpointStore:
    """The store of the run in ``run`` as its config.yaml says (``RUN/checkpoints`` when it names none, or is
    unreadable)."""
    try:
        import yaml

        train = (yaml.safe_load(run.config_path.read_text()) or {}).get("train") or {}
    except (OSError, ValueError, AttributeError):
        train = {}
    return checkpoint_store(run, train if isinstance(train, dict) else {})


def saved_checkpoints(run: RunDir) -> list[Path]:
    """The run's complete checkpoints, oldest first, where it keeps them (``RUN/checkpoints``, or a remote store's
    copies in the staging directory); incomplete ones are skipped without a word."""
    return [p for p in step_directories(run_store(run).local) if marker_problem(p) is None]


def local_share() -> tuple[int, int]:
    """(this rank's index among the ranks of its node, their number), as the launcher set them (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``); (0, 1) without them: the rank then does its node's share alone."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


__all__ = [
    "CheckpointStore",
    "RemoteStore",
    "StorageError",
    "checkpoint_store",
    "run_store",
    "saved_checkpoints",
]
