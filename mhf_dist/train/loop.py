"""The training loop, run by every rank (one process, or N under torchrun / the DeepSpeed launcher):
:class:`TrainingLoop`'s set-up, then per step its step, evaluation, log and checkpoint phases.

Order of set-up: resolve the layout and DeepSpeed config (every config error
before any collective runs) → initialise ``torch.distributed`` → rank 0
prepares the run directory (tokenizer, signature table, Engram compression
table, shards of the embedded corpus) while the others wait → every rank
builds the model's skeleton (its tensor-parallel modules, parameters on the
meta device) and hands it to the engine, which creates only the parameters
this rank keeps — its ZeRO-3 partition, or its pipeline stage — initialised
from the run seed or from ``train.init_from`` (:mod:`mhf_dist.parallel.construct`)
→ the resumed checkpoint is loaded → steps. A start refused on the way (an error
on rank 0) leaves a run directory that was new as it found it.

A run resumes from its newest complete checkpoint by default (``--resume
auto``) and continues bit-identically: the same data, optimizer, scheduler and
RNG states. SIGUSR1/SIGTERM (or a first Ctrl-C) on any rank make all ranks
finish the step, save and stop with :data:`PREEMPTED_EXIT_CODE`.

Each optimizer step consumes ``train.global_batch_size`` sequences; the logged
loss is the docs/spec.md §5 training loss averaged over that batch, with each head's
term. Rank 0 logs ``metrics.jsonl`` and TensorBoard scalars (loss, head losses,
lr, grad norm, tokens/s, TFLOP/s, MFU, memory) and shows the progress bar.
"""

from __future__ import annotations

import atexit
import os
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mhf_dist.backend import (
    StepStats,
    Trainer,
    build_trainer,
    parameter_partitioner,
    partitions_parameters,
)
from mhf_dist.config import RunConfig
from mhf_dist.data.mixture import describe, open_data
from mhf_dist.data.reader import ShardReader
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.fused_head import use_kernels
from mhf_dist.model.variants import variant
from mhf_dist.parallel.construct import Materialiser, SeededValues, model_skeleton
from mhf_dist.parallel.devices import device_type
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.rank0_work import on_rank0
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.heartbeats import clear_heartbeats
from mhf_dist.storage.run_dir import RunDir, RunDirAsFound
from mhf_dist.storage.run_lock import RunDirLocked, RunLock
from mhf_dist.train.checkpoint import Checkpointer
from mhf_dist.train.checkpoint.index import read_marker
from mhf_dist.train.console import step_line
from mhf_dist.train.device_probe import DeviceProbe
from mhf_dist.train.divergence import LossWatch
from mhf_dist.train.fault_injection import loss_scale, slow_step, slow_work
from mhf_dist.train.host_tables import host_tables_factory
from mhf_dist.train.metrics import MetricsLogger
from mhf_dist.train.optim import (
    apply_optimizer_changes,
    check_resumed_groups,
    describe_groups,
    optimizer_factory,
)
from mhf_dist.train.preemption import StopSignal
from mhf_dist.train.preflight import preflight
from mhf_dist.train.process_group import backend_prints, init_distributed, resolve_device
from mhf_dist.train.rollback import Rollbacks
from mhf_dist.train.save_clock import SaveClock
from mhf_dist.train.starting_point import ResumePoint, checkpoint_layout, init_weights_file, resume_path
from mhf_dist.train.stragglers import StragglerWatch
from mhf_dist.train.throughput import memory_gb, restart_peak_memory, total_peak_flops
from mhf_dist.train.watchdog import Watchdog
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _run_assets(run: RunDir, cfg: RunConfig):
    """(tokenizer, signature table or None, Engram compression table or None, shard directory), created on
    first use."""
    tokenizer = run.ensure_tokenizer(cfg)
    table = run.ensure_signatures(cfg.model.hash, tokenizer) if variant(cfg).needs_signatures else None
    compression = run.ensure_compression(tokenizer) if cfg.model.engram is not None else None
    return tokenizer, table, compression, run.ensure_shards(cfg)


@dataclass
class TrainResult:
    records: list[dict] = field(default_factory=list)  # what rank 0 logged in this process
    preempted: bool = False  # stopped on a signal after saving
    saved: Path | None = None  # the checkpoint saved on that signal


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


def weights_finite(trainer: Trainer, scalars: ScalarCollectives) -> bool:
    """Whether every rank's parameters (its ZeRO-3 partition, or its whole stage) hold only finite values."""
    bad = any(not torch.isfinite(p).all() for p in trainer.local_parameters())
    return not scalars.any(bad)[0]


class Stepped(NamedTuple):
    """One optimizer step: what the engine reported, the learning rate it used, and its wall time."""

    stats: StepStats
    lr: float
    seconds: float


class TrainingLoop:
    """One rank's training, in phases: :meth:`setup`, then per step :meth:`step`, :meth:`evaluate`, :meth:`log` and
    :meth:`checkpoint` (:meth:`run`)."""

    def __init__(self, cfg: RunConfig, stop: StopSignal, verbose: bool = False):
        self.cfg, self.stop, self.verbose = cfg, stop, verbose
        self.result = TrainResult()
        self.data_restarted = False  # data.restart dropped the checkpoint's data position (:meth:`_continue_data`)
        self.watched: dict | None = None  # the resumed checkpoint's loss watch

    # ------------------------------------------------------------------ set-up
    def setup(self, run_dir: str | Path, resume: str) -> bool:
        """Everything before the first step; False when a signal arrived during it (nothing trained yet, so
        nothing to save). A refused start leaves a new run directory as it found it (:class:`RunDirAsFound`)."""
        self._join()
        self.run_dir = RunDir(run_dir)
        found = RunDirAsFound(self.run_dir.path) if self.rank == 0 else None  # before the lock is written into it
        take_lock(self.run_dir, self.rank, self.scalars)
        try:
            return self._start(resume)
        except Exception:
            if found is not None:
                found.restore()
            raise

    def _start(self, resume: str) -> bool:
        """:meth:`setup` once the run directory is locked."""
        self._prepare()
        resuming = self._build(resume)
        if self.stop.start_up_ends(self.scalars.any(self.stop.received)[0]):
            if self.rank == 0:
                tqdm.write("stopped by a signal during start-up; nothing to save")
            return False
        self._open_data()
        start = self._resume(resuming)
        if self.rank == 0:  # only now: a config that a checkpoint refused never reaches config.yaml
            self.run_dir.save_config(self.cfg)
        self._start_logs(start)
        return True

    def _join(self) -> None:
        """Resolve the layout and DeepSpeed config (every config error before any collective), then join the job's
        process group and its parallel groups."""
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        self.layout, self.ds_config = preflight(self.cfg, self.world, device_type(self.cfg))
        self.device = resolve_device(self.cfg, int(os.environ.get("LOCAL_RANK", 0)))
        with backend_prints(self.verbose):
            init_distributed(self.cfg, self.device)
        self.groups = ParallelGroups.create(self.layout.tp, self.layout.pp)
        self.scalars = ScalarCollectives()

    def _prepare(self) -> None:
        """Rank 0 creates the run's assets while the others wait, then every rank loads them."""
        def create() -> None:
            self.run_dir.path.mkdir(parents=True, exist_ok=True)
            clear_heartbeats(self.run_dir)  # an earlier job's; this job's ranks write theirs once set up
            _run_assets(self.run_dir, self.cfg)

        # rank 0 creates what is missing (a tokenizer, shards: as long as the corpus takes), then every rank loads it
        on_rank0(create, self.run_dir.path, "prepare", self.scalars)
        self.tokenizer, self.table, self.compression, self.shards = _run_assets(self.run_dir, self.cfg)
        if self.compression is not None and self.rank == 0:
            tqdm.write(self.compression.summary())

    def _build(self, resume: str) -> ResumePoint | None:
        """The model's skeleton, the checkpointer and the engine that materialises this rank's parameters;
        returns the checkpoint to resume from, if any."""
        cfg, groups, layout = self.cfg, self.groups, self.layout
        seed_everything(cfg.train.seed)
        model = model_skeleton(cfg.model, len(self.tokenizer), self.table.codes if self.table else None,
                               self.compression, groups.tp_group, groups.tp_rank, groups.tp)
        self.checkpointer = Checkpointer(self.run_dir, cfg, self.table.content_hash if self.table else None,
                                         checkpoint_layout(cfg, layout, model.vocab.tables.num_rows),
                                         [n for n, _ in model.named_parameters()])
        if cfg.train.trainable_blocks is not None:
            model.train_only_vocabulary_and_ends(cfg.train.trainable_blocks)
        line = describe_groups(model.named_parameters(), cfg.optimizer)  # a rule that matches nothing: refused here
        if self.rank == 0 and cfg.optimizer.groups:  # the default two groups go unsaid
            tqdm.write(line + (f" (per tensor-parallel rank of {groups.tp})" if groups.tp > 1 else ""))
        resuming, zero3 = None, partitions_parameters(self.ds_config, layout)
        if (path := resume_path(resume, self.checkpointer)) is not None:
            resuming = ResumePoint(path, *self.checkpointer.for_this_layout(path, zero3))
            check_resumed_groups(read_marker(path).get("config", {}).get("optimizer", {}), cfg.optimizer)
            self.checkpointer.continue_from(path)  # newer checkpoints (an abandoned line) are set aside

        values = SeededValues(cfg.model.init_std, cfg.train.seed)
        if cfg.train.init_from:  # also when resuming: a checkpoint need not hold the frozen parameters
            values = init_weights_file(self.run_dir.path / cfg.train.init_from, model, groups.tp)
        if cfg.train.compile:
            model.backbone.compile_blocks()
            if zero3 and self.rank == 0:
                tqdm.write("note: train.compile under ZeRO-3 measured no faster than eager (DeepSpeed's hooks break "
                           "each block's graph at every submodule) and slows the first step; see docs/benchmarks.md")
        use_kernels(cfg.train.fused_head_kernel)
        self.vocab_rows = model.vocab.tables.num_rows
        materialise = Materialiser(model, values, self.device, groups.tp_rank, groups.tp,
                                   parameter_partitioner(self.ds_config, layout, groups))
        with backend_prints(self.verbose):
            self.trainer = build_trainer(cfg, model, groups, self.ds_config, layout, optimizer_factory(cfg),
                                         materialise, load_universal=resuming is not None and resuming.universal,
                                         host_tables=host_tables_factory(cfg, groups))
        return resuming

    def _open_data(self) -> None:
        """This data-parallel rank's reader of the training split."""
        cfg = self.cfg
        self.reader_args = dict(
            seq_len=cfg.data.seq_len, tokenizer_fingerprint=tokens_fingerprint(vocabulary(self.tokenizer)),
            seed=cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.train.seed,
            dp_rank=self.groups.dp_rank, dp_size=self.groups.dp, shuffle_window=cfg.data.shuffle_window,
            on_bad_shard=cfg.data.on_bad_shard, verify_checksums=cfg.data.verify_checksums,
            allow_pipe=cfg.data.allow_pipe,
        )
        self.rollbacks = Rollbacks(self.run_dir, cfg.train, self.rank)  # the data they skipped is never read
        skipped = {"skipped": self.rollbacks.skipped} if self.rollbacks.done else {}
        self.reader = open_data(cfg.data, self.shards, **self.reader_args, **skipped)
        if cfg.data.sources:  # a mixture: each source with a validation split is evaluated on its own
            self.validation = [(s.label, s.path, s.weight) for s, r in zip(cfg.data.sources, self.reader.readers)
                               if "val" in r.manifest["splits"]]
        else:
            self.validation = [(None, self.shards, 1.0)] if "val" in self.reader.manifest["splits"] else []
        self.data_name = (", ".join(f"{s.label} ({Path(s.path).resolve()})" for s in cfg.data.sources)
                          if cfg.data.sources else str(Path(self.shards).resolve()))

    def _resume(self, resuming: ResumePoint | None) -> int:
        """Load the checkpoint (engine, optimizer changes, reader position) when resuming; returns the step to
        start from."""
        if resuming is None:
            return 0
        client = self.checkpointer.load(self.trainer, resuming.load)
        start = client["step"]
        saved = client["config"]
        for change in apply_optimizer_changes(self.trainer, saved["optimizer"], self.cfg.optimizer,
                                              self.cfg.train.max_steps, saved["train"]["max_steps"]):
            if self.rank == 0:
                tqdm.write(f"changed on resume, from step {start + 1}: {change}")
        self.data_restarted = self._continue_data(client["reader"], start)
        self.watched = client.get("loss_watch")  # absent from checkpoints saved before the watch was kept
        if self.rank == 0:
            tqdm.write(f"resumed from {resuming.asked} at step {start}"
                       + (" (converted to this layout)" if resuming.universal else ""))
        return start

    def _continue_data(self, saved: dict, start: int) -> bool:
        """The reader continues at the checkpoint's position (``saved``); with ``data.restart``, a position in other
        data (another data.path, shuffle seed or window) is dropped and this data is read from its beginning.
        Returns whether the data restarted."""
        mismatch = self.reader.state_mismatch(saved)
        if mismatch is None or not self.cfg.data.restart:
            self.reader.load_state_dict(saved)  # refuses another stream's position, naming data.restart
            return False
        if self.rank == 0:
            tqdm.write(f"data.restart: from step {start + 1} the data is read from the beginning of "
                       f"{self.data_name} (the checkpoint's position is in other data: {mismatch})")
        return True

    def _start_logs(self, start: int) -> None:
        """The throughput measures, the metrics logger (rank 0), the save clock, the loss watch and the progress
        bar."""
        cfg, t = self.cfg, self.cfg.train
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_len
        self.flops_per_token = forward_flops(cfg.model, cfg.data.seq_len, self.vocab_rows).train
        dtype = torch.bfloat16 if t.dtype == "bf16" else torch.float32
        self.peak = self.scalars.from_rank0(total_peak_flops(t.peak_tflops, self.device, dtype, self.world)
                                            if self.rank == 0 else 0.0)
        restart_peak_memory(self.device)  # the logged peak is the steps' own, not construction's or the probe's
        self.eval_batches = max(1, t.eval_sequences // (t.micro_batch_size * self.layout.dp))
        self.end = min(t.stop_at_step or t.max_steps, t.max_steps)
        self.logger = MetricsLogger(self.run_dir, resume_step=start, cfg=cfg) if self.rank == 0 else None
        if self.logger and self.data_restarted:  # the record at the resumed step says where the data changed
            self.logger.log(start, {"data_restart": True, "data_path": self.data_name})
        if self.rank == 0 and cfg.data.sources:  # each source's share and how often the run goes over it
            samples = t.max_steps * t.global_batch_size
            for line in describe(cfg.data.sources, self.reader.readers, samples, samples * cfg.data.seq_len):
                tqdm.write(line)
        self.clock, self.watch = SaveClock(t.checkpoint_minutes), LossWatch(t)
        if self.watched is not None:
            self.watch.load_state_dict(self.watched)
        self.step_times: deque[float] = deque(maxlen=20)  # the recent steps' seconds, for the ETA
        self.watchdog = Watchdog(self.run_dir, self.rank, t.hang_timeout_s, t.peer_timeout_s, t.first_step_timeout_s,
                                 start).start()
        probe = t.device_probe if t.device_probe is not None else self.device.type == "cuda"
        self.stragglers = StragglerWatch(
            self.run_dir, self.rank, self.world, self.groups.pp_rank, t.straggler_factor, t.straggler_intervals,
            self.scalars, DeviceProbe(self.device, dtype, self.rank) if probe else None)
        self.start = start
        self.progress = tqdm(desc="train", unit="step", dynamic_ncols=True, initial=start, total=t.max_steps,
                             disable=None if self.rank == 0 else True)

    # ------------------------------------------------------------------ the steps
    def run(self) -> TrainResult:
        """The steps from the start to the end, or to a signal (saved, then stopped) or a divergence (raised)."""
        step = self.start
        try:
            while step < self.end:
                step += 1
                self.watchdog.mark(step, "step")
                stepped = self.step(step)
                record = self.measures(step, stepped)
                record |= self.evaluate(step)
                self.log(step, record)
                self.watch.stop_if_diverged()
                if (back := self.roll_back(step)) is not None:
                    step = back
                    continue
                self.checkpoint(step, stepped.stats)
                self.progress.update()
                if self.result.preempted:
                    break
        finally:
            self.progress.close()
            self.reader.close()
            if self.logger:
                self.logger.close()
        self.watchdog.mark(self.end, "end", files=self.checkpointer.dir)
        dist.barrier()
        self.checkpointer.wait()  # the last save, when asynchronous (a preempted job's included)
        if not self.result.preempted:  # a preempted job leaves the rest to the next start: its grace is short
            self.checkpointer.close()
        self.watchdog.finish()
        return self.result

    def step(self, step: int) -> Stepped:
        """One optimizer step, timed, and its loss shown to the divergence watch (under ``train.on_spike=skip``,
        with the limits past which it applies no update)."""
        lr = self.trainer.lr
        if self.logged(step):
            self.stragglers.probe()
        began, compute = time.perf_counter(), self.stragglers.clock()
        limits = self.watch.limits() if self.cfg.train.on_spike != "warn" else None
        # asked only under the fault injection (one source's reader: a mixture has no single global position)
        scale = loss_scale(lambda: self.reader.global_position(), self.cfg.train.global_batch_size)
        stats = self.trainer.train_step(self.reader, lambda: (self.stop.received, self.clock.due),  # read with it
                                        limits, scale, health=self.logged(step))
        slow_step(self.rank, self.stragglers.clock() - compute)
        if step == self.start + 1:
            slow_work("first_step")
        self.stragglers.add(self.stragglers.clock() - compute)
        seconds = time.perf_counter() - began
        self.step_times.append(seconds)
        for warning in self.watch.observe(step, stats.loss, stats.grad_norm, stats.skipped):
            if self.rank == 0:
                tqdm.write(f"warning: {warning}")
        return Stepped(stats, lr, seconds)

    def roll_back(self, step: int) -> int | None:
        """Under ``train.on_spike=rollback``, once a rollback is due (:class:`Rollbacks`): back to the checkpoint before
        the spikes, with the loss watch, the metrics and the progress as they were there; returns its step, to train
        on from (None: no rollback)."""
        spikes = self.watch.spikes_within(step)
        if not self.rollbacks.due(spikes):
            return None
        self.watchdog.mark(step, "rollback")
        client = self.rollbacks.go_back(step, spikes, self.checkpointer, self.trainer, self.reader)
        back = client["step"]
        if self.logger:
            self.logger.rewind(back)
        self.result.records = [r for r in self.result.records if r["step"] <= back]
        self.watch = LossWatch(self.cfg.train)
        if "loss_watch" in client:
            self.watch.load_state_dict(client["loss_watch"])
        self.progress.n = back
        self.progress.refresh()
        return back

    def logged(self, step: int) -> bool:
        """Whether ``step`` is logged: the first, every ``train.log_interval``-th and the last."""
        return step == 1 or step % self.cfg.train.log_interval == 0 or step == self.end

    def measures(self, step: int, stepped: Stepped) -> dict:
        """The step's training metrics when it is logged (the first, every ``train.log_interval``-th, the last), else
        nothing."""
        if not self.logged(step):
            return {}
        stats, watch = stepped.stats, self.watch
        tokens_per_s = self.tokens_per_step / stepped.seconds
        ranks, warnings = self.stragglers.interval()  # every rank: one small collective
        for warning in warnings:
            tqdm.write(f"warning: {warning}")
        return ranks | {
            "loss": stats.loss, "head_losses": stats.head_losses, "lr": stepped.lr,
            "tokens_per_s": tokens_per_s, "step_s": stepped.seconds,
            "tflops": tokens_per_s * self.flops_per_token / 1e12,
            "mfu": tokens_per_s * self.flops_per_token / self.peak, "memory_gb": memory_gb(self.device),
            "nonfinite_steps": watch.nonfinite_steps, "skipped_steps": self.trainer.skipped_steps + watch.skipped,
        } | ({"grad_norm": stats.grad_norm} if stats.grad_norm is not None else {}) | (
            {"loss_spikes": watch.loss_spikes} if self.cfg.train.spike_factor is not None else {}) | (
            {"grad_spikes": watch.grad_spikes} if self.cfg.train.grad_spike_factor is not None else {}) | (
            {"p_inf_loss": stats.p_inf_loss} if stats.p_inf_loss is not None else {}) | (
            {"source_tokens": {name: n * self.cfg.data.seq_len for name, n in self.reader.consumed().items()}}
            if self.cfg.data.sources else {}) | (stats.health or {})

    def evaluate(self, step: int) -> dict:
        """The validation metrics, calibrated ones included (:func:`mhf_dist.model.calibration.validation_metrics`),
        every ``train.eval_interval`` steps and at the last; nothing without a validation split."""
        interval = self.cfg.train.eval_interval
        if not (self.validation and ((interval and step % interval == 0) or step == self.end)):
            return {}
        self.watchdog.mark(step, "eval")
        found = {}
        for label, path, weight in self.validation:
            with ShardReader(path, split="val", **self.reader_args) as val:
                metrics = self.trainer.evaluate(val, self.eval_batches, self.evaluated_batch)
            if label is None:
                return metrics
            found[label] = (metrics, weight)
        # a mixture: every metric per source (val_loss/<source>), and val_loss weighted as the sources are mixed
        total = sum(weight for _, weight in found.values())
        return {f"{key}/{label}": value for label, (metrics, _) in found.items() for key, value in metrics.items()} | {
            "val_loss": sum(metrics["val_loss"] * weight for metrics, weight in found.values()) / total}

    def evaluated_batch(self) -> None:
        """An evaluation's micro-batch is done: progress, for the hang watchdog."""
        slow_work("eval_batch")
        self.watchdog.advance()

    def log(self, step: int, record: dict) -> None:
        """Rank 0 appends a non-empty record to the run's metrics and shows its headline values."""
        if not record or self.rank != 0:
            return
        self.logger.log(step, record)
        self.result.records.append({"step": step, **record})
        left = (self.end - step) * statistics.median(self.step_times) if self.step_times else None
        tqdm.write(step_line(step, self.cfg.train.max_steps, record, left))

    def checkpoint(self, step: int, stats: StepStats) -> None:
        """Save when due (the ranks agree): on a signal (``result.preempted``: the run stops after it), at the end,
        every ``train.checkpoint_interval`` steps, or ``train.checkpoint_minutes`` after the last save; never a step
        whose loss or weights are not finite."""
        t = self.cfg.train
        self.result.preempted, time_due = stats.flags  # agreed by the ranks at the end of the step
        reason = ("signal" if self.result.preempted else "end" if step == self.end else
                  "interval" if t.checkpoint_interval and step % t.checkpoint_interval == 0 else
                  "time" if time_due else None)
        if reason is None:
            return
        if not (self.watch.finite(stats.loss, stats.grad_norm) and weights_finite(self.trainer, self.scalars)):
            if self.rank == 0:
                tqdm.write(f"warning: not saving step {step} ({reason}): its loss or weights are not finite; "
                           f"the newest checkpoint, {self.checkpointer.latest()}, stays the one to resume from")
            return
        self.watchdog.mark(step, "save", files=self.checkpointer.dir)
        saved = self.checkpointer.save(self.trainer, step, step * self.tokens_per_step, self.reader.state_dict(),
                                       reason, statistics.median(self.step_times), self.watch.state_dict())
        self.clock.reset()
        if self.result.preempted:
            self.result.saved = saved


def train(cfg: RunConfig, run_dir: str | Path, resume: str = "auto", stop: StopSignal | None = None,
          verbose: bool = False) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` on this rank (``resume``: auto, none, or a checkpoint directory; ``stop``: the
    handler the caller installed first thing, else one installed now; ``verbose``: DeepSpeed's start-up lines
    too)."""
    loop = TrainingLoop(cfg, stop or StopSignal(), verbose)
    if not loop.setup(run_dir, resume):
        return TrainResult(preempted=True)
    return loop.run()
