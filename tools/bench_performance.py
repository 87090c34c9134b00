"""Benchmark: MultiHashFormer vs Standard at the 100m preset, side by side in one run.

Reports, on this machine and dtype:
- training tokens/s and MFU of 100m-h4b16k and 100m-standard (AdamW step, fused decoder), eager and with
  ``train.compile`` (compiled backbone blocks), MFU against a ``torch.mm`` peak measured in the same run,
  and the MHF/Standard step-time ratio next to the analytic FLOP ratio;
- inference head time per token (MHF ``log P_inf`` vs a Standard LM head + log-softmax) at V = 32,768 and
  131,072, scoring ``--scoring-tokens`` positions at once, eager and compiled (as ``generate --compile``
  decodes), and the MHF/Standard ratio next to the analytic FLOP (and bytes) ratio;
- the decoder's activation memory (bytes autograd saves for backward) fused vs plain, H4B16K, at seq 2048.

Training steps and inference heads run in rounds: each round measures the peak once, steps every model once
and times every head (the best of 3 calls each), so a machine whose speed drifts (shared CPUs) slows all of
them alike, and the ratios are taken over the machine's states across the run rather than in one moment.
Times are medians over the rounds, MFU is against the median peak, and each MHF/Standard ratio is the median
of the rounds' ratios with the median's standard error and the rounds' range.

Usage: python tools/bench_performance.py [--seq-len 512] [--micro-batch 1] [--rounds 9] [--dtype fp32]
                                         [--scoring-tokens 1] [--set KEY=VALUE ...] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from tqdm.auto import tqdm

from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.flops import forward_flops
from mhf_dist.profiling.scoring import InferenceHeads, RatioSpread
from mhf_dist.profiling.training import VOCAB, TrainingProbe, step_seconds
from mhf_dist.train.host_allocator import keep_freed_host_memory
from mhf_dist.train.throughput import measured_peak_flops


def decoder_activation_bytes(chunk_tokens: int, seq_len: int) -> int:
    """Bytes of the tensors autograd keeps for the decoder's backward (one sequence of ``seq_len`` tokens)."""
    cfg = load_config("100m-h4b16k", overrides=[f"model.decoder_chunk_tokens={chunk_tokens}"]).model
    codes = torch.randint(1, cfg.hash.num_buckets, (VOCAB, cfg.hash.num_hashes))
    vocab = build_model(cfg, VOCAB, codes).vocab
    h = torch.randn(seq_len, cfg.d_model, requires_grad=True)
    targets = torch.randint(0, VOCAB, (seq_len,))
    saved: dict[int, int] = {}
    not_activations = {p.untyped_storage().data_ptr() for p in vocab.parameters()} | {
        h.untyped_storage().data_ptr()
    }

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if (
            ptr not in not_activations
        ):  # parameters (and views of them) and the input are not activations
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab.loss(h, targets).loss.backward()
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=9, help="measured rounds (after one warm-up round)"
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--scoring-tokens",
        type=int,
        default=1,
        help="positions scored at once by the inference-head timing (1: one generation step)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every trained model, e.g. model.decoder_chunk_tokens=4096",
    )
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(
            f"--rounds {args.rounds}: give at least 2, as each ratio's standard error needs two rounds"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    keep_freed_host_memory(device)  # as a training rank's
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    names = {
        ("h4b16k", "false"): "100m-h4b16k",
        ("standard", "false"): "100m-standard",
        ("h4b16k", "true"): "h4b16k+compile",
        ("standard", "true"): "standard+compile",
    }
    probes = {
        key: TrainingProbe(
            "100m",
            key[0],
            1,
            seq_len=args.seq_len,
            micro=args.micro_batch,
            dtype=args.dtype,
            device=device,
            overrides=[*args.set, f"train.compile={key[1]}"],
            max_steps=args.rounds + 1,
        )
        for key in names
    }
    for probe in probes.values():  # warm-up (and compilation)
        probe.step()
    cfg = load_config("100m-h4b16k").model
    heads = {
        (label, v): InferenceHeads(
            v, cfg, device, args.dtype, args.scoring_tokens, label == "compiled"
        )
        for label in ("eager", "compiled")
        for v in (32768, 131072)
    }
    peaks, steps, head_times = [], {key: [] for key in probes}, {key: [] for key in heads}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        peaks.append(measured_peak_flops(device, dtype))
        for key, probe in probes.items():
            steps[key].append(probe.step())
        for key, pair in heads.items():
            head_times[key].append(pair.time(repeats=3))
    peak = statistics.median(peaks)
    rows = {key: probes[key].row(steps[key], peak, None) for key in probes}

    def step_ratio(compiled: str) -> dict:
        """The MHF/Standard step time's ``RatioSpread`` over the rounds."""
        pairs = zip(steps["h4b16k", compiled], steps["standard", compiled])
        return RatioSpread.of([step_seconds(m) / step_seconds(s) for m, s in pairs])._asdict()

    flop_ratio = (
        forward_flops(cfg, args.seq_len).train
        / forward_flops(load_config("100m-standard").model, args.seq_len, vocab_rows=VOCAB).train
    )
    scoring = {
        label: [pair.row(head_times[key]) for key, pair in heads.items() if key[0] == label]
        for label in ("eager", "compiled")
    }
    plain, fused = (
        decoder_activation_bytes(0, 2048),
        decoder_activation_bytes(cfg.decoder_chunk_tokens, 2048),
    )

    def summary(row) -> dict:
        return {
            "tokens_per_s": row.tokens_per_s,
            "mfu": row.mfu,
            "step_s": row.step_s,
            "forward_s": row.forward_s,
            "backward_s": row.backward_s,
            "optimizer_s": row.optimizer_s,
        }

    result = {
        "device": str(device),
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "rounds": args.rounds,
        "overrides": args.set,
        "peak_tflops": peak / 1e12,
        "peak_tflops_range": [min(peaks) / 1e12, max(peaks) / 1e12],
        "mhf": summary(rows["h4b16k", "false"]),
        "standard": summary(rows["standard", "false"]),
        "step_time_ratio": step_ratio("false"),
        "flop_ratio": flop_ratio,
        "compiled": {
            "mhf": summary(rows["h4b16k", "true"]),
            "standard": summary(rows["standard", "true"]),
            "step_time_ratio": step_ratio("true"),
        },
        "scoring": scoring,
        "decoder_activation_mb": {
            "plain": plain / 2**20,
            "fused": fused / 2**20,
            "ratio": fused / plain,
        },
    }
    print(
        f"{device} {args.dtype}, seq {args.seq_len} x micro-batch {args.micro_batch}, {args.rounds} rounds; "
        f"measured torch.mm peak {peak / 1e12:.3f} TFLOP/s (range {min(peaks) / 1e12:.3f}-{max(peaks) / 1e12:.3f})"
    )
    for key, name in names.items():
        r = rows[key]
        print(
            f"  {name:<16} {r.tokens_per_s:9.1f} tokens/s  step {r.step_s:7.3f} s (fwd {r.forward_s:.3f}, "
            f"bwd {r.backward_s:.3f}, opt {r.optimizer_s:.3f})  MFU {r.mfu:6.1%}"
        )
    for label, ratio in (
        ("eager", result["step_time_ratio"]),
        ("compiled", result["compiled"]["step_time_ratio"]),
    ):
        print(
            f"  step-time ratio MHF/Standard, {label}: {ratio['median']:.2f} (s.e. {ratio['se']:.2f}; rounds "
            f"{ratio['min']:.2f}-{ratio['max']:.2f}) vs analytic FLOP ratio {flop_ratio:.2f}"
        )
    for label, per_vocab in scoring.items():
        for s in per_vocab:
            print(
                f"  inference head, {label}, V={s['vocab_size']:>7,}, {s['tokens']} token(s) at once: MHF "
                f"{s['mhf_s_per_token'] * 1e3:.3f} ms/token, Standard {s['standard_s_per_token'] * 1e3:.3f} "
                f"ms/token, ratio {s['ratio']:.2f} (s.e. {s['ratio_se']:.2f}; rounds {s['ratio_min']:.2f}-"
                f"{s['ratio_max']:.2f}; FLOP and bytes ratio {s['flop_ratio']:.2f})"
            )
    print(
        f"  decoder activations at seq 2048: plain {plain / 2**20:.0f} MB, fused {fused / 2**20:.0f} MB "
        f"({fused / plain:.1%} of plain)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
