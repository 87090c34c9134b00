"""Benchmark: prepare-data's tokens per second per worker, for each input format and tokenizer.

Usage: python tools/bench_prepare.py [--mb 4] [--repeats 3] [--seq-len 2048] [--target-tokens 100e9]
                                     [--node-workers 64] [--array-tasks 16,64]

1. Writes the embedded corpus (repeated to ``--mb`` MB of text) once in every
   input format prepare-data reads: ``.txt``, ``.jsonl``, ``.jsonl.gz``,
   ``.jsonl.zst`` and ``.parquet`` (the last two need the ``data`` extra).
2. Prepares each with one worker (``workers=1``: reading, tokenizing, packing
   and writing shards in this one process, so the rate is what one core does
   end to end) with a byte-level BPE trained on the corpus (8,192 tokens) and,
   when the ``mistral`` extra is installed, the paper's Mistral v0.3 tokenizer
   (else a note says it was left out), and prints tokens per second (the best
   of ``--repeats`` runs: other work on the machine only slows a run down).
3. From each tokenizer's slowest format, prints how long ``--target-tokens``
   take: on one worker, on one node of ``--node-workers`` workers and on
   ``--array-tasks`` such nodes (submit-data's array tasks). That is arithmetic
   on the measured rate assuming workers scale linearly, which a node's memory
   bandwidth and shared storage may not allow; measure a node of yours.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from mhf_dist.data.formats import DataError
from mhf_dist.data.prepare import prepare
from mhf_dist.vocab.tokenizers import MISTRAL_V03, embedded_corpus, load_tokenizer, train_bpe

FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet")


def corpus(megabytes: float) -> list[str]:
    """The embedded corpus's documents, repeated until they hold ``megabytes`` MB of UTF-8 text."""
    docs = [d.strip() for d in embedded_corpus() if d.strip()]
    out, size = [], 0
    while size < megabytes * 1e6:
        for doc in docs:
            out.append(doc)
            size += len(doc.encode())
    return out


def write_inputs(docs: list[str], directory: Path) -> dict[str, Path]:
    """``docs`` in every format of ``FORMATS`` that can be written here (``.zst`` and ``.parquet`` need the
    ``data`` extra)."""
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    files = {
        "txt": directory / "corpus.txt",
        "jsonl": directory / "corpus.jsonl",
        "jsonl.gz": directory / "corpus.jsonl.gz",
    }
    files["txt"].write_text("\n\n".join(docs) + "\n")
    files["jsonl"].write_text(lines)
    with gzip.open(files["jsonl.gz"], "wt") as f:
        f.write(lines)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zstandard
    except ImportError:
        print("note: .jsonl.zst and .parquet left out: pip install 'mhf-dist[data]'")
        return files
    files["jsonl.zst"] = directory / "corpus.jsonl.zst"
    files["jsonl.zst"].write_bytes(zstandard.compress(lines.encode()))
    files["parquet"] = directory / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), files["parquet"], row_group_size=1000)
    return files


def tokenizers(docs: list[str], directory: Path) -> dict[str, str]:
    """The BPE, and Mistral v0.3 when its extra is installed."""
    found = {"bpe-8192": str(train_bpe(docs[:2000], 8192, directory / "bpe"))}
    try:
        load_tokenizer(MISTRAL_V03)
        found["mistral-v0.3"] = MISTRAL_V03
    except (
        Exception
    ) as e:  # the mistral extra missing (or its file unreadable): measured without it
        print(
            f"note: Mistral v0.3 left out ({str(e).splitlines()[0]}): pip install 'mhf-dist[mistral]'"
        )
    return found


def rate(path: Path, tokenizer: str, out: Path, seq_len: int, repeats: int) -> tuple[int, float]:
    """(input tokens, seconds) of the fastest of ``repeats`` single-worker preparations of ``path``."""
    best = float("inf")
    for k in range(repeats):
        start = time.perf_counter()
        manifest = prepare(
            [path],
            tokenizer,
            out / str(k),
            seq_len=seq_len,
            samples_per_shard=1024,
            workers=1,
            progress=False,
        )
        best = min(best, time.perf_counter() - start)
    return manifest["splits"]["train"]["input_tokens"], best


def duration(seconds: float) -> str:
    if seconds > 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds / 3600:.1f} h" if seconds > 3600 else f"{seconds / 60:.0f} min"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=4.0, help="MB of text per format")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per format and tokenizer (the best counts)"
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--target-tokens", type=float, default=100e9, help="tokens of the corpus to project"
    )
    parser.add_argument(
        "--node-workers",
        type=int,
        default=64,
        help="workers (cores) of one node, for the projection",
    )
    parser.add_argument("--array-tasks", default="16,64", help="array tasks (nodes) to project for")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.mb:g} MB per format"
    )

    with tempfile.TemporaryDirectory() as tmp:
        docs = corpus(args.mb)
        files = write_inputs(docs, Path(tmp))
        print(
            f"{'tokenizer':<14}{'format':<11}{'MB':>8}{'tokens':>12}{'seconds':>9}{'tokens/s':>12}"
        )
        slowest: dict[str, float] = {}
        for name, tokenizer in tokenizers(docs, Path(tmp)).items():
            for fmt, path in files.items():
                try:
                    tokens, seconds = rate(
                        path, tokenizer, Path(tmp) / f"out-{name}-{fmt}", args.seq_len, args.repeats
                    )
                except DataError as e:
                    print(f"{name:<14}{fmt:<11} skipped: {e}")
                    continue
                slowest[name] = min(slowest.get(name, float("inf")), tokens / seconds)
                print(
                    f"{name:<14}{fmt:<11}{path.stat().st_size / 1e6:>8.1f}{tokens:>12,}{seconds:>9.1f}"
                    f"{tokens / seconds:>12,.0f}"
                )

    print(
        f"\n{args.target_tokens:.3g} tokens at each tokenizer's slowest measured format (arithmetic, assuming "
        "workers scale linearly):"
    )
    for name, per_worker in slowest.items():
        node = per_worker * args.node_workers
        times = [
            f"one worker {duration(args.target_tokens / per_worker)}",
            f"one node of {args.node_workers} workers {duration(args.target_tokens / node)}",
        ]
        times += [
            f"{n} array tasks {duration(args.target_tokens / (node * int(n)))}"
            for n in args.array_tasks.split(",")
        ]
        print(f"  {name}: " + "; ".join(times))


if __name__ == "__main__":
    main()
