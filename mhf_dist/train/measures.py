"""What a logged step's record says of the step's cost and of the model's health: tokens/s, TFLOP/s and MFU against
the peak (``throughput``), this rank's peak memory, and the health metrics the trainer measured in
the step (``train.health_metrics``, ``mhf_dist.model.health``)."""

from __future__ import annotations

import torch

from mhf_dist.model.flops import forward_flops
from mhf_dist.model.variants import variant
from mhf_dist.train.callbacks import Callback, RunContext, Stepped
from mhf_dist.train.throughput import memory_gb, restart_peak_memory, total_peak_flops


class StepMeasures(Callback):
    """The throughput, memory and health fields of each logged step."""

    def on_start(self, run: RunContext) -> None:
        cfg, job = run.cfg, run.job
        rows = variant(cfg.model).vocab_rows(cfg.model, len(run.assets.tokenizer))
        self.flops_per_token = forward_flops(cfg.model, cfg.data.seq_len, rows).train
        self.tokens_per_step, self.device = run.progress.tokens_per_step, job.device
        dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        self.peak = job.scalars.from_rank0(
            total_peak_flops(cfg.train.peak_tflops, job.device, dtype, job.world)
            if job.rank == 0
            else 0.0
        )
        restart_peak_memory(job.device)  # the logged peak is the steps' own, not construction's

    def record(self, step: int, stepped: Stepped) -> dict:
        tokens_per_s = self.tokens_per_step / stepped.seconds
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * self.flops_per_token / 1e12,
            "mfu": tokens_per_s * self.flops_per_token / self.peak,
            "memory_gb": memory_gb(self.device),
        } | (stepped.stats.health or {})
