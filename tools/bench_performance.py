"""Benchmark: MultiHashFormer vs Standard at the 100m preset, side by side in one run (issue: performance).

Reports, on this machine and dtype:
- training tokens/s and MFU of 100m-h4b16k and 100m-standard (AdamW step, fused decoder), eager and with
  ``train.compile`` (compiled backbone blocks), MFU against a ``torch.mm`` peak measured in the same run,
  and the MHF/Standard step-time ratio next to the analytic FLOP ratio;
- inference head time per token (MHF ``log P_inf`` vs a Standard LM head + log-softmax) at V = 32,768 and
  131,072;
- the decoder's activation memory (bytes autograd saves for backward) fused vs plain, H4B16K, at seq 2048.

Usage: python tools/bench_performance.py [--seq-len 512] [--steps 2] [--dtype fp32] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from mhf_dist.config import load_config
from mhf_dist.model import build_model
from mhf_dist.model.flops import forward_flops
from mhf_dist.profile import VOCAB, profile_scoring, profile_training
from mhf_dist.train.throughput import measured_peak_flops


def decoder_activation_bytes(chunk_tokens: int, seq_len: int) -> int:
    """Bytes of the tensors autograd keeps for the decoder's backward (one sequence of ``seq_len`` tokens)."""
    cfg = load_config("100m-h4b16k", overrides=[f"model.decoder_chunk_tokens={chunk_tokens}"]).model
    codes = torch.randint(1, cfg.hash.num_buckets, (VOCAB, cfg.hash.num_hashes))
    vocab = build_model(cfg, VOCAB, codes).vocab
    h = torch.randn(seq_len, cfg.d_model, requires_grad=True)
    targets = torch.randint(0, VOCAB, (seq_len,))
    saved: dict[int, int] = {}
    not_activations = {p.untyped_storage().data_ptr() for p in vocab.parameters()} | {h.untyped_storage().data_ptr()}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in not_activations:  # parameters (and views of them) and the input are not activations
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab.loss(h, targets).loss.backward()
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = measured_peak_flops(device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    rows = {(h, c): profile_training("100m", h, 1, args.steps, 1, args.seq_len, 1, args.dtype, device, peak, None,
                                     [f"train.compile={c}"])
            for c in ("false", "true") for h in ("h4b16k", "standard")}
    mhf, std = rows["h4b16k", "false"], rows["standard", "false"]
    mhf_c, std_c = rows["h4b16k", "true"], rows["standard", "true"]
    flop_ratio = (forward_flops(load_config("100m-h4b16k").model, args.seq_len).train
                  / forward_flops(load_config("100m-standard").model, args.seq_len, vocab_rows=VOCAB).train)
    cfg = load_config("100m-h4b16k").model
    scoring = profile_scoring([32768, 131072], cfg.d_model, cfg.hash.num_hashes, cfg.hash.num_buckets, device,
                              args.dtype)
    plain, fused = decoder_activation_bytes(0, 2048), decoder_activation_bytes(1024, 2048)
    result = {
        "device": str(device), "dtype": args.dtype, "seq_len": args.seq_len, "peak_tflops": peak / 1e12,
        "mhf": {"tokens_per_s": mhf.tokens_per_s, "mfu": mhf.mfu, "step_s": mhf.step_s},
        "standard": {"tokens_per_s": std.tokens_per_s, "mfu": std.mfu, "step_s": std.step_s},
        "step_time_ratio": mhf.step_s / std.step_s, "flop_ratio": flop_ratio,
        "compiled": {"mhf": {"tokens_per_s": mhf_c.tokens_per_s, "mfu": mhf_c.mfu, "step_s": mhf_c.step_s},
                     "standard": {"tokens_per_s": std_c.tokens_per_s, "mfu": std_c.mfu, "step_s": std_c.step_s},
                     "step_time_ratio": mhf_c.step_s / std_c.step_s},
        "scoring": scoring,
        "decoder_activation_mb": {"plain": plain / 2**20, "fused": fused / 2**20, "ratio": fused / plain},
    }
    print(f"{device} {args.dtype}, seq {args.seq_len}; measured torch.mm peak {peak / 1e12:.3f} TFLOP/s")
    named = (("100m-h4b16k", mhf), ("100m-standard", std), ("h4b16k+compile", mhf_c), ("standard+compile", std_c))
    for name, r in named:
        print(f"  {name:<16} {r.tokens_per_s:8.1f} tokens/s  step {r.step_s:6.2f} s  MFU {r.mfu:6.1%}")
    print(f"  step-time ratio MHF/Standard {result['step_time_ratio']:.2f} (compiled "
          f"{result['compiled']['step_time_ratio']:.2f}) vs analytic FLOP ratio {flop_ratio:.2f}")
    for s in scoring:
        print(f"  inference head V={s['vocab_size']:>7,}: MHF {s['mhf_s_per_token'] * 1e3:.3f} ms/token, Standard "
              f"{s['standard_s_per_token'] * 1e3:.3f} ms/token, ratio {s['ratio']:.2f}")
    print(f"  decoder activations at seq 2048: plain {plain / 2**20:.0f} MB, fused {fused / 2**20:.0f} MB "
          f"({fused / plain:.1%} of plain)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
