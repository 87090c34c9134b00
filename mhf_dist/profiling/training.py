"""One configuration's training steps on one rank, timed: forward, backward, optimizer and collectives.

With ``data.document_masking`` (``--set data.document_masking=true``) the step timed is the masked one: the model
built with ``ModelModes(document_eos=DOCUMENT_EOS)``, a batch of documents packed back to back (``synthetic_batch``)
and the loss's targets as the trainers make them (``targets_of``: none where the input is an EOS)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mhf_dist.config import ModelConfig, RunConfig, load_config
from mhf_dist.model import build_model
from mhf_dist.model.documents import targets_of
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.modes import ModelModes
from mhf_dist.parallel.comm import count_collectives
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel
from mhf_dist.profiling.timing import Timer, torch_dtype
from mhf_dist.train.optim import build_optimizer
from mhf_dist.train.throughput import memory_gb, restart_peak_memory
from mhf_dist.vocab.engram_compression import CompressionTable

VOCAB = 32768  # Mistral v0.3's size; signatures are random and ids not compressed (timing does not depend on them)
# data.document_masking without a tokenizer: the EOS id of Mistral v0.3 (``</s>``), the vocabulary VOCAB stands for
DOCUMENT_EOS = 2
# tokens per synthetic document, its EOS included: short web documents'. A masked step costs the same whatever the
# lengths (the attention mask is dense, and the loss weighs ignored targets out at the cost of counted ones), so the
# length only sets how many targets the loss leaves out (1 in DOCUMENT_LEN)
DOCUMENT_LEN = 300


@dataclass
class TrainRow:
    """One configuration at one layout: a row of ``profile.csv`` and of ``profile.json``'s ``training``."""

    size: str
    hash: str
    layout: str
    dtype: str
    seq_len: int
    micro_batch: int
    params: int
    tokens_per_s: float
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    tflops: float
    peak_tflops_measured: float
    peak_tflops_nominal: float | None
    mfu: float
    memory_gb: float
    comm_bytes_per_step: int
    # data.document_masking: the step was the masked one (documents of DOCUMENT_LEN tokens, ending in DOCUMENT_EOS)
    document_masking: bool = False


def step_seconds(step: dict[str, float]) -> float:
    """Seconds of a whole training step from ``TrainingProbe.step``'s split (collectives fall inside it)."""
    return step["forward"] + step["backward"] + step["optimizer"]


def synthetic_batch(micro: int, seq_len: int, eos: int | None) -> torch.Tensor:
    """The probe's batch ``[micro, seq_len + 1]`` on the host: random ids in ``[0, VOCAB)``. With ``eos`` (document
    masking), rows cut from one stream of documents of ``DOCUMENT_LEN`` tokens each, as shards pack them: ``eos``
    ends every document (the stream's tokens ``DOCUMENT_LEN - 1``, ``2 * DOCUMENT_LEN - 1``, ..., read row after
    row, so documents run on from one row into the next) and occurs nowhere else."""
    batch = torch.randint(
        0, VOCAB, (micro, seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    if eos is None:
        return batch
    stream = batch.view(-1)
    stream.masked_fill_(stream == eos, (eos + 1) % VOCAB)  # a random id that happens to be the EOS
    stream[DOCUMENT_LEN - 1 :: DOCUMENT_LEN] = eos
    return batch


def probe_model(
    cfg: ModelConfig,
    tp: int,
    device: torch.device,
    dtype: torch.dtype,
    modes: ModelModes = ModelModes(),
) -> tuple[LanguageModel, int]:
    """(this rank's model, the whole model's parameter count): built on the host at full size with random
    signatures, cut to this rank's tensor-parallel shard (the parallel modules are new, on the host and in fp32),
    then moved to ``device`` and ``dtype`` in one go, so no module is left behind on either."""
    codes = torch.randint(
        1,
        cfg.hash.num_buckets,
        (VOCAB, cfg.hash.num_hashes),
        generator=torch.Generator().manual_seed(0),
    )
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, codes, CompressionTable.identity(VOCAB), modes=modes)
    params = sum(p.numel() for p in model.parameters())
    apply_tensor_parallel(
        model, dist.group.WORLD if tp > 1 else None, dist.get_rank() if tp > 1 else 0, tp
    )
    return model.to(device=device, dtype=dtype), params


def probe_trainee(
    run_cfg: RunConfig,
    tp: int,
    device: torch.device,
    dtype: torch.dtype,
    max_steps: int,
    document_eos: int | None = None,
) -> tuple[LanguageModel, int, torch.optim.Optimizer]:
    """(this rank's model, the whole model's parameter count, its optimizer) as a run of ``run_cfg`` trains them:
    ``probe_model`` in the run's kernel modes, its blocks compiled under ``train.compile``, and the run's AdamW."""
    modes = ModelModes(kernels=run_cfg.train.fused_head_kernel, document_eos=document_eos)
    model, params = probe_model(run_cfg.model, tp, device, dtype, modes)
    if run_cfg.train.compile:
        model.backbone.compile_blocks()
    optimizer, _ = build_optimizer(model.named_parameters(), run_cfg.optimizer, max_steps=max_steps)
    return model, params, optimizer


class TrainingProbe:
    """One configuration trained step by step on this rank (tp ranks build it together): the model of preset
    ``{size}-{hash_name}``, AdamW and one synthetic batch. ``step`` times one step; ``row`` summarises
    the steps it is given, so several probes can be stepped in turn (side by side, as the benchmark does)."""

    def __init__(
        self,
        size: str,
        hash_name: str,
        tp: int,
        *,
        seq_len: int,
        micro: int,
        dtype: str,
        device: torch.device,
        overrides: list[str],
        max_steps: int,
    ):
        run_cfg = load_config(f"{size}-{hash_name}", overrides=[f"parallel.tp={tp}", *overrides])
        cfg = run_cfg.model
        # data.document_masking: the EOS that ends each packed document (no tokenizer here: DOCUMENT_EOS)
        self.eos = DOCUMENT_EOS if run_cfg.data.document_masking else None
        model, self.params, self.optimizer = probe_trainee(
            run_cfg, tp, device, torch_dtype(dtype), max_steps, self.eos
        )
        self.model, self.device = model, device
        self.batch = synthetic_batch(micro, seq_len, self.eos).to(device)
        self.size, self.hash, self.tp, self.dtype, self.seq_len, self.micro = (
            size,
            hash_name,
            tp,
            dtype,
            seq_len,
            micro,
        )
        self.flops_per_token = forward_flops(
            cfg, seq_len, vocab_rows=model.vocab.tables.num_rows
        ).train
        self.comm_bytes = 0

    def step(self) -> dict[str, float]:
        """Seconds of one step's forward, backward, optimizer and (inside them) tensor-parallel collectives."""
        with count_collectives() as log:
            with Timer(self.device) as fwd:
                # with document masking none where the input is an EOS, as the trainers make them; the loss's own
                # count of kept targets is their divisor for a step of one micro-batch on one replica
                targets = targets_of(self.batch, self.eos)
                loss = self.model(self.batch[:, :-1], targets).loss
            with Timer(self.device) as bwd:
                loss.backward()
        with Timer(self.device) as opt:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.comm_bytes = log.total_bytes
        return {
            "forward": fwd.seconds,
            "backward": bwd.seconds,
            "optimizer": opt.seconds,
            "comm": log.seconds,
        }

    def row(
        self, steps: list[dict[str, float]], peak_measured: float, peak_nominal: float | None
    ) -> TrainRow:
        """Median times of ``steps`` (from ``step``) as a row; MFU against ``peak_measured``."""
        split = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        step_s = step_seconds(split)
        tokens_per_s = self.micro * self.seq_len / step_s  # one data-parallel replica
        flops = self.flops_per_token * tokens_per_s
        # a replica spans tp GPUs; CPU ranks share one machine, whose peak was measured
        peak = peak_measured * (self.tp if self.device.type == "cuda" else 1)
        return TrainRow(
            size=self.size,
            hash=self.hash,
            layout=f"tp={self.tp}",
            dtype=self.dtype,
            seq_len=self.seq_len,
            micro_batch=self.micro,
            params=self.params,
            tokens_per_s=tokens_per_s,
            step_s=step_s,
            forward_s=split["forward"],
            backward_s=split["backward"],
            optimizer_s=split["optimizer"],
            comm_s=split["comm"],
            tflops=flops / 1e12,
            peak_tflops_measured=peak_measured / 1e12,
            peak_tflops_nominal=peak_nominal,
            mfu=flops / peak,
            memory_gb=memory_gb(self.device),
            comm_bytes_per_step=self.comm_bytes,
            document_masking=self.eos is not None,
        )


def profile_training(
    size: str,
    hash_name: str,
    tp: int,
    *,
    steps: int,
    warmup: int,
    seq_len: int,
    micro: int,
    dtype: str,
    device: torch.device,
    peak_measured: float,
    peak_nominal: float | None,
    overrides: list[str],
    trace_dir: Path | None = None,
) -> TrainRow:
    """One configuration on this rank (tp ranks run this together): ``warmup`` steps, then ``steps`` measured. Its
    row's memory is the steps' own peak: what the process did before them (building the model on the host at full
    size, a peak-FLOPs matmul measured in the same process) is not in it."""
    probe = TrainingProbe(
        size,
        hash_name,
        tp,
        seq_len=seq_len,
        micro=micro,
        dtype=dtype,
        device=device,
        overrides=overrides,
        max_steps=steps + warmup,
    )
    restart_peak_memory(device)  # from what is held now (the model), which the steps hold too
    profiler = None
    if trace_dir is not None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=steps),
            on_trace_ready=tensorboard_trace_handler(str(trace_dir)),
            record_shapes=True,
        )
        profiler.start()
    times = []
    for _ in range(warmup + steps):
        times.append(probe.step())
        if profiler:
            profiler.step()
    if profiler:
        profiler.stop()
    return probe.row(times[warmup:], peak_measured, peak_nominal)
