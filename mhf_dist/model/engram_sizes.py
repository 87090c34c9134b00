"""The prime sizes of the Engram memory's hash tables (docs/spec.md §8), without torch: the model and the job
estimates (``parameter_count``) share them."""

from __future__ import annotations

import math

from mhf_dist.config import EngramConfig


def is_prime(n: int) -> bool:
    if n < 4:
        return n > 1
    return n % 2 != 0 and all(n % p for p in range(3, math.isqrt(n) + 1, 2))


def table_sizes(cfg: EngramConfig, layers: list[int]) -> dict[int, list[list[int]]]:
    """``{layer: [[M of each head] for each order 2..N]}``: distinct primes, each the next unused ``>= table_size``."""
    sizes, candidate = {}, cfg.table_size
    for layer in layers:
        sizes[layer] = []
        for _ in range(2, cfg.max_ngram + 1):
            heads = []
            for _ in range(cfg.heads):
                while not is_prime(candidate):
                    candidate += 1
                heads.append(candidate)
                candidate += 1
            sizes[layer].append(heads)
    return sizes
