"""Benchmark: prepare-data's tokens per second per worker, for each input format and tokenizer, next to the
tokenizer's own rate on the same documents.

Usage: python tools/bench_prepare.py [--mb 4] [--rounds 3] [--seq-len 2048] [--workers 1,2] [--formats ...]
                                     [--tokenizers bpe-8192,mistral-v0.3] [--target-tokens 100e9]
                                     [--node-workers 64] [--array-tasks 16,64]

1. Writes the embedded corpus (repeated to ``--mb`` MB of text) once in every
   input format prepare-data reads: ``.txt``, ``.jsonl``, ``.jsonl.gz``,
   ``.jsonl.zst`` and ``.parquet`` (the last two need the ``data`` extra).
2. Measures, in ``--rounds`` rounds, for a byte-level BPE trained on the
   corpus (8,192 tokens) and, when the ``mistral`` extra is installed, the
   paper's Mistral v0.3 tokenizer (else a note says it was left out):
   - prepare-data's rate on each format with one worker (``workers=1``:
     reading, tokenizing, packing and writing shards in one process, the
     tokenizer's loading and saving included, so the rate is what one core does
     end to end), and on ``.jsonl`` with each other ``--workers`` count;
   - right before or after each one-worker preparation (in turn by round), the
     tokenizer's own rate: its Rust tokenizer's ``encode_batch`` over all the
     documents, already in memory, without special tokens (the tokenizer loaded
     before the clock starts; nothing read, nothing packed).
   Each measurement runs in a fresh process (``in_fresh_process``, its start
   not timed), as a preparation does.
   Tokenizers run on one thread (``TOKENIZERS_PARALLELISM=false``,
   ``RAYON_NUM_THREADS=1``: prepare-data's workers are its parallelism). Rates
   count the EOS after each document, as the manifest's ``input_tokens`` does,
   so that both rates are over the same tokens.
3. Prints per tokenizer and format the best prepare-data rate, the best
   ``encode_batch`` rate (of all the tokenizer's) and their ratio, and the
   median of the rounds' ratios (each preparation over the ``encode_batch`` run
   next to it: other work on the machine slows both alike, so that ratio is
   steadier than either rate); the time loading the tokenizer takes (a part of
   every preparation, larger the less text there is); then how the ``.jsonl``
   rate scales with ``--workers`` (workers are spawned processes that each
   start an interpreter: on a few MB that start is a good part of the time;
   more ``--mb`` shows the rate of a long preparation).
4. From each tokenizer's slowest one-worker format, prints how long
   ``--target-tokens`` take: on one worker, on one node of ``--node-workers``
   workers and on ``--array-tasks`` such nodes (submit-data's array tasks). That
   is arithmetic on the measured rate assuming workers scale linearly, which a
   node's memory bandwidth and shared storage may not allow; measure a node of
   yours.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# The rest of mhf_dist is imported where it is used: spawned processes (each measurement's, and a preparation's
# workers) import this module as their ``__main__``, and a worker needs none of it (Hugging Face's import would add
# seconds to each worker's start).
from mhf_dist.data.formats import DataError

FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet")
SCALING_FORMAT = "jsonl"  # the format measured at every --workers count


def corpus(megabytes: float) -> list[str]:
    """The embedded corpus's documents, repeated until they hold ``megabytes`` MB of UTF-8 text."""
    from mhf_dist.vocab.tokenizers import embedded_corpus

    docs = [d.strip() for d in embedded_corpus() if d.strip()]
    out, size = [], 0
    while size < megabytes * 1e6:
        for doc in docs:
            out.append(doc)
            size += len(doc.encode())
    return out


def write_inputs(docs: list[str], directory: Path, formats=FORMATS) -> dict[str, Path]:
    """``docs`` in every format of ``formats`` that can be written here (``.zst`` and ``.parquet`` need the
    ``data`` extra)."""
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    files = {}
    if "txt" in formats:
        files["txt"] = directory / "corpus.txt"
        files["txt"].write_text("\n\n".join(docs) + "\n")
    if "jsonl" in formats:
        files["jsonl"] = directory / "corpus.jsonl"
        files["jsonl"].write_text(lines)
    if "jsonl.gz" in formats:
        files["jsonl.gz"] = directory / "corpus.jsonl.gz"
        with gzip.open(files["jsonl.gz"], "wt") as f:
            f.write(lines)
    if not {"jsonl.zst", "parquet"} & set(formats):
        return files
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zstandard
    except ImportError:
        print("note: .jsonl.zst and .parquet left out: pip install 'mhf-dist[data]'")
        return files
    if "jsonl.zst" in formats:
        files["jsonl.zst"] = directory / "corpus.jsonl.zst"
        files["jsonl.zst"].write_bytes(zstandard.compress(lines.encode()))
    if "parquet" in formats:
        files["parquet"] = directory / "corpus.parquet"
        pq.write_table(pa.table({"text": docs}), files["parquet"], row_group_size=1000)
    return files


def tokenizers(docs: list[str], directory: Path, names: list[str]) -> dict[str, str]:
    """Of ``names``, the BPE (``bpe-8192``) and Mistral v0.3 (``mistral-v0.3``) when its extra is installed."""
    from mhf_dist.vocab.tokenizers import MISTRAL_V03, load_tokenizer, train_bpe

    found = {}
    if "bpe-8192" in names:
        found["bpe-8192"] = str(train_bpe(docs[:2000], 8192, directory / "bpe"))
    if MISTRAL_V03 not in names:
        return found
    try:
        load_tokenizer(MISTRAL_V03)
        found[MISTRAL_V03] = MISTRAL_V03
    except (
        Exception
    ) as e:  # the mistral extra missing (or its file unreadable): measured without it
        print(
            f"note: Mistral v0.3 left out ({str(e).splitlines()[0]}): pip install 'mhf-dist[mistral]'"
        )
    return found


def encode_batch_seconds(docs: list[str], tokenizer: str) -> tuple[int, float, float]:
    """(tokens with an EOS per document, seconds loading the tokenizer, seconds) of the Rust tokenizer's
    ``encode_batch`` over ``docs``."""
    from mhf_dist.vocab.tokenizers import load_tokenizer

    start = time.perf_counter()
    rust = load_tokenizer(tokenizer).backend_tokenizer
    loading = time.perf_counter() - start
    start = time.perf_counter()
    encodings = rust.encode_batch(docs, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return sum(len(e.ids) for e in encodings) + len(docs), loading, seconds


def prepare_seconds(
    path: Path, tokenizer: str, out: Path, seq_len: int, workers: int
) -> tuple[int, float]:
    """(input tokens, seconds) of one preparation of ``path`` with ``workers`` workers (its shards then removed)."""
    from mhf_dist.data.prepare import prepare

    start = time.perf_counter()
    manifest = prepare(
        [path],
        tokenizer,
        out,
        seq_len=seq_len,
        samples_per_shard=1024,
        workers=workers,
        progress=False,
    )
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return manifest["splits"]["train"]["input_tokens"], seconds


def _send_result(conn, measure, args) -> None:
    try:
        conn.send((True, measure(*args)))
    except Exception as e:
        conn.send((False, e))
    conn.close()


def in_fresh_process(measure, *args):
    """``measure(*args)`` in a new (spawned) interpreter, its start not timed: every measurement starts as a
    preparation does, and none inherits another's heap (in one long-lived process, what a large ``encode_batch``
    leaves in the heap can slow the tokenizing after it by a third)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_send_result, args=(send, measure, args))
    process.start()
    send.close()
    try:
        ok, result = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"a measurement's process died (exit code {process.exitcode})") from None
    process.join()
    if not ok:
        raise result
    return result


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
        "--rounds",
        type=int,
        default=3,
        help="rounds of every measurement (the best rate counts; ratios: their median too)",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--workers",
        default="1,2",
        help=f"worker counts: 1 for every format, the others on .{SCALING_FORMAT}",
    )
    parser.add_argument("--formats", default=",".join(FORMATS), help="input formats to measure")
    parser.add_argument(
        "--tokenizers", default="bpe-8192,mistral-v0.3", help="tokenizers to measure"
    )
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
    worker_counts = sorted({1, *(int(w) for w in args.workers.split(","))})
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(
            f"--formats: {', '.join(sorted(unknown))} unknown; use some of {', '.join(FORMATS)}"
        )
    if len(worker_counts) > 1 and SCALING_FORMAT not in formats:
        formats.append(SCALING_FORMAT)
    # one thread per tokenizer call: a worker is one core (tokenizers reads these when it encodes)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; {args.mb:g} MB per format, {args.rounds} rounds"
    )

    with tempfile.TemporaryDirectory() as tmp:
        docs = corpus(args.mb)
        files = write_inputs(docs, Path(tmp), formats)
        megabytes = {fmt: path.stat().st_size / 1e6 for fmt, path in files.items()}
        toks = tokenizers(docs, Path(tmp), args.tokenizers.split(","))
        cases = [(fmt, 1) for fmt in files] + [
            (SCALING_FORMAT, w) for w in worker_counts if w > 1 and SCALING_FORMAT in files
        ]
        load: dict[str, list[float]] = {name: [] for name in toks}
        # (name, format, workers) -> per round (prepared tokens, seconds, the adjacent encode_batch's tokens/s)
        measured: dict[tuple[str, str, int], list[tuple[int, float, float]]] = {}
        skipped: dict[tuple[str, str], str] = {}
        for r in range(args.rounds):
            for name, tokenizer in toks.items():
                for fmt, workers in cases:
                    if (name, fmt) in skipped:
                        continue
                    # encode_batch right before or after each one-worker preparation, in turn by round
                    before = workers == 1 and r % 2 == 0
                    encoded = (
                        in_fresh_process(encode_batch_seconds, docs, tokenizer) if before else None
                    )
                    try:
                        tokens, seconds = in_fresh_process(
                            prepare_seconds,
                            files[fmt],
                            tokenizer,
                            Path(tmp) / "out",
                            args.seq_len,
                            workers,
                        )
                    except DataError as e:
                        skipped[name, fmt] = str(e)
                        continue
                    if workers == 1 and not before:
                        encoded = in_fresh_process(encode_batch_seconds, docs, tokenizer)
                    encode_rate = 0.0
                    if encoded:
                        encoded_tokens, loading, encode_seconds = encoded
                        load[name].append(loading)
                        encode_rate = encoded_tokens / encode_seconds
                        if encoded_tokens != tokens:
                            print(
                                f"note: {name} {fmt}: {tokens:,} tokens prepared, {encoded_tokens:,} encoded"
                            )
                    measured.setdefault((name, fmt, workers), []).append(
                        (tokens, seconds, encode_rate)
                    )
            print(f"round {r + 1} of {args.rounds} done, load average {os.getloadavg()[0]:.1f}")

    print(
        f"\n{'tokenizer':<14}{'format':<11}{'MB':>6}{'tokens':>11}{'prepare/s':>11}{'encode/s':>11}"
        f"{'ratio':>7}{'median':>8}"
    )
    slowest: dict[str, float] = {}
    for name in toks:
        # the best of all its encode_batch runs
        encode_rate = max(
            (e for fmt in files for _, _, e in measured.get((name, fmt, 1), [])), default=0
        )
        for fmt in files:
            if (name, fmt) in skipped:
                print(f"{name:<14}{fmt:<11} skipped: {skipped[name, fmt]}")
                continue
            runs = measured[name, fmt, 1]
            rate = max(n / s for n, s, _ in runs)
            slowest[name] = min(slowest.get(name, float("inf")), rate)
            median = statistics.median(n / s / e for n, s, e in runs)
            print(
                f"{name:<14}{fmt:<11}{megabytes[fmt]:>6.1f}{runs[0][0]:>11,}{rate:>11,.0f}"
                f"{encode_rate:>11,.0f}{rate / encode_rate:>7.2f}{median:>8.2f}"
            )
        if load[name]:
            print(f"{'':<14}(loading the tokenizer: {min(load[name]):.2f} s of each preparation)")

    if len(worker_counts) > 1 and SCALING_FORMAT in files:
        print(
            f"\n.{SCALING_FORMAT} by --workers (best rate; median of the rounds' ratios to one worker):"
        )
        for name in toks:
            if (name, SCALING_FORMAT) in skipped:
                continue
            one = measured[name, SCALING_FORMAT, 1]
            cells = []
            for w in worker_counts:
                runs = measured[name, SCALING_FORMAT, w]
                speedup = statistics.median(
                    (n / s) / (n1 / s1) for (n, s, _), (n1, s1, _) in zip(runs, one)
                )
                cells.append(f"{w}: {max(n / s for n, s, _ in runs):,.0f}/s ({speedup:.2f}x)")
            print(f"  {name}: " + "; ".join(cells))

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
