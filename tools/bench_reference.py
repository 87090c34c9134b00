"""Benchmark: our Standard and MultiHashFormer training steps side by side with transformers' own Qwen3.

Three models of one backbone (``--size``: 100m by default, hidden 768, 12 layers, 12 heads, 2 KV heads, head_dim 64,
FFN 2560), each trained on one synthetic batch at each shape asked for, each in a process of its own (below):

- ``reference``: transformers' ``Qwen3ForCausalLM`` built from a ``Qwen3Config`` of that shape (V = 32,768, tied
  embeddings, SDPA attention, random init), its loss from its own labels (every position counted, as ours), and
  ``torch.optim.AdamW`` with its default flags;
- ``standard``: our ``{size}-standard`` preset, built as the profiler builds it (``probe_model``,
  ``build_optimizer``);
- ``mhf``: our ``{size}-h4b16k`` preset, built the same way.

A step is forward with the loss, backward, ``clip_grad_norm_`` (``--clip``, default 1.0, as training clips; 0
leaves it out), the optimizer's step and ``zero_grad``. Each model lives in a process of its own, as each would be
run: ours with what mhf-dist gives a training rank (on CPU, the host allocator keeps the memory a step frees:
``mhf_dist.train.host_allocator``), the reference as a plain script runs (the interpreter's defaults; with
``--reference-memory kept`` under our ranks' setting, which isolates the model code). Steps run in rounds: the
processes step in turn, never at once; each round steps every model once at every shape, each round starting with
the next model, so a machine whose speed drifts (shared CPUs) slows all of them alike; the ratios are the medians of
the rounds' ratios (with their standard error and range), tokens/s the medians of the rounds' step times. The
measured rounds follow ``--warmup`` rounds (2 by default: on CPU a process's heap settles over its first two steps,
the optimizer's state taking memory the first step's activations had held, so the second still faults pages in).

Reports per shape: tokens/s of each model with its forward/backward/clip/optimizer split, Standard's tokens/s over
the reference's (also as a ratio of the process's CPU seconds per step, which other processes on a shared machine
disturb less, the least with ``--threads 1``), and MHF's step-time ratio over Standard's next to the analytic FLOP
ratio (``forward_flops``).
``--profile DIR`` also writes, per model and shape, a ``torch.profiler`` table of one step's operators sorted by
self CPU time (and self CUDA time on a GPU).

Usage: python tools/bench_reference.py [--size 100m] [--shapes 256x4,2048x1] [--rounds 5] [--warmup 2]
                                       [--device cpu|cuda]
                                       [--dtype fp32|bf16] [--models reference,standard,mhf] [--clip 1.0]
                                       [--reference-memory default|kept] [--threads N] [--profile DIR]
                                       [--set KEY=VALUE ...] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mhf_dist.cli.options import add_overrides
from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.model.flops import forward_flops
from mhf_dist.profiling.scoring import RatioSpread
from mhf_dist.profiling.timing import Timer, torch_dtype
from mhf_dist.profiling.training import VOCAB, probe_trainee
from mhf_dist.train.host_allocator import keep_freed_host_memory

PARTS = ("forward", "backward", "clip", "optimizer")
# our models: the hash configuration of each one's preset
OUR_HASHES = {"standard": "standard", "mhf": "h4b16k"}


def reference_model(size: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' ``Qwen3ForCausalLM`` of ``{size}-standard``'s shape, with the config ``export-hf`` writes for
    it (no special tokens: none is used), random init, SDPA attention, no cache."""
    from types import SimpleNamespace

    from transformers import Qwen3ForCausalLM

    from mhf_dist.hf.exporter import hf_config

    no_special_tokens = SimpleNamespace(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = hf_config(load_config(f"{size}-standard").model, VOCAB, no_special_tokens, None)
    config.use_cache = False
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).train()


class Stepper:
    """One model and its optimizer, stepped on one synthetic batch per shape (``(seq_len, micro)``)."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        clip: float,
    ):
        self.name, self.model, self.optimizer, self.loss = name, model, optimizer, loss
        self.device, self.clip = device, clip
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, batch: torch.Tensor) -> dict[str, float]:
        """Seconds of one step's parts on ``batch [B, S + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), and
        ``cpu``: the process's CPU seconds over the whole step (all threads; on a shared machine less disturbed by
        other processes than the wall clock, though threads spinning at a barrier count too)."""
        cpu = time.process_time()
        with Timer(self.device) as fwd:
            loss = self.loss(batch)
        with Timer(self.device) as bwd:
            loss.backward()
        with Timer(self.device) as clip:
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        with Timer(self.device) as opt:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {
            "forward": fwd.seconds,
            "backward": bwd.seconds,
            "clip": clip.seconds,
            "optimizer": opt.seconds,
            "cpu": time.process_time() - cpu,
        }


def reference_stepper(size: str, device: torch.device, dtype: torch.dtype, clip: float) -> Stepper:
    model = reference_model(size, device, dtype)
    cfg = load_config(f"{size}-standard").optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )

    def loss(batch: torch.Tensor) -> torch.Tensor:
        # every position's target counted, as in our models (labels shifted here, not by the loss)
        targets = batch[:, 1:].contiguous()
        return model(input_ids=batch[:, :-1], labels=targets, shift_labels=targets).loss

    return Stepper("reference", model, optimizer, loss, device, clip)


def our_stepper(
    name: str,
    preset: str,
    device: torch.device,
    dtype: str,
    clip: float,
    max_steps: int,
    overrides: list[str],
) -> Stepper:
    """Our preset ``preset`` with ``overrides`` (``--set``), built as ``mhf_dist.profiling.training.TrainingProbe``
    builds it (``probe_trainee``: under ``train.compile`` its blocks compiled)."""
    run_cfg = load_config(preset, overrides=overrides)
    model, _, optimizer = probe_trainee(run_cfg, 1, device, torch_dtype(dtype), max_steps)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return model(batch[:, :-1], batch[:, 1:]).loss

    return Stepper(name, model, optimizer, loss, device, clip)


def profile_table(stepper: Stepper, batch: torch.Tensor, device: torch.device, rows: int) -> str:
    """One step's operators by self time (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        stepper.step(batch)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows)
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows)
    return f"{table}\n\nby input shape:\n{by_shape}"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"256x4,2048x1"`` -> ``[(256, 4), (2048, 1)]`` (sequence length x micro-batch)."""
    shapes = []
    for part in text.split(","):
        seq, _, micro = part.partition("x")
        shapes.append((int(seq), int(micro or 1)))
    return shapes


def build_stepper(name: str, spec: dict) -> Stepper:
    device, size, clip = torch.device(spec["device"]), spec["size"], spec["clip"]
    if name == "reference":
        return reference_stepper(size, device, torch_dtype(spec["dtype"]), clip)
    preset = f"{size}-{OUR_HASHES[name]}"
    return our_stepper(
        name, preset, device, spec["dtype"], clip, spec["rounds"] + 2, spec["overrides"]
    )


def serve(conn: Connection, name: str, spec: dict) -> None:
    """One model's process: builds it (ours with a training rank's host memory setting, the reference with it
    only when ``spec["kept_memory"]``), says it is ready, then answers ``("step", shape)`` with the step's seconds
    and ``("profile", shape, path)`` by writing a profile table, until ``None``."""
    device = torch.device(spec["device"])
    if name != "reference" or spec["kept_memory"]:
        keep_freed_host_memory(device)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    stepper = build_stepper(name, spec)
    gen = torch.Generator().manual_seed(1)  # the same batches in every process
    batches = {
        shape: torch.randint(0, VOCAB, (shape[1], shape[0] + 1), generator=gen).to(device)
        for shape in spec["shapes"]
    }
    conn.send(torch.get_num_threads())
    while (request := conn.recv()) is not None:
        kind, shape, *path = request
        batch = batches[tuple(shape)]
        if kind == "step":
            conn.send(stepper.step(batch))
        else:
            Path(path[0]).write_text(profile_table(stepper, batch, device, spec["profile_rows"]))
            conn.send(None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", default="100m", help="the presets' size (100m: 100m-standard, ...)"
    )
    parser.add_argument("--shapes", default="256x4,2048x1", help="SEQxMICRO, comma-separated")
    parser.add_argument(
        "--rounds", type=int, default=5, help="measured rounds (after the --warmup rounds)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="unmeasured rounds first (each model, each shape)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--models", default="reference,standard,mhf")
    parser.add_argument(
        "--clip", type=float, default=1.0, help="clip_grad_norm_ max norm; 0: no clipping"
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="write per-operator tables to this folder"
    )
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's intra-op threads (default: torch's own); 1 makes the CPU-time ratio nearly immune to other "
        "processes on a shared machine (no thread waits at a barrier for a descheduled one)",
    )
    parser.add_argument(
        "--reference-memory",
        choices=["default", "kept"],
        default="default",
        help="the reference's host memory: the interpreter's defaults, as a plain script runs (default), or "
        "kept as mhf-dist's CPU ranks keep it",
    )
    add_overrides(
        parser,
        "a config override for our models (repeatable, as mhf-dist profile's --set), e.g. "
        "train.compile=true",
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(
            f"--rounds {args.rounds}: give at least 2 (a ratio's standard error needs two)"
        )
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: give 0 or more rounds")
    device = torch.device(args.device)
    shapes = parse_shapes(args.shapes)
    names = args.models.split(",")
    if unknown := set(names) - {"reference", *OUR_HASHES}:
        parser.error(f"--models: no model {sorted(unknown)}; choose from reference,standard,mhf")
    try:  # read here, so a wrong --set stops the run before any model is built
        std_cfg, mhf_cfg = (
            load_config(f"{args.size}-{OUR_HASHES[m]}", overrides=args.overrides).model
            for m in ("standard", "mhf")
        )
    except ConfigError as e:
        parser.error(str(e))
    spec = {
        "device": args.device,
        "dtype": args.dtype,
        "size": args.size,
        "clip": args.clip,
        "rounds": args.rounds,
        "shapes": shapes,
        "threads": args.threads,
        "kept_memory": args.reference_memory == "kept",
        "profile_rows": args.profile_rows,
        "overrides": args.overrides,
    }
    # one process per model (spawned: a CUDA context is not forked), built one after the other
    context = multiprocessing.get_context("spawn")
    conns, threads = {}, None
    for name in names:
        conns[name], child = context.Pipe()
        context.Process(target=serve, args=(child, name, spec), daemon=True).start()
        threads = conns[name].recv()

    def step(name: str, shape: tuple[int, int]) -> dict[str, float]:
        conns[name].send(("step", shape))
        return conns[name].recv()

    for _ in range(args.warmup):
        for shape in shapes:
            for name in names:
                step(name, shape)
    times = {(name, shape): [] for name in names for shape in shapes}
    for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for shape in shapes:
            # each round starts with the next model, so none always runs right after another
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name, shape].append(step(name, shape))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for shape in shapes:
            for name in names:
                conns[name].send(
                    ("profile", shape, str(args.profile / f"{name}_{shape[0]}x{shape[1]}.txt"))
                )
                conns[name].recv()
    for conn in conns.values():
        conn.send(None)

    def total(t: dict[str, float]) -> float:
        return sum(t[k] for k in PARTS)

    def ratio(num: str, den: str, shape, clock=total) -> dict:
        pairs = zip(times[num, shape], times[den, shape])
        return RatioSpread.of([clock(n) / clock(d) for n, d in pairs])._asdict()

    def cpu(t: dict[str, float]) -> float:
        return t["cpu"]

    result = {
        "size": args.size,
        "device": str(device),
        "dtype": args.dtype,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "clip": args.clip,
        "torch": torch.__version__,
        "threads": threads,
        "reference_memory": args.reference_memory,
        "overrides": args.overrides,
        "shapes": [],
    }
    print(
        f"{args.size}, {device} {args.dtype}, {args.rounds} rounds after {args.warmup}, {threads} threads, torch "
        f"{torch.__version__}, clip {args.clip or 'off'}, reference memory {args.reference_memory}"
        + (f", ours with --set {' '.join(args.overrides)}" if args.overrides else "")
    )
    for shape in shapes:
        seq, micro = shape
        tokens = seq * micro
        entry = {"seq_len": seq, "micro_batch": micro, "models": {}}
        print(f"seq {seq} x micro-batch {micro}:")
        for name in names:
            split = {k: statistics.median(t[k] for t in times[name, shape]) for k in PARTS}
            step_s = statistics.median(total(t) for t in times[name, shape])
            cpu_s = statistics.median(cpu(t) for t in times[name, shape])
            entry["models"][name] = {
                "tokens_per_s": tokens / step_s,
                "step_s": step_s,
                **split,
                "cpu_s": cpu_s,
            }
            print(
                f"  {name:<10} {tokens / step_s:8.1f} tokens/s  step {step_s:7.3f} s (fwd "
                f"{split['forward']:.3f}, bwd {split['backward']:.3f}, clip {split['clip']:.3f}, opt "
                f"{split['optimizer']:.3f}; CPU {cpu_s:.3f} s)"
            )
        if "reference" in names and "standard" in names:
            r = ratio("reference", "standard", shape)  # step-time ratio = tokens/s ratio
            c = ratio("reference", "standard", shape, cpu)
            entry["standard_over_reference"] = r
            entry["standard_over_reference_cpu"] = c
            print(
                f"  Standard / reference tokens/s: {r['median']:.3f} (s.e. {r['se']:.3f}; rounds "
                f"{r['min']:.3f}-{r['max']:.3f}); by CPU time {c['median']:.3f} (s.e. {c['se']:.3f})"
            )
        if "mhf" in names and "standard" in names:
            r = ratio("mhf", "standard", shape)
            flop = (
                forward_flops(mhf_cfg, seq).train
                / forward_flops(std_cfg, seq, vocab_rows=std_cfg.padded_vocab_rows(VOCAB)).train
            )
            entry["mhf_over_standard_step"] = r
            entry["mhf_over_standard_flops"] = flop
            print(
                f"  MHF / Standard step time: {r['median']:.3f} (s.e. {r['se']:.3f}; rounds "
                f"{r['min']:.3f}-{r['max']:.3f}) vs FLOP ratio {flop:.3f}"
            )
        result["shapes"].append(entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
