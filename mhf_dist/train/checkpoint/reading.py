"""The reading side of the checkpointer: which checkpoint ``--resume auto`` continues from (newer damaged ones moved
to ``checkpoints/corrupt/``), the verification of a checkpoint (its files, with every rank, and its model and
signature table against the run's), the conversion of another layout's checkpoint, and the load. ``Reading`` is
a base of ``Checkpointer``; docs/design-training.md, "Checkpoints", says
how a checkpoint is verified."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from pydantic import ValidationError
from tqdm.auto import tqdm

from mhf_dist.atomic import write_atomic
from mhf_dist.backend import Trainer, convert_for_layout
from mhf_dist.config import ModelConfig
from mhf_dist.parallel.rank0_work import on_rank0
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.train.checkpoint.index import (
    CORRUPT,
    DIGEST,
    MARKER,
    CheckpointError,
    CorruptCheckpoint,
    complete_checkpoints,
    describe_problems,
    file_problems,
    intact_note,
    marker_problem,
    read_marker,
    version_note,
    warn_if_without_digests,
)
from mhf_dist.train.checkpoint.lineage import UNIVERSAL, Lineage
from mhf_dist.train.checkpoint.rng import (
    LEGACY_RNG_FILE,
    RNG_FILE,
    read_legacy_rng_state,
    read_rng_state,
    set_rng_state,
)
from mhf_dist.train.checkpoint.store import local_share
from mhf_dist.train.client_state import ClientState
from mhf_dist.train.fault_injection import pause_conversion
from mhf_dist.train.host_table_files import HOST_TABLES_FILE
from mhf_dist.train.host_tables import HostTablesStep

log = logging.getLogger(__name__)


class Reading(Lineage):
    """Finds, verifies, converts and loads this run's checkpoints; the base of
    ``Checkpointer``, which sets the attributes below."""

    world: int
    scalars: ScalarCollectives
    verified: set[Path]  # the checkpoints whose files every rank checked
    signatures_hash: str | None
    layout: dict
    versions: dict  # the versions this run runs with, named beside a checkpoint's in its load

    def resumable(self) -> Path | None:
        """``--resume auto``: the newest complete checkpoint whose files are as saved (every rank calls this), None
        when there is none. Newer ones whose files are damaged are moved to ``checkpoints/corrupt/<time>/`` (never
        deleted), each with a warning naming it; when no checkpoint verifies, nothing moves and the newest one's
        damage is raised."""
        intact, damaged = self._newest_intact(self._complete_line())
        if damaged and intact is None:
            raise CorruptCheckpoint(
                f"{damaged[0][1]}; no older checkpoint in {self.store.url or self.dir} verifies either: copy the "
                "damaged files back intact, or start over in a new --run-dir"
            )
        if damaged and self.rank == 0:
            target = self._move_aside([path for path, _ in damaged], CORRUPT)
            for path, problem in damaged:
                log.warning(
                    "%s. Moved %s to %s; resuming from %s, the newest checkpoint that verifies",
                    problem,
                    path.name,
                    target,
                    intact,
                )
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
                f"has {str(self.signatures_hash)[:12]}: use the run's own signatures/ (or expand-vocab to extend it)"
            )
        ours = _model_identity(self.cfg.model.model_dump(mode="json"))
        theirs = _model_identity(_as_written_now(marker["model"]))
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            details = "; ".join(
                f"model.{k}: checkpoint {theirs.get(k)!r}, config {ours.get(k)!r}" for k in differ
            )
            raise CheckpointError(
                f"checkpoint {path} is of another model ({details}); resume with its config"
            )
        return marker

    def _check_files_together(self, path: Path, marker: dict) -> None:
        """Raise ``CorruptCheckpoint`` when a file differs from what was saved, naming the newest of this run's
        other checkpoints that verifies."""
        if (problem := self._damage_together(path, marker)) is None:
            return
        others = [p for p in complete_checkpoints(self.dir) if p.resolve() != path.resolve()]
        intact = self._newest_intact(others)[0]
        shown = None if intact is None or self.store.url is None else self.store.where(intact)
        raise CorruptCheckpoint(problem + intact_note(intact, self.store.url or self.dir, shown))

    def _damage_together(self, path: Path, marker: dict) -> str | None:
        """What is wrong with the checkpoint's files, or None (then it counts as verified): each rank checks every
        world-th file and the ranks sum what they found, so every rank names the same one."""
        self._fetch(path, marker)
        names = sorted(marker["files"])
        found = file_problems(path, marker, names[self.rank :: self.world])
        codes = self.scalars.sum([float(found.get(n, 0)) for n in names])
        shown = None if self.store.url is None else self.store.where(path)
        problem = describe_problems(
            path, marker, {n: int(c) for n, c in zip(names, codes) if c}, shown
        )
        if problem is None:
            self.verified.add(path)
        return problem

    def _fetch(self, path: Path, marker: dict) -> None:
        """A remote store: the checkpoint's files, downloaded into the staging directory of each node (its ranks
        share the work) unless already there as saved; a failure on any rank fails on all."""
        if self.store.url is None:
            return
        error = None
        try:
            self.store.fetch(path, marker, *local_share())
        except CheckpointError as e:
            error = e
        if self.scalars.any(error is not None)[0]:
            raise error or CheckpointError(
                f"another rank could not download {self.store.where(path)} (see its message)"
            )

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
        once by rank 0 into ``checkpoints/universal/<tag>`` (DeepSpeed's universal format; a remote store: by each
        node's first rank, into its staging directory, which the download filled on every node), then loaded from
        there; a conversion of another checkpoint of the same name (an abandoned line) is redone. The other ranks
        wait for the conversion outside any collective (``on_rank0``): it takes as long as the checkpoint is
        large.
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
                "then switch to ZeRO-3 from a checkpoint that run saves"
            )
        target = self.dir / UNIVERSAL / path.name
        source = hashlib.new(DIGEST, (path / MARKER).read_bytes()).hexdigest()

        def convert() -> None:
            if self._converted(target, source):
                return
            if target.exists():
                if self.deleter is not None:
                    self.deleter.discard(target)
                else:  # another node's first rank
                    shutil.rmtree(target)
            tqdm.write(f"converting {path} for this layout ({marker['layout']} -> {self.layout})")
            convert_for_layout(
                path,
                target,
                marker["layout"]["pp"] > 1,
                self.layout["pp"] > 1,
                self.cfg.model,
                self.layout["tp"] if zero3 else 1,
            )
            pause_conversion()
            write_atomic(
                target / MARKER,
                json.dumps(
                    marker | {"universal": True, "source": str(path), "source_marker": source},
                    indent=1,
                ),
            )

        # a remote store's staging directory is each node's own: each node converts its downloaded copy
        worker = None if self.store.url is None else local_share()[0] == 0
        on_rank0(convert, self.dir / UNIVERSAL, path.name, self.scalars, CheckpointError, worker)
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
            host_tables.load(source)
        except (
            OSError,
            ValueError,
            KeyError,
        ) as e:  # missing (a run without model.engram.offload) or unreadable
            raise CheckpointError(
                f"checkpoint {source} has no readable {HOST_TABLES_FILE} nor its shards ({e}), which "
                "model.engram.offload needs; resume with the config it was saved with"
            ) from e

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
    """A model section without ``engram.offload_update``, ``offload_shards`` and ``host_budget_gb``: how the host
    tables step, who holds their rows and within what memory, not what the model is (both rules keep the same AdamW
    state, and a checkpoint's rows are read whatever the ranks that wrote them held, so a checkpoint resumes with
    any of them)."""
    if isinstance(model.get("engram"), dict):
        return model | {
            "engram": {
                k: v
                for k, v in model["engram"].items()
                if k not in ("offload_update", "offload_shards", "host_budget_gb")
            }
        }
    return model


def _as_written_now(model: dict) -> dict:
    """A marker's model section as this version writes it (a former spelling, such as the Engram hash mode
    ``seed``, reads as today's); one that no longer validates is compared as stored, naming what differs."""
    try:
        return ModelConfig.model_validate(model).model_dump(mode="json")
    except ValidationError:
        return model
