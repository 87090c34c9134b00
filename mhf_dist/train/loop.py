"""The training loop, run by every rank (one process, or N under torchrun / the DeepSpeed launcher):
``TrainingLoop``'s set-up, then per step its step, evaluation, log, rollback and checkpoint phases, which call
the run's callbacks (``callbacks``; the monitors, ``monitors``).

Set-up: resolve the layout and engine config (every config error before any collective) and join the job → lock the
run directory; rank 0 prepares its assets while the others wait → every rank builds the model's skeleton and hands
it to the engine, which creates only this rank's parameters (``mhf_dist.parallel.construct``) → the data → the
resumed checkpoint (``--resume auto``: the newest) is loaded, engine, RNG and client state
(``client_state``), so the run continues bit-identically. A start refused on the way leaves a run
directory that was new as it found it. SIGUSR1/SIGTERM (or a first Ctrl-C) on any rank make all ranks finish the
step, save and stop with ``PREEMPTED_EXIT_CODE``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mhf_dist.backend import (
    Trainer,
    build_trainer,
    checkpoint_interval,
    parameter_partitioner,
    partitions_parameters,
)
from mhf_dist.config import RunConfig
from mhf_dist.data.mixture import open_data
from mhf_dist.data.training_data import DataPosition, TrainingData
from mhf_dist.model.modes import ModelModes
from mhf_dist.parallel.construct import Materialiser, SeededValues, model_skeleton
from mhf_dist.storage.run_dir import RunDir, RunDirAsFound
from mhf_dist.train.callbacks import Callbacks, RunContext, Stepped
from mhf_dist.train.checkpoint import Checkpointer
from mhf_dist.train.checkpoint.index import read_marker
from mhf_dist.train.checkpoint.store import local_share
from mhf_dist.train.client_state import ClientState
from mhf_dist.train.host_tables import host_shards, host_tables_factory
from mhf_dist.train.monitors import run_callbacks
from mhf_dist.train.oom import caught, is_out_of_memory
from mhf_dist.train.optim import (
    apply_optimizer_changes,
    check_resumed_groups,
    describe_groups,
    optimizer_factory,
)
from mhf_dist.train.preemption import StopSignal
from mhf_dist.train.process_group import Job, backend_prints, join_job
from mhf_dist.train.progress import Progress
from mhf_dist.train.run_assets import RunAssets, prepare_assets, take_lock
from mhf_dist.train.starting_point import (
    ResumePoint,
    checkpoint_layout,
    init_weights_file,
    resume_path,
)
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary


def document_eos(cfg: RunConfig, tokenizer) -> int | None:
    """The token id that ends each packed document with ``data.document_masking`` (the tokenizer's EOS, which
    prepare-data wrote after every document), else None."""
    if not cfg.data.document_masking:
        return None
    if tokenizer.eos_token_id is None:
        raise ValueError("data.document_masking needs a tokenizer with an EOS token")
    return tokenizer.eos_token_id


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainResult:
    records: list[dict] = field(default_factory=list)  # what rank 0 logged in this process
    preempted: bool = False  # stopped on a signal after saving
    saved: Path | None = None  # the checkpoint saved on that signal


class TrainingLoop:
    """One rank's training, in phases: ``setup``, then per step ``step``, ``measures``,
    ``evaluate``, ``log``, ``roll_back`` (when a callback asks) and ``checkpoint`` (``run``)."""

    cfg: RunConfig
    stop: StopSignal  # the signal handler: a stop is agreed at the end of each step
    verbose: bool  # the backend's start-up lines too
    callbacks: Callbacks
    progress: Progress  # the step reached (client state: step, tokens), this start's first and last
    # what checkpoints hold beside the engine's files: each registered part's state
    state: ClientState
    result: TrainResult
    job: Job  # this rank's place in the job: rank, layout, device, groups, collectives
    run_dir: RunDir
    # tokenizer, signature table, Engram compression table, shards, skipped ranges
    assets: RunAssets
    checkpointer: Checkpointer
    trainer: Trainer
    data: TrainingData
    position: DataPosition  # the data's part of the client state (data.restart may drop it)

    def __init__(self, cfg: RunConfig, stop: StopSignal, verbose: bool = False):
        self.cfg, self.stop, self.verbose = cfg, stop, verbose
        # a train.callbacks path that names none stops here, first
        self.callbacks = Callbacks(run_callbacks(cfg))
        self.progress = Progress(cfg.train, cfg.data.seq_len)
        self.state, self.result = ClientState(), TrainResult()

    # ------------------------------------------------------------------ set-up
    def setup(self, run_dir: str | Path, resume: str) -> bool:
        """Everything before the first step; False when a signal arrived during it (nothing trained yet, so
        nothing to save). A refused start leaves a new run directory as it found it (``RunDirAsFound``)."""
        self.job = join_job(self.cfg, self.verbose)
        self.run_dir = RunDir(run_dir)
        # before the lock is written there
        found = RunDirAsFound(self.run_dir.path) if self.job.rank == 0 else None
        take_lock(self.run_dir, self.job.rank, self.job.scalars)
        try:
            return self._start(resume)
        except Exception:
            if found is not None:
                found.restore()
            raise

    def _start(self, resume: str) -> bool:
        """``setup`` once the run directory is locked."""
        self.assets = prepare_assets(self.run_dir, self.cfg, self.job.rank, self.job.scalars)
        resuming = self._build(resume)
        if self.stop.start_up_ends(self.job.scalars.any(self.stop.received)[0]):
            if self.job.rank == 0:
                tqdm.write("stopped by a signal during start-up; nothing to save")
            return False
        self._open_data()
        for part in (
            self.progress,
            self.position,
            self.checkpointer,
            *self.callbacks,
        ):  # checkpoints' key order
            self.state.register(part)
        self._resume(resuming)
        if (
            self.job.rank == 0
        ):  # only now: a config that a checkpoint refused never reaches config.yaml
            self.run_dir.save_config(self.cfg)
        self.callbacks.on_start(
            RunContext(
                self.cfg,
                self.run_dir,
                self.job,
                self.assets,
                self.trainer,
                self.data,
                self.checkpointer,
                self.progress,
                self.position.dropped,
                self.load,
            )
        )
        return True

    def _build(self, resume: str) -> ResumePoint | None:
        """The model's skeleton, the checkpointer and the engine that materialises this rank's parameters;
        returns the checkpoint to resume from, if any."""
        cfg, job, groups, table = self.cfg, self.job, self.job.groups, self.assets.table
        seed_everything(cfg.train.seed)
        modes = ModelModes(
            checkpoint_interval(cfg, job.ds_config),
            cfg.train.fused_head_kernel,
            document_eos(cfg, self.assets.tokenizer),
        )
        shards = host_shards(cfg, job.world, job.rank, local_share()[1], groups.tp, groups.pp)
        model = model_skeleton(
            cfg.model,
            len(self.assets.tokenizer),
            table.codes if table else None,
            compression=self.assets.compression,
            tp_group=groups.tp_group,
            tp_rank=groups.tp_rank,
            tp=groups.tp,
            modes=modes,
            host_shards=shards,
        )
        self.checkpointer = Checkpointer(
            self.run_dir,
            cfg,
            table.content_hash if table else None,
            checkpoint_layout(cfg, job.layout, model.vocab.tables.num_rows),
            [n for n, _ in model.named_parameters()],
        )
        if cfg.train.trainable_blocks is not None:
            model.train_only_vocabulary_and_ends(cfg.train.trainable_blocks)
        # a rule that matches nothing: refused here
        line = describe_groups(model.named_parameters(), cfg.optimizer)
        if job.rank == 0 and cfg.optimizer.groups:  # the default two groups go unsaid
            tqdm.write(
                line + (f" (per tensor-parallel rank of {groups.tp})" if groups.tp > 1 else "")
            )
        resuming, zero3 = None, partitions_parameters(job.ds_config, job.layout)
        if (path := resume_path(resume, self.checkpointer)) is not None:
            resuming = ResumePoint(path, *self.checkpointer.for_this_layout(path, zero3))
            check_resumed_groups(
                read_marker(path).get("config", {}).get("optimizer", {}), cfg.optimizer
            )
            # newer checkpoints (an abandoned line) are set aside
            self.checkpointer.continue_from(path)

        values = SeededValues(cfg.model.init_std, cfg.train.seed)
        if (
            cfg.train.init_from
        ):  # also when resuming: a checkpoint need not hold the frozen parameters
            values = init_weights_file(self.run_dir.path / cfg.train.init_from, model, groups.tp)
        if cfg.train.compile:
            model.backbone.compile_blocks()
            if zero3 and job.rank == 0:
                tqdm.write(
                    "note: train.compile under ZeRO-3 measured no faster than eager (DeepSpeed's hooks break "
                    "each block's graph at every submodule) and slows the first step; see docs/benchmarks.md"
                )
        materialise = Materialiser(
            model,
            values,
            job.device,
            groups.tp_rank,
            groups.tp,
            parameter_partitioner(job.ds_config, job.layout, groups),
        )
        with backend_prints(self.verbose):
            self.trainer = build_trainer(
                cfg,
                model,
                groups,
                config=job.ds_config,
                layout=job.layout,
                optimizer=optimizer_factory(cfg),
                materialise=materialise,
                load_universal=resuming is not None and resuming.universal,
                host_tables=host_tables_factory(cfg, groups, shards),
                wrap_loss=self.callbacks.loss_wrapper(),
            )
        return resuming

    def _open_data(self) -> None:
        """This data-parallel rank's reader of the training split, past the data the run's rollbacks skipped."""
        cfg, groups = self.cfg, self.job.groups
        self.data = open_data(
            cfg.data,
            self.assets.shards,
            seq_len=cfg.data.seq_len,
            tokenizer_fingerprint=tokens_fingerprint(vocabulary(self.assets.tokenizer)),
            seed=cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.train.seed,
            dp_rank=groups.dp_rank,
            dp_size=groups.dp,
            shuffle_window=cfg.data.shuffle_window,
            on_bad_shard=cfg.data.on_bad_shard,
            verify_checksums=cfg.data.verify_checksums,
            allow_pipe=cfg.data.allow_pipe,
            skipped=self.assets.skipped,
        )
        self.position = DataPosition(self.data, cfg.data.restart)

    def load(self, path: Path) -> dict:
        """Checkpoint ``path`` into the trainer, the RNG and every part of the client state (a resume, a rollback);
        returns its client state."""
        return self.checkpointer.load(self.trainer, path, self.state)

    def _resume(self, resuming: ResumePoint | None) -> None:
        """Load the checkpoint resumed from, then apply the optimizer settings changed since it."""
        if resuming is None:
            return
        saved = self.load(resuming.load)["config"]
        self.progress.start = start = self.progress.step
        for change in apply_optimizer_changes(
            self.trainer,
            saved["optimizer"],
            self.cfg.optimizer,
            self.cfg.train.max_steps,
            saved["train"]["max_steps"],
        ):
            if self.job.rank == 0:
                tqdm.write(f"changed on resume, from step {start + 1}: {change}")
        if self.job.rank != 0:
            return
        if self.position.dropped is not None:
            tqdm.write(
                f"data.restart: from step {start + 1} the data is read from the beginning of "
                f"{self.data.name} (the checkpoint's position is in other data: {self.position.dropped})"
            )
        tqdm.write(
            f"resumed from {resuming.asked} at step {start}"
            + (" (converted to this layout)" if resuming.universal else "")
        )

    # ------------------------------------------------------------------ the steps
    def run(self) -> TrainResult:
        """The steps from the start to the end, or to a signal (saved, then stopped) or a divergence (raised)."""
        finished = False
        try:
            while self.progress.step < self.progress.end:
                step = self.progress.step + 1
                stepped = self.step(step)
                record = self.measures(step, stepped) | self.evaluate(step)
                self.log(step, record | self.callbacks.evaluation(step))
                if self.callbacks.wants_rollback(step):
                    self.roll_back(step)
                    continue
                self.checkpoint(step, stepped)
                if self.result.preempted:
                    break
            self.callbacks.on_end(self.progress.end)
            dist.barrier()
            self.checkpointer.wait()  # the last save, when asynchronous (a preempted job's included)
            if (
                not self.result.preempted
            ):  # a preempted job leaves the rest to the next start: its grace is short
                self.checkpointer.close()
            finished = True
        finally:
            self.data.close()
            self.callbacks.close(finished)
        return self.result

    def step(self, step: int) -> Stepped:
        """One optimizer step between the callbacks' ``before_step`` and ``after_step``, timed, under
        their spike limits; at its end the ranks agree on a stop signal and on the saves the callbacks ask for. A step
        out of memory raises ``StepOutOfMemory`` (``mhf_dist.train.oom``)."""
        self.callbacks.before_step(step)
        lr, began = self.trainer.lr, time.perf_counter()
        try:
            stats = self.trainer.train_step(
                self.data,
                lambda: [self.stop.received, *self.callbacks.wants_save()],
                self.callbacks.spike_limits(),
                health=self.progress.logged(step),
            )
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            # what this rank saw, taken while the step's tensors are still held
            vocab = len(self.assets.tokenizer)
            raise caught(
                e, step=step, cfg=self.cfg, job=self.job, run=self.run_dir, vocab_size=vocab
            ) from None
        stepped = Stepped(stats, lr, time.perf_counter() - began)
        self.progress.stepped(step, stepped.seconds)
        self.callbacks.after_step(step, stepped)
        return stepped

    def measures(self, step: int, stepped: Stepped) -> dict:
        """A logged step's record (the first, every ``train.log_interval``-th, the last): the step's numbers, then
        the callbacks' fields; nothing for the other steps."""
        if not self.progress.logged(step):
            return {}
        stats = stepped.stats
        record = {
            "loss": stats.loss,
            "head_losses": stats.head_losses,
            "lr": stepped.lr,
            "step_s": stepped.seconds,
        }
        if stats.grad_norm is not None:
            record["grad_norm"] = stats.grad_norm
        if stats.p_inf_loss is not None:
            record["p_inf_loss"] = stats.p_inf_loss
        if stats.z_loss is not None:
            record["z_loss"] = stats.z_loss
        if consumed := self.data.consumed():  # a mixture's sources
            record["source_tokens"] = {
                name: n * self.cfg.data.seq_len for name, n in consumed.items()
            }
        return record | self.callbacks.record(step, stepped)

    def evaluate(self, step: int) -> dict:
        """The validation metrics, calibrated ones included (``mhf_dist.model.calibration.validation_metrics``),
        every ``train.eval_interval`` steps and at the last; nothing without a validation split."""
        t = self.cfg.train
        if not ((t.eval_interval and step % t.eval_interval == 0) or step == self.progress.end):
            return {}
        if not (splits := self.data.validation()):
            return {}
        self.callbacks.before_eval(step)
        batches = max(1, t.eval_sequences // (t.micro_batch_size * self.job.layout.dp))
        found = []
        for split in splits:
            with split.reader as reader:
                found.append(
                    (split, self.trainer.evaluate(reader, batches, self.callbacks.eval_progress))
                )
        if splits[0].label is None:  # one directory
            return found[0][1]
        # a mixture: every metric per source (val_loss/<source>), and val_loss weighted as the sources are mixed
        total = sum(split.weight for split in splits)
        return {
            f"{key}/{split.label}": value
            for split, metrics in found
            for key, value in metrics.items()
        } | {
            "val_loss": sum(metrics["val_loss"] * split.weight for split, metrics in found) / total
        }

    def log(self, step: int, record: dict) -> None:
        """A non-empty record goes to the callbacks (rank 0's reporter logs and shows it); rank 0 keeps it."""
        if not record:
            return
        self.callbacks.on_log(step, record)
        if self.job.rank == 0:
            self.result.records.append({"step": step, **record})

    def roll_back(self, step: int) -> None:
        """Back to the checkpoint the callback that asked loads (``train.on_spike=rollback``), as a resume loads it;
        the records kept since it are dropped and the callbacks told. Training goes on from its step."""
        self.callbacks.on_rollback(step)
        back = self.progress.step
        self.result.records = [r for r in self.result.records if r["step"] <= back]
        self.callbacks.after_rollback(back)

    def checkpoint(self, step: int, stepped: Stepped) -> None:
        """Save when due (the ranks agreed at the end of the step): on a signal (``result.preempted``: the run stops
        after it), at the end, every ``train.checkpoint_interval`` steps, or when a callback asks (the
        ``train.checkpoint_minutes`` clock); never a step a callback refuses (its loss or weights not finite)."""
        t = self.cfg.train
        self.result.preempted, *wanted = stepped.stats.flags
        reason = (
            "signal"
            if self.result.preempted
            else "end"
            if step == self.progress.end
            else "interval"
            if t.checkpoint_interval and step % t.checkpoint_interval == 0
            else self.callbacks.save_reason(wanted)
        )
        if reason is None or not self.callbacks.allows_save(step, stepped, reason):
            return
        self.callbacks.before_save(step)
        saved = self.checkpointer.save(
            self.trainer, self.state, reason, self.progress.step_seconds()
        )
        self.callbacks.after_save(step, saved)
        if self.result.preempted:
            self.result.saved = saved


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    resume: str = "auto",
    stop: StopSignal | None = None,
    verbose: bool = False,
) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` on this rank (``resume``: auto, none, or a checkpoint directory; ``stop``: the
    handler the caller installed first thing, else one installed now; ``verbose``: DeepSpeed's start-up lines
    too)."""
    loop = TrainingLoop(cfg, stop or StopSignal(), verbose)
    if not loop.setup(run_dir, resume):
        return TrainResult(preempted=True)
    return loop.run()
