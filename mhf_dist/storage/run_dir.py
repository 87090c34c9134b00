"""The run directory: everything a run needs to continue lives under it, each part named here once (``RunDir``).

``RUN/`` holds ``config.yaml`` (the resolved RunConfig), ``tokenizer/`` (trained here when ``tokenizer.path`` is
None), ``signatures/`` and ``engram/`` (docs/spec.md §1, §8; built once, then verified on every start), ``data/``
(the embedded corpus's shards), ``checkpoints/`` (``mhf_dist.train.checkpoint``), ``lock.json``
(``mhf_dist.storage.run_lock``), ``metrics.jsonl``, ``tensorboard/``, ``heartbeats/``
(``mhf_dist.storage.heartbeats``), ``hangs/<time>/`` (each live rank's stacks), ``oom/<time>/`` (each report of a
rank whose step ran out of memory, ``mhf_dist.train.oom``), ``jobs/`` (submitted job scripts,
their logs and ``jobs.jsonl``; ``slurm/`` in a run submitted before), ``rollbacks.json``
(``mhf_dist.train.rollback``) and ``profiles/`` (``mhf_dist.train.profiler_window``). What each holds:
docs/training.md, "Training: ``train``". Making a run's assets (the tokenizer, tables, shards) loads the vocabulary
and data stacks; naming its paths loads nothing, so ``status`` and ``submit`` use this class on a login node.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mhf_dist.config import CONFIG_FILE, HashConfig, RunConfig
from mhf_dist.data.formats import MANIFEST, TOKENIZER_DIR, DataError
from mhf_dist.remote import is_url

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mhf_dist.vocab.engram_compression import CompressionTable
    from mhf_dist.vocab.signatures import SignatureTable

CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = "lock.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
JOBS_DIR = "jobs"  # also OUT/jobs of submit-data
OLD_JOBS_DIR = "slurm"  # the job directory's name before it was named for any scheduler
RUN_MARKERS = (CHECKPOINTS_DIR, METRICS_FILE, LOCK_FILE)  # what only a run directory holds
PROFILE_DIR = re.compile(r"step-(\d+)-(\d+)")  # a profiler window's folder (RunDir.profile_dir)
# a rank's files in it ({}: the rank): its trace (Chrome/Perfetto JSON, a name TensorBoard's profiler plugin reads
# too) and its CUDA memory history (GPU ranks)
TRACE_FILE, MEMORY_FILE = "rank-{}.pt.trace.json", "memory-rank-{}.pickle"


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / CONFIG_FILE
        self.tokenizer_dir = self.path / "tokenizer"
        self.signatures_dir = self.path / "signatures"
        self.engram_dir = self.path / "engram"
        self.data_dir = self.path / "data"
        self.checkpoints_dir = self.path / CHECKPOINTS_DIR
        self.lock_path = self.path / LOCK_FILE
        self.metrics_path = self.path / METRICS_FILE
        self.tensorboard_dir = self.path / TENSORBOARD_DIR
        self.heartbeats_dir = self.path / "heartbeats"
        # the nodes the ranks lost (storage.heartbeats)
        self.lost_record = self.heartbeats_dir / "lost.json"
        self.hangs_dir = self.path / "hangs"
        # a step out of memory: each such rank's report in oom/<time>/, the newest named in oom/last.json
        self.oom_dir = self.path / "oom"
        self.oom_record = self.oom_dir / "last.json"
        self.rollbacks_path = self.path / "rollbacks.json"
        # profiler windows' traces (step-FIRST-LAST/) and the file that asks a running run for one
        self.profiles_dir = self.path / "profiles"
        self.profile_trigger = self.path / "profile-now"

    def profile_dir(self, first: int, last: int) -> Path:
        """Where the profiler window of steps ``first``..``last`` writes each rank's files (``TRACE_FILE``,
        ``MEMORY_FILE``)."""
        return self.profiles_dir / f"step-{first}-{last}"

    @property
    def jobs_dir(self) -> Path:
        """``RUN/jobs``; ``RUN/slurm`` where only that one is there (a run submitted by an older mhf-dist keeps it,
        so its jobs, their requeues and their logs stay in one place)."""
        old = self.path / OLD_JOBS_DIR
        return old if old.is_dir() and not (self.path / JOBS_DIR).exists() else self.path / JOBS_DIR

    @property
    def jobs_file(self) -> Path:
        """One line per submitted job."""
        return self.jobs_dir / "jobs.jsonl"

    def make_jobs_dir(self) -> Path:
        """Make the job directory; a new ``RUN/jobs`` gets ``RUN/slurm``, its older name, as a link to it, for whoever
        still reads that one."""
        jobs, old = self.jobs_dir, self.path / OLD_JOBS_DIR
        jobs.mkdir(parents=True, exist_ok=True)
        if jobs.name == JOBS_DIR and not old.is_symlink() and not old.exists():
            with contextlib.suppress(
                OSError
            ):  # a filesystem without links: only the new name is there
                old.symlink_to(JOBS_DIR)
        return jobs

    def save_config(self, cfg: RunConfig) -> None:
        """``config.yaml``: the config a plain ``train --run-dir RUN`` resumes with."""
        raw = cfg.model_dump(mode="json")
        # instructions to one start, not properties of the run
        raw["data"]["restart"] = raw["optimizer"]["allow_lr_jump"] = False
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))

    def ensure_tokenizer(self, cfg: RunConfig) -> PreTrainedTokenizerBase:
        """The run's tokenizer: ``tokenizer.path``, else the one ``data.path``'s shards were made with, else a
        BPE trained once on the embedded corpus."""
        from mhf_dist.vocab.tokenizers import embedded_corpus, load_tokenizer, train_bpe

        source = self.tokenizer_source(cfg)
        if (
            source == str(self.tokenizer_dir)
            and not (self.tokenizer_dir / "tokenizer.json").is_file()
        ):
            train_bpe(embedded_corpus(), cfg.tokenizer.vocab_size, self.tokenizer_dir)
        tokenizer = load_tokenizer(source)
        if cfg.tokenizer.path is None and source != str(self.tokenizer_dir):
            self._check_data_tokenizer(cfg, tokenizer)
        return tokenizer

    def _check_data_tokenizer(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """The tokenizer of ``data.path``'s shards is the run's only while it is the one the run's tables were built
        for: data of another tokenizer is named here, before the tables' own check blames them."""
        from mhf_dist.data.retokenize import prepare_command, prepared_again
        from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

        built_for, found = self._tables_fingerprint(), tokens_fingerprint(vocabulary(tokenizer))
        if built_for is None or built_for == found:
            return
        shard_dir, out = cfg.data.shard_dir, prepared_again(cfg.data.shard_dir, "retokenized")
        own = self._tokenizer_with(built_for)
        raise DataError(
            f"{Path(shard_dir) / MANIFEST} was tokenized by another tokenizer (fingerprint {found[:12]}..., the "
            f"run's is {built_for[:12]}...): the run keeps the tokenizer it started with; prepare the data with the "
            "run's tokenizer"
            + (
                ""
                if own
                else f" (RUN_TOKENIZER: the one the run started with, fingerprint {built_for[:12]}...)"
            )
            + f" and train on it from its beginning:\n  {prepare_command(shard_dir, own or 'RUN_TOKENIZER', out)}\n"
            + "  "
            + shlex.join(
                [
                    "mhf-dist",
                    "train",
                    "--run-dir",
                    str(self.path),
                    "--set",
                    f"data.path={out}",
                    "--set",
                    "data.restart=true",
                ]
            )
        )

    def _tables_fingerprint(self) -> str | None:
        """The fingerprint of the tokenizer the run's signature or Engram table was built for; None before either."""
        for meta in (self.signatures_dir / "signatures.json", self.engram_dir / "compression.json"):
            with contextlib.suppress(
                OSError, ValueError, KeyError
            ):  # unreadable: the table's own load says so
                return json.loads(meta.read_text())["tokenizer_fingerprint"]
        return None

    def _tokenizer_with(self, fingerprint: str) -> str | None:
        """Where the run's tokenizer is: ``RUN/tokenizer``, or the shards' that ``config.yaml`` (its last start)
        names."""
        from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary
        from mhf_dist.vocab.tokenizers import load_tokenizer

        candidates = [self.tokenizer_dir]
        with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
            saved = RunConfig.model_validate(yaml.safe_load(self.config_path.read_text()))
            candidates.append(Path(self.tokenizer_source(saved)))
        for candidate in candidates:
            with contextlib.suppress(Exception):  # not a tokenizer: not the run's
                if tokens_fingerprint(vocabulary(load_tokenizer(str(candidate)))) == fingerprint:
                    return str(candidate)
        return None

    def ensure_signatures(
        self, hash_cfg: HashConfig, tokenizer: PreTrainedTokenizerBase
    ) -> SignatureTable:
        """Build the table on first start; afterwards load it and check it matches tokenizer and config."""
        from mhf_dist.vocab.signatures import SignatureError, SignatureTable
        from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

        tokens = vocabulary(tokenizer)
        if not self.signatures_dir.exists():
            table = SignatureTable.build(
                tokens,
                hash_cfg.num_hashes,
                hash_cfg.num_buckets,
                pad_id=tokenizer.pad_token_id,
                single_id=hash_cfg.single_id,
            )
            table.save(self.signatures_dir)
            return table
        table = SignatureTable.load(self.signatures_dir)
        if (table.num_hashes, table.num_buckets) != (hash_cfg.num_hashes, hash_cfg.num_buckets):
            raise SignatureError(
                f"{self.signatures_dir} holds H={table.num_hashes}, B={table.num_buckets} but the config asks for "
                f"H={hash_cfg.num_hashes}, B={hash_cfg.num_buckets}; use a new run directory for a new hash config"
            )
        if table.tokenizer_fingerprint != tokens_fingerprint(tokens):
            raise SignatureError(
                f"{self.signatures_dir} was built for another tokenizer (fingerprint "
                f"{table.tokenizer_fingerprint[:12]} vs {tokens_fingerprint(tokens)[:12]}); use the run's tokenizer "
                "or extend the vocabulary (expand-vocab)"
            )
        return table

    def ensure_compression(self, tokenizer: PreTrainedTokenizerBase) -> CompressionTable:
        """The Engram compression table: built on first start; afterwards loaded and checked against the tokenizer."""
        from mhf_dist.vocab.engram_compression import (
            NORMALIZATION_VERSION,
            CompressionError,
            CompressionTable,
        )
        from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

        if not self.engram_dir.exists():
            table = CompressionTable.build(tokenizer)
            table.save(self.engram_dir)
            return table
        table = CompressionTable.load(self.engram_dir)
        fingerprint = tokens_fingerprint(vocabulary(tokenizer))
        if table.tokenizer_fingerprint != fingerprint:
            raise CompressionError(
                f"{self.engram_dir} was built for another tokenizer (fingerprint {table.tokenizer_fingerprint[:12]} "
                f"vs {fingerprint[:12]}); use the run's tokenizer, or delete {self.engram_dir} to rebuild the table "
                "for this one (a checkpoint trained with the old table then no longer fits)"
            )
        if table.normalization != NORMALIZATION_VERSION:
            raise CompressionError(
                f"{self.engram_dir} was built with normalisation {table.normalization!r}, this code applies "
                f"{NORMALIZATION_VERSION!r}; use the code version that built it, or delete {self.engram_dir} to "
                "rebuild the table"
            )
        return table

    def tokenizer_source(self, cfg: RunConfig) -> str:
        if cfg.tokenizer.path is not None:
            return cfg.tokenizer.path
        if cfg.data.shard_dir is not None and (Path(cfg.data.shard_dir) / TOKENIZER_DIR).is_dir():
            return str(Path(cfg.data.shard_dir) / TOKENIZER_DIR)
        return str(self.tokenizer_dir)

    def ensure_shards(self, cfg: RunConfig) -> Path | str:
        """``data.path``'s shards (a URL of object storage as it is), or shards of the embedded corpus prepared once
        into ``RUN/data`` (5 % held out)."""
        if cfg.data.shard_dir is not None:
            return cfg.data.shard_dir if is_url(cfg.data.shard_dir) else Path(cfg.data.shard_dir)
        if not (self.data_dir / MANIFEST).is_file():
            from mhf_dist.data.prepare import prepare

            staging = self.data_dir.with_name("data.partial")
            shutil.rmtree(staging, ignore_errors=True)
            with resources.as_file(
                resources.files("mhf_dist.data").joinpath("corpus/kjv.txt.gz")
            ) as corpus:
                prepare(
                    [corpus],
                    self.tokenizer_source(cfg),
                    staging,
                    seq_len=cfg.data.seq_len,
                    samples_per_shard=128,
                    val_fraction=0.05,
                    progress=False,
                )
            staging.rename(self.data_dir)
        return self.data_dir


class RunDirAsFound:
    """A run directory as a start found it, before it wrote anything there: new (absent or empty) or a run's. A
    start refused before it trained calls ``restore``, which leaves a new one as it was found (removed again, or
    emptied), so that nothing made for a refused config (a tokenizer, signatures, prepared data) meets the next
    start; a run's directory is left alone."""

    def __init__(self, path: Path):
        self.path = path
        self.existed = path.is_dir()
        self.new = not self.existed or not any(path.iterdir())

    def restore(self) -> None:
        if not self.new:
            return
        if not self.existed:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for entry in list(self.path.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(
                    OSError
                ):  # best effort: the refusal itself is what the user must see
                    entry.unlink()
