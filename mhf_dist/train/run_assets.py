"""The run directory a start trains in: locked for one job (``take_lock``), and its assets (the tokenizer, the
signature table, the Engram compression table, the shards of the embedded corpus) made by rank 0 on first use while
the other ranks wait, then loaded by every rank with the data ranges the run's rollbacks skipped
(``prepare_assets``)."""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from tqdm.auto import tqdm

from mhf_dist.config import RunConfig
from mhf_dist.model.variants import variant
from mhf_dist.parallel.rank0_work import on_rank0
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.heartbeats import clear_heartbeats
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.storage.run_lock import RunDirLocked, RunLock
from mhf_dist.train.rollback import skipped_ranges

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mhf_dist.vocab.engram_compression import CompressionTable
    from mhf_dist.vocab.signatures import SignatureTable


class RunAssets(NamedTuple):
    tokenizer: PreTrainedTokenizerBase
    table: SignatureTable | None  # the variant needs signatures
    compression: CompressionTable | None  # with model.engram
    shards: Path | str  # data.path's (a URL as it is), or the embedded corpus's in RUN/data
    skipped: list[tuple[int, int]]  # the global positions the run's rollbacks skipped: never read


def take_lock(run: RunDir, rank: int, scalars: ScalarCollectives) -> None:
    """Rank 0 takes the run directory's lock (released when the process exits, errors included); every rank stops
    if another job holds it."""
    refused = None
    if rank == 0:
        lock = RunLock(run)
        try:
            if (warning := lock.acquire()) is not None:
                tqdm.write(f"warning: {warning}")
            atexit.register(lock.release)
        except RunDirLocked as e:
            refused = e
    if scalars.any(refused is not None)[0]:
        raise refused or RunDirLocked(f"{run.path} is in use by another job (rank 0 names it)")


def run_assets(run: RunDir, cfg: RunConfig) -> RunAssets:
    """The run's assets, each created on first use."""
    tokenizer = run.ensure_tokenizer(cfg)
    table = (
        run.ensure_signatures(cfg.model.hash, tokenizer) if variant(cfg).needs_signatures else None
    )
    compression = run.ensure_compression(tokenizer) if cfg.model.engram is not None else None
    return RunAssets(tokenizer, table, compression, run.ensure_shards(cfg), skipped_ranges(run))


def prepare_assets(run: RunDir, cfg: RunConfig, rank: int, scalars: ScalarCollectives) -> RunAssets:
    """Rank 0 creates what is missing (a tokenizer, shards: as long as the corpus takes) while the others wait
    outside any collective; then every rank loads the assets."""

    def create() -> None:
        run.path.mkdir(parents=True, exist_ok=True)
        clear_heartbeats(run)  # an earlier job's; this job's ranks write theirs once set up
        run_assets(run, cfg)

    on_rank0(create, run.path, "prepare", scalars)
    assets = run_assets(run, cfg)
    if assets.compression is not None and rank == 0:
        tqdm.write(assets.compression.summary())
    return assets
