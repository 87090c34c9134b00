"""``mhf-dist profile``: throughput, MFU, memory and communication per hash configuration and layout.

For every (layout, hash configuration) the model is built from the preset
``{size}-{hash}`` (``h4b16k+engram``: with the Engram memory, SPEC §8, so its
cost shows next to the same model without it), tensor-parallelised (tp ranks
are local processes), and trained with AdamW on the same synthetic token
batch: warm-up steps, then ``--steps`` measured ones. Each step is split into forward, backward and
optimizer time (CUDA events on GPUs, wall timers on CPU) and the time spent in
tensor-parallel collectives; the FLOPs are the analytic count of
:mod:`mhf_dist.model.flops`, the peak is measured in the same run (a timed
matmul in the run's dtype) and shown next to the cluster profile's nominal one.
Inference: the time per token of ``log P_inf`` over 32K, 128K and 1M registered
tokens next to a Standard LM head over the same vocabulary.

Outputs in ``--out``: ``profile.csv`` / ``profile.json`` (training rows),
``scoring.csv``, TensorBoard scalars, and PNG plots.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from mhf_dist.config import ModelConfig, load_config
from mhf_dist.engram_compression import CompressionTable
from mhf_dist.model import build_model
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.vocabulary import HashVocabulary
from mhf_dist.parallel.comm import count_collectives
from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel
from mhf_dist.train.optim import build_optimizer
from mhf_dist.train.throughput import measured_peak_flops, memory_gb

VOCAB = 32768  # Mistral v0.3's size; signatures are random and ids not compressed (timing does not depend on them)


@dataclass
class TrainRow:
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


class _Timer:
    """Elapsed seconds of a region: CUDA events on GPUs, wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


def step_seconds(step: dict[str, float]) -> float:
    """Seconds of a whole training step from :meth:`TrainingProbe.step`'s split (collectives fall inside it)."""
    return step["forward"] + step["backward"] + step["optimizer"]


class TrainingProbe:
    """One configuration trained step by step on this rank (tp ranks build it together): the model of preset
    ``{size}-{hash_name}``, AdamW and one synthetic batch. :meth:`step` times one step; :meth:`row` summarises
    the steps it is given, so several probes can be stepped in turn (side by side, as the benchmark does)."""

    def __init__(self, size: str, hash_name: str, tp: int, seq_len: int, micro: int, dtype: str,
                 device: torch.device, overrides: list[str], max_steps: int):
        run_cfg = load_config(f"{size}-{hash_name}", overrides=[f"parallel.tp={tp}", *overrides])
        cfg = run_cfg.model
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(1, cfg.hash.num_buckets, (VOCAB, cfg.hash.num_hashes), generator=gen)
        torch.manual_seed(0)
        model = build_model(cfg, VOCAB, codes, CompressionTable.identity(VOCAB)).to(device)
        self.params = sum(p.numel() for p in model.parameters())
        apply_tensor_parallel(model, dist.group.WORLD if tp > 1 else None, dist.get_rank() if tp > 1 else 0, tp)
        model.to(_dtype(dtype))
        if run_cfg.train.compile:
            model.backbone.compile_blocks()
        self.model, self.device = model, device
        self.optimizer, _ = build_optimizer(model, run_cfg.optimizer, max_steps=max_steps)
        self.batch = torch.randint(0, VOCAB, (micro, seq_len + 1), generator=gen).to(device)
        self.size, self.hash, self.tp, self.dtype, self.seq_len, self.micro = size, hash_name, tp, dtype, seq_len, micro
        self.flops_per_token = forward_flops(cfg, seq_len, vocab_rows=model.vocab.tables.num_rows).train
        self.comm_bytes = 0

    def step(self) -> dict[str, float]:
        """Seconds of one step's forward, backward, optimizer and (inside them) tensor-parallel collectives."""
        with count_collectives() as log:
            with _Timer(self.device) as fwd:
                loss = self.model(self.batch[:, :-1], self.batch[:, 1:]).loss
            with _Timer(self.device) as bwd:
                loss.backward()
        with _Timer(self.device) as opt:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.comm_bytes = log.total_bytes
        return {"forward": fwd.seconds, "backward": bwd.seconds, "optimizer": opt.seconds, "comm": log.seconds}

    def row(self, steps: list[dict[str, float]], peak_measured: float, peak_nominal: float | None) -> TrainRow:
        """Median times of ``steps`` (from :meth:`step`) as a row; MFU against ``peak_measured``."""
        split = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        step_s = step_seconds(split)
        tokens_per_s = self.micro * self.seq_len / step_s  # one data-parallel replica
        flops = self.flops_per_token * tokens_per_s
        # a replica spans tp GPUs; CPU ranks share one machine, whose peak was measured
        peak = peak_measured * (self.tp if self.device.type == "cuda" else 1)
        return TrainRow(
            size=self.size, hash=self.hash, layout=f"tp={self.tp}", dtype=self.dtype, seq_len=self.seq_len,
            micro_batch=self.micro, params=self.params, tokens_per_s=tokens_per_s, step_s=step_s,
            forward_s=split["forward"], backward_s=split["backward"], optimizer_s=split["optimizer"],
            comm_s=split["comm"], tflops=flops / 1e12, peak_tflops_measured=peak_measured / 1e12,
            peak_tflops_nominal=peak_nominal, mfu=flops / peak, memory_gb=memory_gb(self.device),
            comm_bytes_per_step=self.comm_bytes,
        )


def profile_training(size: str, hash_name: str, tp: int, steps: int, warmup: int, seq_len: int, micro: int,
                     dtype: str, device: torch.device, peak_measured: float, peak_nominal: float | None,
                     overrides: list[str], trace_dir: Path | None = None) -> TrainRow:
    """One configuration on this rank (tp ranks run this together): ``warmup`` steps, then ``steps`` measured."""
    probe = TrainingProbe(size, hash_name, tp, seq_len, micro, dtype, device, overrides, max_steps=steps + warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profiler = None
    if trace_dir is not None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps),
                           on_trace_ready=tensorboard_trace_handler(str(trace_dir)), record_shapes=True)
        profiler.start()
    times = []
    for _ in range(warmup + steps):
        times.append(probe.step())
        if profiler:
            profiler.step()
    if profiler:
        profiler.stop()
    return probe.row(times[warmup:], peak_measured, peak_nominal)


class RatioSpread(NamedTuple):
    """An MHF/Standard ratio measured once per round: the median over the rounds, their range, and the median's
    standard error (``1.25 σ/√n``, the median's asymptotic error for a normal spread; None from one round), so a
    reader can tell whether a target lies within the run's precision."""

    median: float
    min: float
    max: float
    se: float | None

    @classmethod
    def of(cls, ratios: list[float]) -> RatioSpread:
        se = math.sqrt(math.pi / 2) * statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None
        return cls(statistics.median(ratios), min(ratios), max(ratios), se)


@functools.cache
def _cache_flush(device: torch.device) -> torch.Tensor:
    """A buffer written before every timed head call: in a generation step the backbone's layers run between two
    heads' calls and evict their tables from the caches, so each call starts cold (512 MB outgrows this CPU's
    300 MB L3)."""
    return torch.empty(2**27, device=device)


class InferenceHeads:
    """The two inference heads at one vocabulary size, built once so that they can be timed in rounds (side by
    side with training steps, as the benchmark does): MHF's ``log P_inf`` (the vocabulary of ``cfg``: its
    cascaded decoder, mixers and soft retrievals included, then the signature scores) and a Standard LM head +
    log-softmax, scoring ``tokens`` positions at once (1: one sequence's generation step; more: batched
    decoding). ``compiled``: both heads ``torch.compile``d whole (fullgraph), as ``generate --compile`` runs the
    decode step."""

    def __init__(self, vocab_size: int, cfg: ModelConfig, device: torch.device, dtype: str, tokens: int = 1,
                 compiled: bool = False):
        gen = torch.Generator().manual_seed(0)
        hc = cfg.hash
        codes = torch.randint(1, hc.num_buckets, (vocab_size, hc.num_hashes), generator=gen)
        vocab = HashVocabulary(codes, hc.num_buckets, cfg.d_model, hc.gate_dim, hc.mixer_dim)
        torch.nn.init.normal_(vocab.tables.weight, std=0.02)
        vocab.to(device, _dtype(dtype))
        embedding = torch.randn(vocab_size, cfg.d_model, generator=gen).to(device, _dtype(dtype))
        h = torch.randn(tokens, cfg.d_model, generator=gen).to(device, _dtype(dtype))

        def mhf():
            return vocab.log_p_inf(h)

        def standard():
            return (h @ embedding.t()).log_softmax(-1)

        self.heads = {"mhf": mhf, "standard": standard}
        if compiled:
            self.heads = {name: torch.compile(fn, fullgraph=True) for name, fn in self.heads.items()}
        with torch.no_grad():
            for fn in self.heads.values():  # compilation, first-use allocations
                fn()
        self.device, self.vocab_size, self.tokens, self.compiled = device, vocab_size, tokens, compiled
        # the decoder's matmuls over the LM head's 2·V·d: for one token also the ratio of the weight bytes read
        self.flop_ratio = forward_flops(cfg, 1).vocab_out / (2 * vocab_size * cfg.d_model)

    def time(self, repeats: int) -> dict[str, float]:
        """Seconds of each head's call, the best of ``repeats``, the two heads called in turn from cold caches."""
        samples = {name: [] for name in self.heads}
        with torch.no_grad():
            for _ in range(repeats):
                for name, fn in self.heads.items():
                    _cache_flush(self.device).zero_()
                    with _Timer(self.device) as t:
                        fn()
                    samples[name].append(t.seconds)
        return {name: min(times) for name, times in samples.items()}

    def row(self, timings: list[dict[str, float]]) -> dict:
        """Median per-token times over ``timings`` (from :meth:`time`, one per round) and the MHF/Standard ratio's
        :class:`RatioSpread` over the rounds, next to the analytic FLOP ratio."""
        ratio = RatioSpread.of([t["mhf"] / t["standard"] for t in timings])
        return {"vocab_size": self.vocab_size, "tokens": self.tokens, "compiled": self.compiled,
                "mhf_s_per_token": statistics.median(t["mhf"] for t in timings) / self.tokens,
                "standard_s_per_token": statistics.median(t["standard"] for t in timings) / self.tokens,
                "ratio": ratio.median, "ratio_min": ratio.min, "ratio_max": ratio.max, "ratio_se": ratio.se,
                "rounds": len(timings), "flop_ratio": self.flop_ratio}


def profile_scoring(vocab_sizes: list[int], cfg: ModelConfig, device: torch.device, dtype: str, repeats: int = 5,
                    tokens: int = 1, compiled: bool = False) -> list[dict]:
    """:class:`InferenceHeads` rows per vocabulary size, one round of the best of ``repeats`` calls each."""

    def one_size(v: int) -> dict:  # built and freed one size at a time: a 1M-token Standard head holds 3 GB in fp32
        heads = InferenceHeads(v, cfg, device, dtype, tokens, compiled)
        return heads.row([heads.time(repeats)])

    return [one_size(v) for v in vocab_sizes]


# ------------------------------------------------------------------ workers and the sweep
def worker_main(rows_file: str, spec_json: str) -> int:
    """One rank of a tensor-parallel layout: profile one configuration; rank 0 writes its row to ``rows_file``."""
    spec = json.loads(spec_json)
    device = torch.device(spec.pop("device"))
    if device.type == "cuda":  # each local rank on its own GPU (LOCAL_RANK, as launch_local sets it)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if spec["tp"] > 1:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                                device_id=device if device.type == "cuda" else None)
    trace = spec.pop("trace_dir")
    row = profile_training(device=device, trace_dir=Path(trace) if trace else None, **spec)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(rows_file).write_text(json.dumps(asdict(row)))
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still uses them
        dist.destroy_process_group()
    return 0


def run_sweep(size: str, hashes: list[str], tps: list[int], steps: int, warmup: int, seq_len: int, micro: int,
              dtype: str, out: Path, peak_nominal: float | None, overrides: list[str], trace: bool) -> list[TrainRow]:
    from tqdm.auto import tqdm

    from mhf_dist.launch import launch_local

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = measured_peak_flops(device, _dtype(dtype))
    rows = []
    combos = [(tp, h) for tp in tps for h in hashes]
    for i, (tp, hash_name) in enumerate(tqdm(combos, desc="profile", unit="config")):
        # every configuration in fresh processes, so peak memory is its own
        spec = dict(size=size, hash_name=hash_name, tp=tp, steps=steps, warmup=warmup, seq_len=seq_len, micro=micro,
                    dtype=dtype, peak_measured=peak, peak_nominal=peak_nominal, overrides=overrides,
                    trace_dir=str(out / "trace") if trace and i == 0 else None)
        rows_file = out / f"rows-tp{tp}-{hash_name}.json"
        rc = launch_local(tp, ["profile-worker", "--rows", str(rows_file), "--spec",
                               json.dumps(spec | {"device": device.type})])
        if rc:
            raise RuntimeError(f"profiling {size}-{hash_name} at tp={tp} failed (exit {rc})")
        rows.append(TrainRow(**json.loads(rows_file.read_text())))
        rows_file.unlink()
    return rows


def write_outputs(rows: list[TrainRow], scoring: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    records = [asdict(r) for r in rows]
    (out / "profile.json").write_text(json.dumps({"training": records, "scoring": scoring}, indent=1))
    for name, table in (("profile.csv", records), ("scoring.csv", scoring)):
        with (out / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as tb:
        for r in rows:
            for key in ("tokens_per_s", "mfu", "tflops", "memory_gb", "step_s", "comm_bytes_per_step"):
                tb.add_scalar(f"{r.layout}/{r.hash}/{key}", getattr(r, key), 0)
        for s in scoring:
            tb.add_scalar("scoring/mhf_s_per_token", s["mhf_s_per_token"], s["vocab_size"])
            tb.add_scalar("scoring/standard_s_per_token", s["standard_s_per_token"], s["vocab_size"])
    _plots(rows, scoring, out)


def _plots(rows: list[TrainRow], scoring: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r.layout for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "mfu", "MFU")):
        for j, layout in enumerate(layouts):
            sel = [r for r in rows if r.layout == layout]
            xs = [i + j * 0.8 / len(layouts) for i in range(len(sel))]
            ax.bar(xs, [getattr(r, key) for r in sel], width=0.8 / len(layouts), label=layout)
            for r in sel:
                if r.hash == "standard":
                    ax.axhline(getattr(r, key), linestyle="--", linewidth=1, color="gray")
            ax.set_xticks(range(len(sel)), [r.hash for r in sel], rotation=20)
        ax.set_ylabel(label)
        ax.set_title(f"{label} per hash configuration (dashed: Standard)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in layouts:
        sel = [r for r in rows if r.layout == layout]
        ax.bar([f"{r.hash}\n{layout}" for r in sel], [r.memory_gb for r in sel])
    ax.set_ylabel("peak memory per rank (GB)")
    ax.set_title("memory per configuration")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    vs = [s["vocab_size"] for s in scoring]
    ax.loglog(vs, [s["mhf_s_per_token"] for s in scoring], "o-", label="MultiHashFormer log P_inf")
    ax.loglog(vs, [s["standard_s_per_token"] for s in scoring], "s-", label="Standard LM head")
    ax.set_xlabel("registered vocabulary")
    ax.set_ylabel("seconds per token")
    ax.set_title("inference scoring time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scoring.png", dpi=100)
    plt.close(fig)


def table(rows: list[TrainRow], scoring: list[dict]) -> str:
    lines = [f"{'config':<25} {'layout':<6} {'tokens/s':>10} {'step s':>8} {'fwd':>6} {'bwd':>6} {'opt':>6} "
             f"{'comm':>6} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7} {'comm MB':>8}"]
    for r in rows:
        lines.append(f"{r.size + '-' + r.hash:<25} {r.layout:<6} {r.tokens_per_s:>10.1f} {r.step_s:>8.3f} "
                     f"{r.forward_s:>6.2f} {r.backward_s:>6.2f} {r.optimizer_s:>6.2f} {r.comm_s:>6.2f} "
                     f"{r.tflops:>8.3f} {r.mfu:>6.1%} {r.memory_gb:>7.2f} {r.comm_bytes_per_step / 2**20:>8.1f}")
    lines.append(f"measured peak {rows[0].peak_tflops_measured:.3f} TFLOP/s ({rows[0].dtype} matmul)"
                 + (f", nominal {rows[0].peak_tflops_nominal:g}" if rows[0].peak_tflops_nominal else ""))
    for s in scoring:
        lines.append(f"scoring V={s['vocab_size']:>8,}: MHF {s['mhf_s_per_token'] * 1e3:8.3f} ms/token, Standard "
                     f"{s['standard_s_per_token'] * 1e3:8.3f} ms/token, ratio {s['ratio']:.2f} (FLOP ratio "
                     f"{s['flop_ratio']:.2f})")
    return "\n".join(lines)
