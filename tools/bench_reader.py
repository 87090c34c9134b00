"""Benchmark: shard reader throughput next to what a 100M training step consumes (docs/spec.md §7).

Usage: python tools/bench_reader.py [--seq-len 2048] [--model-seq 512] [--dp-sizes 1,8] [--epochs 20]

1. Prepares shards of the embedded corpus (a byte-level BPE trained on part of
   it, ``seq_len + 1`` tokens per sample) and reports the prepare rate.
2. Reads them with ``ShardReader`` as rank 0 of each ``--dp-sizes``, with
   SHA-256 verification on, and reports the tokens per second one rank
   receives (startup and every shard read included).
3. Times one fp32 forward + backward of the ``100m-h4b16k`` model on this CPU
   for one sequence of ``--model-seq`` tokens (random signatures: the cost
   does not depend on them) and reports tokens per second. A shorter sequence
   than ``--seq-len`` costs less attention per token, so this overstates the
   consumer's rate and understates the ratio.

The ratio reader / consumer must be far above 1: the reader is not the bottleneck.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import ShardReader
from mhf_dist.model import build_model
from mhf_dist.vocab.tokenizers import embedded_corpus, train_bpe


def reader_rate(shards: Path, dp_size: int, epochs: int, seq_len: int) -> float:
    """Tokens per second rank 0 of ``dp_size`` receives over ``epochs`` epochs."""
    start = time.perf_counter()
    with ShardReader(shards, seq_len=seq_len, seed=1, dp_rank=0, dp_size=dp_size) as reader:
        batches = epochs * reader.samples_per_epoch // dp_size
        for _ in range(batches):
            reader.next_batch(1)
    return batches * (seq_len + 1) / (time.perf_counter() - start)


def consumer_rate(model_seq: int, repeats: int) -> float:
    """Tokens per second of fp32 forward + backward of 100m-h4b16k on one sequence (best of ``repeats``)."""
    cfg = load_config("100m-h4b16k").model
    vocab = 32768
    codes = torch.randint(
        1,
        cfg.hash.num_buckets,
        (vocab, cfg.hash.num_hashes),
        generator=torch.Generator().manual_seed(0),
    )
    model = build_model(cfg, vocab, codes)
    ids = torch.randint(vocab, (1, model_seq + 1), generator=torch.Generator().manual_seed(1))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        best = min(best, time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return model_seq / best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--samples-per-shard", type=int, default=32)
    parser.add_argument(
        "--model-seq", type=int, default=512, help="sequence length of the timed training step"
    )
    parser.add_argument(
        "--dp-sizes", default="1,8", help="data-parallel sizes to read as rank 0 of"
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed training steps (the best counts)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        docs = list(embedded_corpus())
        text = Path(tmp) / "corpus.txt"
        text.write_text("\n\n".join(d.strip() for d in docs) + "\n")
        tok = train_bpe(docs[:300], 4096, Path(tmp) / "tok")
        start = time.perf_counter()
        manifest = prepare(
            [text],
            tok,
            Path(tmp) / "shards",
            seq_len=args.seq_len,
            samples_per_shard=args.samples_per_shard,
            workers=2,
            progress=False,
        )
        split = manifest["splits"]["train"]
        rate = split["input_tokens"] / (time.perf_counter() - start)
        print(
            f"prepare: {rate:,.0f} tokens/s with 2 workers, their start-up included "
            f"({split['samples']} samples of {args.seq_len + 1} tokens in {len(split['shards'])} shards)"
        )
        rates = {}
        for dp in map(int, args.dp_sizes.split(",")):
            rates[dp] = reader_rate(Path(tmp) / "shards", dp, args.epochs, args.seq_len)
            print(
                f"reader: {rates[dp]:,.0f} tokens/s to rank 0 of {dp} (SHA-256 verified, prefetch thread)"
            )

    consumed = consumer_rate(args.model_seq, args.repeats)
    print(
        f"training step, 100m-h4b16k fp32 fwd+bwd on this CPU at seq {args.model_seq}: {consumed:,.0f} tokens/s"
    )
    for dp, rate in rates.items():
        print(f"ratio reader / consumer at dp={dp}: {rate / consumed:,.0f}x")


if __name__ == "__main__":
    main()
