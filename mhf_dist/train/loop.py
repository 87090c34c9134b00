"""The training loop, run by every rank (one process, or N under torchrun / the DeepSpeed launcher).

Order of work: resolve the layout and DeepSpeed config (every config error
before any collective runs) → initialise ``torch.distributed`` → rank 0
prepares the run directory (tokenizer, signature table, Engram compression
table, shards of the embedded corpus) while the others wait → every rank
builds the model's skeleton (its tensor-parallel modules, parameters on the
meta device) and hands it to the engine, which creates only the parameters
this rank keeps — its ZeRO-3 partition, or its pipeline stage — initialised
from the run seed or from ``train.init_from`` (:mod:`mhf_dist.parallel.construct`)
→ steps.

A run resumes from its newest complete checkpoint by default (``--resume
auto``) and continues bit-identically: the same data, optimizer, scheduler and
RNG states. SIGUSR1/SIGTERM on any rank make all ranks finish the step, save
and stop with :data:`PREEMPTED_EXIT_CODE`.

Each optimizer step consumes ``train.global_batch_size`` sequences; the logged
loss is the SPEC §5 training loss averaged over that batch, with each head's
term. Rank 0 logs ``metrics.jsonl`` and TensorBoard scalars (loss, head losses,
lr, grad norm, tokens/s, TFLOP/s, MFU, memory) and shows the progress bar.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mhf_dist.config import RunConfig
from mhf_dist.data.reader import ShardReader
from mhf_dist.launch import free_port
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.lm import LanguageModel
from mhf_dist.parallel.construct import FileValues, Materialiser, SeededValues, full_shapes, model_skeleton
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.run_dir import RunDir
from mhf_dist.run_lock import RunDirLocked, RunLock
from mhf_dist.token_list import tokens_fingerprint, vocabulary
from mhf_dist.train.checkpoint import Checkpointer, CheckpointError
from mhf_dist.train.divergence import LossWatch
from mhf_dist.parallel.layout import preflight
from mhf_dist.train.engine import build_trainer, device_type, zero_stage
from mhf_dist.train.metrics import MetricsLogger
from mhf_dist.train.optim import apply_optimizer_changes
from mhf_dist.train.preemption import GRACE_ENV, StopSignal
from mhf_dist.train.throughput import memory_gb, total_peak_flops


def leave_process_group() -> None:
    """Shut this rank's process group down (its communication threads end here, not at interpreter exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(cfg: RunConfig, local_rank: int) -> torch.device:
    if device_type(cfg) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    """Join the job's process group (a one-rank group when started without a launcher)."""
    # DeepSpeed's per-step info lines and torch's deprecation notices about the collectives it calls
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else None)


def _run_assets(run: RunDir, cfg: RunConfig):
    """(tokenizer, signature table or None, Engram compression table or None, shard directory), created on
    first use."""
    tokenizer = run.ensure_tokenizer(cfg)
    table = run.ensure_signatures(cfg.model.hash, tokenizer) if cfg.model.variant == "mhf" else None
    compression = run.ensure_compression(tokenizer) if cfg.model.engram is not None else None
    return tokenizer, table, compression, run.ensure_shards(cfg)


class SaveClock:
    """``train.checkpoint_minutes``: a save is due once that long passed since the last one (or the start); the
    ranks agree on it each step, so a slow clock on one rank cannot split the job."""

    def __init__(self, minutes: float | None):
        self.seconds = None if minutes is None else minutes * 60
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()

    @property
    def due(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.since >= self.seconds


@dataclass
class TrainResult:
    records: list[dict] = field(default_factory=list)  # what rank 0 logged in this process
    preempted: bool = False  # stopped on a signal after saving


def _resume_path(resume: str, checkpointer: Checkpointer) -> Path | None:
    if resume == "auto":
        return checkpointer.latest()
    if resume == "none":
        if checkpointer.latest() is not None:
            raise CheckpointError(f"{checkpointer.dir} holds checkpoints; resume (--resume auto) or use a new run dir")
        return None
    return Path(resume)


def init_weights_file(path: Path, model: LanguageModel, tp: int) -> FileValues:
    """``train.init_from``: every parameter from a full state dict (our names), each rank reading its shards."""
    if not path.is_file():
        raise CheckpointError(f"train.init_from: {path} does not exist; point it at a model.safetensors "
                              "(mhf-dist export, import-hf or expand-vocab write one)")
    try:
        return FileValues(path, full_shapes(model, tp))
    except Exception as e:  # truncated file, or weights of another architecture
        raise CheckpointError(f"train.init_from: {path} cannot initialise this model ({e}); "
                              "use weights exported from a run with the same model config") from e


def log_save(path: Path, reason: str, seconds: float) -> None:
    """The save and its duration; a warning when it took more than half the job's grace period (the time between
    SLURM's warning signal and the kill), since a save on that signal might then not finish."""
    tqdm.write(f"saved {path} ({reason}, {seconds:.1f} s)")
    grace = float(os.environ.get(GRACE_ENV, "inf"))
    if seconds > grace / 2:
        tqdm.write(f"warning: this save took {seconds:.0f} s, more than half the grace period of {grace:.0f} s "
                   f"between SLURM's warning and the time limit; submit with a longer --grace")


def take_lock(run_path: Path, rank: int, scalars: ScalarCollectives) -> None:
    """Rank 0 takes the run directory's lock (released when the process exits, errors included); every rank stops
    if another job holds it."""
    refused = None
    if rank == 0:
        lock = RunLock(run_path)
        try:
            if (warning := lock.acquire()) is not None:
                tqdm.write(f"warning: {warning}")
            atexit.register(lock.release)
        except RunDirLocked as e:
            refused = e
    if scalars.any(refused is not None)[0]:
        raise refused or RunDirLocked(f"{run_path} is in use by another job (rank 0 names it)")


def weights_finite(engine, scalars: ScalarCollectives) -> bool:
    """Whether every rank's parameters (its ZeRO-3 partition, or its whole stage) hold only finite values."""
    bad = any(not torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in engine.module.parameters())
    return not scalars.any(bad)[0]


def rank_env_from_slurm() -> None:
    """Inside an ``srun`` step, each task is one rank: take RANK/LOCAL_RANK/WORLD_SIZE from SLURM."""
    if "RANK" not in os.environ and "SLURM_STEP_ID" in os.environ:
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"])


def train(cfg: RunConfig, run_dir: str | Path, resume: str = "auto", stop: StopSignal | None = None) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` on this rank (``resume``: auto, none, or a checkpoint directory; ``stop``: the
    handler the caller installed first thing, else one installed now)."""
    stop = stop or StopSignal()
    rank_env_from_slurm()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    layout, ds_config = preflight(cfg, world, device_type(cfg))
    device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed(device)
    groups = ParallelGroups.create(layout.tp, layout.pp)
    scalars = ScalarCollectives()

    run = RunDir(run_dir)
    take_lock(run.path, rank, scalars)
    if rank == 0:  # rank 0 creates what is missing; then every rank loads it
        run.path.mkdir(parents=True, exist_ok=True)
        _run_assets(run, cfg)
    dist.barrier()
    tokenizer, table, compression, shards = _run_assets(run, cfg)
    if compression is not None and rank == 0:
        tqdm.write(compression.summary())

    seed_everything(cfg.train.seed)
    model = model_skeleton(cfg.model, len(tokenizer), table.codes if table else None, compression,
                           groups.tp_group, groups.tp_rank, groups.tp)
    checkpointer = Checkpointer(run.path, cfg, table.content_hash if table else None,
                                {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
                                [n for n, _ in model.named_parameters()])
    resume_from, universal = None, False
    if (path := _resume_path(resume, checkpointer)) is not None:
        resume_from, universal = checkpointer.for_this_layout(path)
        checkpointer.continue_from(path)  # newer checkpoints (an abandoned line) are set aside
        if universal:
            ds_config = ds_config | {"checkpoint": {"load_universal": True}}

    values = SeededValues(cfg.model.init_std, cfg.train.seed)
    if cfg.train.init_from:  # also when resuming: a checkpoint need not hold the frozen parameters
        values = init_weights_file(run.path / cfg.train.init_from, model, groups.tp)
    if cfg.train.trainable_blocks is not None:
        model.train_only_vocabulary_and_ends(cfg.train.trainable_blocks)
    if cfg.train.compile:
        model.backbone.compile_blocks()
    vocab_rows = model.vocab.tables.num_rows
    zero3 = ds_config if layout.pp == 1 and zero_stage(ds_config) == 3 else None
    materialise = Materialiser(model, values, device, groups.tp_rank, groups.tp, zero3, groups)
    trainer = build_trainer(cfg, model, groups, ds_config, layout, materialise)
    checkpointer.host = getattr(trainer, "host", None)
    del model
    if scalars.any(stop.received)[0]:  # signalled during start-up: nothing trained yet, so nothing to save
        if rank == 0:
            tqdm.write("stopped by a signal during start-up; nothing to save")
        return TrainResult(preempted=True)

    reader_args = dict(
        seq_len=cfg.data.seq_len, tokenizer_fingerprint=tokens_fingerprint(vocabulary(tokenizer)),
        seed=cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.train.seed,
        dp_rank=groups.dp_rank, dp_size=groups.dp, shuffle_window=cfg.data.shuffle_window,
        on_bad_shard=cfg.data.on_bad_shard, verify_checksums=cfg.data.verify_checksums,
        allow_pipe=cfg.data.allow_pipe,
    )
    reader = ShardReader(shards, **reader_args)
    has_val = "val" in reader.manifest["splits"]

    start = 0
    if resume_from is not None:
        client = checkpointer.load(trainer.engine, resume_from)
        start = client["step"]
        for change in apply_optimizer_changes(trainer.engine, client["config"]["optimizer"], cfg.optimizer,
                                              cfg.train.max_steps):
            if rank == 0:
                tqdm.write(f"changed on resume, from step {start + 1}: {change}")
        reader.load_state_dict(client["reader"])
        if rank == 0:
            tqdm.write(f"resumed from {path} at step {start}" + (" (converted to this layout)" if universal else ""))
    if rank == 0:  # only now: a config that a checkpoint refused never reaches config.yaml
        run.save_config(cfg)

    t = cfg.train
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    flops_per_token = forward_flops(cfg.model, cfg.data.seq_len, vocab_rows).train
    peak = scalars.from_rank0(total_peak_flops(
        t.peak_tflops, device, torch.bfloat16 if t.dtype == "bf16" else torch.float32, world) if rank == 0 else 0.0)

    eval_batches = max(1, t.eval_sequences // (t.micro_batch_size * layout.dp))
    end = min(t.stop_at_step or t.max_steps, t.max_steps)
    logger = MetricsLogger(run.path, resume_step=start, cfg=cfg) if rank == 0 else None
    result, clock, watch = TrainResult(), SaveClock(t.checkpoint_minutes), LossWatch(t)
    progress = tqdm(range(start, end), desc="train", unit="step", dynamic_ncols=True, initial=start,
                    total=t.max_steps, disable=None if rank == 0 else True)
    try:
        for step in progress:
            lr = trainer.lr
            began = time.perf_counter()
            stats = trainer.train_step(reader)
            elapsed = time.perf_counter() - began
            for warning in watch.observe(step + 1, stats.loss, stats.grad_norm):
                if rank == 0:
                    tqdm.write(f"warning: {warning}")
            last = step + 1 == end
            record = {}
            if step == 0 or (step + 1) % t.log_interval == 0 or last:
                tokens_per_s = tokens_per_step / elapsed
                record = {
                    "loss": stats.loss, "head_losses": stats.head_losses, "lr": lr,
                    "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
                    "mfu": tokens_per_s * flops_per_token / peak, "memory_gb": memory_gb(device),
                    "nonfinite_steps": watch.nonfinite_steps, "skipped_steps": trainer.engine.skipped_steps,
                } | ({"grad_norm": stats.grad_norm} if stats.grad_norm is not None else {}) | (
                    {"loss_spikes": watch.loss_spikes} if t.spike_factor is not None else {}) | (
                    {"p_inf_loss": stats.p_inf_loss} if stats.p_inf_loss is not None else {})
            if has_val and ((t.eval_interval and (step + 1) % t.eval_interval == 0) or last):
                with ShardReader(shards, split="val", **reader_args) as val:
                    record |= trainer.evaluate(val, eval_batches)  # mhf_dist.model.calibration.validation_metrics
            if record and rank == 0:
                logger.log(step + 1, record)
                result.records.append({"step": step + 1, **record})
                tqdm.write(f"step {step + 1:>6} | " + " | ".join(f"{k} {v:.4g}" for k, v in record.items() if k in (
                    "loss", "val_ppl", "val_ppl_calibrated", "lr", "tokens_per_s", "mfu")))
            watch.stop_if_diverged()
            result.preempted, time_due = scalars.any(stop.received, clock.due)
            reason = ("signal" if result.preempted else "end" if step + 1 == end else
                      "interval" if t.checkpoint_interval and (step + 1) % t.checkpoint_interval == 0 else
                      "time" if time_due else None)
            if reason and not (watch.finite(stats.loss, stats.grad_norm) and weights_finite(trainer.engine, scalars)):
                if rank == 0:
                    tqdm.write(f"warning: not saving step {step + 1} ({reason}): its loss or weights are not finite; "
                               f"the newest checkpoint, {checkpointer.latest()}, stays the one to resume from")
            elif reason:
                save_began = time.perf_counter()
                saved = checkpointer.save(trainer.engine, step + 1, (step + 1) * tokens_per_step, reader.state_dict(),
                                          reason)
                clock.reset()
                if rank == 0:
                    log_save(saved, reason, time.perf_counter() - save_began)
            if result.preempted:
                break
    finally:
        reader.close()
        if logger:
            logger.close()
    dist.barrier()
    return result
