"""Benchmark: building a SignatureTable over the paper's 32,768-token vocabulary (docs/spec.md §1).

Usage: python tools/bench_signatures.py [--tokenizer DIR|mistral-v0.3] [--repeats 5]
Prints the median build time per hash configuration; the target is well under a second.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import vocabulary
from mhf_dist.vocab.tokenizers import MISTRAL_V03, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=MISTRAL_V03)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokens = vocabulary(load_tokenizer(args.tokenizer))
    print(f"vocabulary: {len(tokens)} tokens ({args.tokenizer})")
    for name, h, b in [("H4B16K", 4, 16384), ("H3B10K", 3, 10624), ("H1B16K", 4, 16384)]:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            table = SignatureTable.build(tokens, h, b, single_id=name == "H1B16K")
            times.append(time.perf_counter() - start)
        print(
            f"{name}: median {statistics.median(times) * 1000:.0f} ms over {args.repeats} builds "
            f"({table.num_registered} registered, unique={table.unique})"
        )


if __name__ == "__main__":
    main()
