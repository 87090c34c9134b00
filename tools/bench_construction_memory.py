"""Benchmark: peak memory per rank while the model is constructed, the engine set up and the first step taken.

Usage: python tools/bench_construction_memory.py [--preset 1b-h4b16k] [--ranks 4] [--layouts zero3,tp2]
                                                 [--step] [--plan] [--old] [--seq-len 64] [--set KEY=VALUE ...]
       python tools/bench_construction_memory.py --runtime [--ranks 4] [--seq-len 128]

Each layout runs on ``--ranks`` local ranks (gloo on CPU, one GPU per rank with ``--device cuda``), as
``mhf-dist train`` builds the model: the skeleton, then each rank materialises only what it keeps
(``mhf_dist.parallel.construct``). Layouts: ``zero3`` (tp = 1, dp = ranks, ZeRO-3), ``tpN`` (tp = N, ZeRO-3
over dp = ranks / N), ``ppN`` (N pipeline stages, ZeRO-1), ``tpNppM``. Reported per rank (the largest over the
ranks is printed): the rise of peak resident host memory (``VmHWM``, restarted before each phase) above the
memory held before construction, for

- construction: skeleton + materialisation (+ ZeRO-3 partitioning),
- engine (``--step``): ``deepspeed.initialize`` with AdamW,
- first step (``--step``): one optimizer step on a synthetic batch of ``--seq-len`` tokens;

and on a GPU the device's peak allocated memory in each phase; and the phase's wall time (until every rank is done),
with each rank's own wall and CPU time listed below the table (of construction: also the CPU time spent drawing and
writing the initial values). The previous construction built the whole fp32
model on every rank before anything was sharded: at least ``4 bytes × parameters`` per rank, which the table
shows as computed (``--old`` measures it instead — as much memory per rank, on every rank at once; then the
tensor-parallel plan adds its shards twice more). Ranks report their progress as they go.

``--plan`` prints `mhf-dist plan`'s numbers beside the measured ones: construction against its rise, the first
step's training peak (model states, activations, DeepSpeed's buffers and the runtime) against the whole
process's peak (what it held before construction plus its rise). ``--runtime`` measures the runtime the plan
counts for a CPU rank (``mhf_dist.commands.plan.CPU_RUNTIME_BYTES``): the whole process's peak through construction,
engine and first step of the tiny preset's structure with tensors of no size (``RUNTIME_MODEL``, 32k
parameters), ZeRO-3 over every rank: Python, torch, DeepSpeed, the process group, the engine's bookkeeping for
every module and parameter, autograd and the kernels' workspaces.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhf_dist.config import load_config
from mhf_dist.parallel.rendezvous import free_port

VOCAB = 32768  # the paper's tokenizer
MiB = 2**20


def parse_layout(name: str, ranks: int) -> tuple[int, int]:
    """``zero3`` / ``tpN`` / ``ppN`` / ``tpNppM`` -> (tp, pp)."""
    if name == "zero3":
        return 1, 1
    match = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", name)
    if not match or not any(match.groups()):
        raise SystemExit(f"--layouts: {name!r} is not zero3, tpN, ppN or tpNppM")
    tp, pp = int(match[1] or 1), int(match[2] or 1)
    if ranks % (tp * pp):
        raise SystemExit(f"--layouts: {name} needs a multiple of {tp * pp} ranks, not {ranks}")
    return tp, pp


class SyntheticBatches:
    """What the trainers read: ``next_batch(n, pin)`` -> ``[n, seq_len + 1]`` token ids (pinned with ``pin``)."""

    def __init__(self, seq_len: int):
        self.seq_len, self.gen = seq_len, torch.Generator().manual_seed(0)

    def next_batch(self, n: int, pin: bool = False) -> torch.Tensor:
        batch = torch.randint(0, VOCAB, (n, self.seq_len + 1), generator=self.gen)
        return batch.pin_memory() if pin else batch


class Phases:
    """Peak host (and device) memory of successive phases, above what the rank held before the first."""

    def __init__(self, rank: int, device: torch.device):
        from mhf_dist.train.throughput import host_rss_bytes

        self.rank, self.device, self.base, self.rows = rank, device, host_rss_bytes(), {}
        self.began = time.perf_counter()

    def start(self, phase: str) -> None:
        from mhf_dist.train.throughput import reset_host_peak

        self.phase = phase
        reset_host_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.rank == 0:
            print(f"  rank 0: {phase} ...", flush=True)
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, **extra: float) -> None:
        """The phase's end: this rank's own time, then every rank's (the phase's); ``extra``: more of its numbers."""
        from mhf_dist.train.throughput import host_peak_bytes

        own, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        torch.distributed.barrier()
        row = {
            "host": host_peak_bytes() - self.base,
            "before": self.base,
            "seconds": time.perf_counter() - self.t0,
            "own": own,
            "cpu": cpu,
            **extra,
        }
        if self.device.type == "cuda":
            row["device"] = torch.cuda.max_memory_allocated(self.device)
        self.rows[self.phase] = row
        if self.rank == 0:
            print(
                f"  rank 0: {self.phase} done in {row['seconds']:.1f} s, peak +{row['host'] / MiB:,.0f} MiB host",
                flush=True,
            )


def timed(values):
    """``values`` (initial values: ``SeededValues``) with the CPU time its ``shard``
    calls take — drawing the values and writing them, on the calling thread — summed in ``values.seconds``."""
    shard, values.seconds = values.shard, 0.0

    def timed_shard(*args, **kwargs):
        began = time.thread_time()
        shard(*args, **kwargs)
        values.seconds += time.thread_time() - began

    values.shard = timed_shard
    return values


def worker(
    rank: int, world: int, port: int, out_dir: str, args: argparse.Namespace, tp: int, pp: int
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    warnings.filterwarnings("ignore")  # torch's and DeepSpeed's notices, once per rank
    import deepspeed

    from mhf_dist.backend import checkpoint_interval, parameter_partitioner
    from mhf_dist.backend.deepspeed.pipeline import build_pipeline
    from mhf_dist.backend.deepspeed.trainer import build_trainer
    from mhf_dist.model import build_model
    from mhf_dist.model.modes import ModelModes
    from mhf_dist.parallel.construct import Materialiser, SeededValues, model_skeleton
    from mhf_dist.parallel.devices import bind_gpu
    from mhf_dist.parallel.groups import ParallelGroups
    from mhf_dist.parallel.tensor_parallel import apply_tensor_parallel
    from mhf_dist.train.optim import optimizer_factory
    from mhf_dist.train.preflight import preflight
    from mhf_dist.vocab.engram_compression import CompressionTable

    device = bind_gpu(rank) if args.device == "cuda" else torch.device("cpu")
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else None)
    cfg = worker_config(args, tp, pp, world, device.type)
    layout, ds_config = preflight(cfg, world, device.type)
    groups = ParallelGroups.create(tp, pp)
    m = cfg.model
    codes = torch.randint(
        1,
        m.hash.num_buckets,
        (VOCAB, m.hash.num_hashes),
        generator=torch.Generator().manual_seed(0),
    )
    compression = CompressionTable.identity(VOCAB) if m.engram else None
    modes = ModelModes(checkpoint_interval(cfg, ds_config), cfg.train.fused_head_kernel)
    torch.distributed.barrier()
    phases = Phases(rank, device)

    phases.start("construction")
    materialise, values = None, None
    if (
        args.old
    ):  # the previous construction: the full model on every rank, then the tensor-parallel shards
        model = build_model(m, VOCAB, codes, compression, seed=cfg.train.seed, modes=modes).to(
            device
        )
        apply_tensor_parallel(model, groups.tp_group, groups.tp_rank, tp)
    else:
        model = model_skeleton(
            m,
            VOCAB,
            codes,
            compression=compression,
            tp_group=groups.tp_group,
            tp_rank=groups.tp_rank,
            tp=tp,
            modes=modes,
        )
        values = timed(SeededValues(m.init_std, cfg.train.seed))
        materialise = Materialiser(
            model,
            values,
            device,
            groups.tp_rank,
            tp,
            parameter_partitioner(ds_config, layout, groups),
        )
        if pp == 1:
            materialise(model)
        else:  # each stage materialises its layers as the pipeline is built
            build_pipeline(model, groups, args.seq_len, materialise)
    phases.stop(**({"values": values.seconds} if values is not None else {}))

    if args.step:
        phases.start("engine")
        # (pp > 1: the pipeline is built again around the layers made above, which are real now)
        trainer = build_trainer(
            cfg,
            model,
            groups,
            ds_config=ds_config,
            layout=layout,
            make_optimizer=optimizer_factory(cfg),
            materialise=materialise,
        )
        phases.stop()
        phases.start("first step")
        trainer.train_step(SyntheticBatches(args.seq_len))
        phases.stop()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(phases.rows))


# --runtime: the tiny preset's structure (its layers, heads, hooks and collectives) with tensors of no size
RUNTIME_MODEL = ["model.d_model=16", "model.ffn_dim=32", "model.hash.num_buckets=256"]


def measure_runtime(args: argparse.Namespace) -> None:
    """What a rank holds that does not grow with the model: construction, engine and first step of the tiny preset
    shrunk to 32k parameters (128 KiB), ZeRO-3 over every rank; the largest rank's whole-process peak."""
    args.preset, args.set, args.step, args.old = (
        "tiny-h4b16k",
        [*args.set, *RUNTIME_MODEL],
        True,
        False,
    )
    result = run_layout(args, "zero3")
    peak = max(r["first step"]["before"] + r["first step"]["host"] for r in result["ranks"])
    print(
        f"runtime: peak resident memory {peak / MiB:,.0f} MiB per rank (the largest of {args.ranks}; "
        f"{' '.join(RUNTIME_MODEL)} on tiny-h4b16k, --seq-len {args.seq_len})"
    )


def run_layout(args: argparse.Namespace, name: str) -> dict:
    tp, pp = parse_layout(name, args.ranks)
    print(
        f"{name}: tp={tp} pp={pp} dp={args.ranks // (tp * pp)} on {args.ranks} ranks "
        f"({'previous' if args.old else 'partitioned'} construction)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker, args=(args.ranks, free_port(), tmp, args, tp, pp), nprocs=args.ranks, join=True
        )
        return {
            "tp": tp,
            "pp": pp,
            "ranks": [
                json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.ranks)
            ],
        }


def worker_config(args: argparse.Namespace, tp: int, pp: int, world: int, device: str):
    """The run config each rank measures (micro-batch 1 of ``--seq-len`` tokens, fp32 on CPU, bf16 on GPUs)."""
    return load_config(
        args.preset,
        overrides=[
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            "data.path=embedded",
            f"data.seq_len={args.seq_len}",
            "train.micro_batch_size=1",
            f"train.global_batch_size={world // (tp * pp)}",
            f"train.device={device}",
            f"train.dtype={'bf16' if device == 'cuda' else 'fp32'}",
            *args.set,
        ],
    )


def planned(args: argparse.Namespace, name: str, result: dict) -> list[tuple]:
    """`mhf-dist plan`'s numbers for the measured layout, each beside its measurement with the relative error."""
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.commands.plan import GB, memory_plan

    tp, pp = result["tp"], result["pp"]
    cfg = worker_config(args, tp, pp, args.ranks, args.device)
    profile = load_profile("cpu-local").model_copy(
        update={
            "gpus_per_node": args.ranks,
            "cores_per_node": args.ranks,
            "backend": "gloo" if args.device == "cpu" else "nccl",
        }
    )
    plans = memory_plan(cfg, profile, 1, VOCAB)
    dp = args.ranks // (tp * pp)
    # construction: its rise; first step: the training peak, runtime included, against the whole process's peak
    predictions = {"construction": (max(p.construction_gb for p in plans) * GB, False)}
    if args.step:
        predictions["first step"] = (max(p.step_peak_gb for p in plans) * GB, True)
    out = []
    for phase, (predicted, whole) in predictions.items():
        measured = max(
            r[phase]["host"] + (r[phase]["before"] if whole else 0) for r in result["ranks"]
        )
        label = f"{phase}, whole process" if whole else phase
        if whole:  # (the rise is printed above)
            out.append((name, dp, f"measured: {label}", measured, 0, None))
        out.append(
            (
                name,
                dp,
                f"plan: {label} ({(predicted - measured) / measured:+.0%})",
                predicted,
                0,
                None,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="1b-h4b16k")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--layouts", default="zero3,tp2", help="comma-separated: zero3, tpN, ppN, tpNppM"
    )
    parser.add_argument(
        "--step",
        action="store_true",
        help="also set up the engine and take one step "
        "(ZeRO-3 AdamW in fp32 holds 16 bytes per parameter / dp on each rank)",
    )
    parser.add_argument(
        "--old", action="store_true", help="measure the previous full-copy construction instead"
    )
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="also print `mhf-dist plan`'s prediction for each "
        "measured phase and its error (construction; with --step, the training peak)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the measured run and its plan (repeatable), e.g. "
        "parallel.deepspeed.zero_optimization.reduce_bucket_size=60000000",
    )
    parser.add_argument(
        "--runtime",
        action="store_true",
        help="measure the runtime a CPU rank holds besides its "
        "model (mhf_dist.commands.plan.CPU_RUNTIME_BYTES) instead; --preset and --layouts unused",
    )
    args = parser.parse_args()
    if args.runtime:
        measure_runtime(args)
        return

    from mhf_dist.model.lm import model_structure
    from mhf_dist.vocab.engram_compression import CompressionTable

    m = load_config(args.preset).model
    with torch.device("meta"):  # sizes only
        counted = model_structure(
            m,
            VOCAB,
            torch.ones(VOCAB, m.hash.num_hashes, dtype=torch.long),
            CompressionTable.identity(VOCAB) if m.engram else None,
        )
    params = sum(p.numel() for p in counted.parameters())
    largest = max(p.numel() for p in counted.parameters())
    print(
        f"{args.preset}: {params / 1e9:.2f}B parameters, {4 * params / 2**30:.2f} GiB in fp32 "
        f"(largest parameter {4 * largest / MiB:,.0f} MiB)",
        flush=True,
    )

    import mhf_dist

    print(f"package: {Path(mhf_dist.__file__).parent}", flush=True)
    rows, own_times = [], []
    for name in args.layouts.split(","):
        result = run_layout(args, name)
        dp = args.ranks // (result["tp"] * result["pp"])
        for phase in result["ranks"][0]:
            own_times.append(
                f"{name} {phase}: "
                + ", ".join(
                    f"{r[phase]['own']:.1f} / {r[phase]['cpu']:.1f}"
                    + (f" ({r[phase]['values']:.1f})" if "values" in r[phase] else "")
                    for r in result["ranks"]
                )
            )
        for phase in result["ranks"][0]:
            worst = max(r[phase]["host"] for r in result["ranks"])
            device = max(r[phase].get("device", 0) for r in result["ranks"])
            rows.append(
                (name, dp, phase, worst, device, max(r[phase]["seconds"] for r in result["ranks"]))
            )
        share = 4 * params / (result["tp"] * dp) if result["pp"] == 1 else None
        if share is not None:
            rows.append(
                (
                    name,
                    dp,
                    "1/(tp·dp) of the model + largest parameter",
                    share + 4 * largest,
                    0,
                    None,
                )
            )
        if not args.old:
            rows.append(
                (name, dp, "previous construction (computed: ≥ 4 B × params)", 4 * params, 0, None)
            )
        if args.plan:
            rows += planned(args, name, result)

    print()
    header = f"{'layout':<10} {'dp':>3}  {'phase':<50} {'peak host / rank':>18} {'device / rank':>14} {'time':>8}"
    print(header)
    print("-" * len(header))
    for name, dp, phase, host, device, seconds in rows:
        dev = f"{device / MiB:,.0f} MiB" if device else "-"
        t = f"{seconds:.1f} s" if seconds is not None else ""
        print(f"{name:<10} {dp:>3}  {phase:<50} {host / MiB:>14,.0f} MiB {dev:>14} {t:>8}")
    print(
        f"\nfull fp32 model {4 * params / MiB:,.0f} MiB, largest parameter {4 * largest / MiB:,.0f} MiB"
    )
    print(
        "each rank's own time, wall / CPU s, rank 0 first (in brackets: the CPU time of drawing and writing the "
        "initial values):\n  " + "\n  ".join(own_times)
    )


if __name__ == "__main__":
    main()
