"""Inference scoring: MHF's ``log P_inf`` against a Standard LM head + log-softmax, timed per token."""

from __future__ import annotations

import functools
import math
import statistics
from typing import NamedTuple

import torch

from mhf_dist.config import ModelConfig
from mhf_dist.model.flops import forward_flops
from mhf_dist.model.vocabulary import HashVocabulary
from mhf_dist.profiling.timing import Timer, torch_dtype


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
        se = (
            math.sqrt(math.pi / 2) * statistics.stdev(ratios) / math.sqrt(len(ratios))
            if len(ratios) > 1
            else None
        )
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

    def __init__(
        self,
        vocab_size: int,
        cfg: ModelConfig,
        device: torch.device,
        dtype: str,
        tokens: int = 1,
        compiled: bool = False,
    ):
        gen = torch.Generator().manual_seed(0)
        hc = cfg.hash
        codes = torch.randint(1, hc.num_buckets, (vocab_size, hc.num_hashes), generator=gen)
        vocab = HashVocabulary(
            codes, hc.num_buckets, cfg.d_model, gate_dim=hc.gate_dim, mixer_dim=hc.mixer_dim
        )
        torch.nn.init.normal_(vocab.tables.weight, std=0.02)
        vocab.to(device, torch_dtype(dtype))
        embedding = torch.randn(vocab_size, cfg.d_model, generator=gen).to(
            device, torch_dtype(dtype)
        )
        h = torch.randn(tokens, cfg.d_model, generator=gen).to(device, torch_dtype(dtype))

        def mhf():
            return vocab.log_p_inf(h)

        def standard():
            return (h @ embedding.t()).log_softmax(-1)

        self.heads = {"mhf": mhf, "standard": standard}
        if compiled:
            self.heads = {
                name: torch.compile(fn, fullgraph=True) for name, fn in self.heads.items()
            }
        with torch.no_grad():
            for fn in self.heads.values():  # compilation, first-use allocations
                fn()
        self.device, self.vocab_size, self.tokens, self.compiled = (
            device,
            vocab_size,
            tokens,
            compiled,
        )
        # the decoder's matmuls over the LM head's 2·V·d: for one token also the ratio of the weight bytes read
        self.flop_ratio = forward_flops(cfg, 1).vocab_out / (2 * vocab_size * cfg.d_model)

    def time(self, repeats: int) -> dict[str, float]:
        """Seconds of each head's call, the best of ``repeats``, the two heads called in turn from cold caches."""
        samples = {name: [] for name in self.heads}
        with torch.no_grad():
            for _ in range(repeats):
                for name, fn in self.heads.items():
                    _cache_flush(self.device).zero_()
                    with Timer(self.device) as t:
                        fn()
                    samples[name].append(t.seconds)
        return {name: min(times) for name, times in samples.items()}

    def row(self, timings: list[dict[str, float]]) -> dict:
        """Median per-token times over ``timings`` (from ``time``, one per round) and the MHF/Standard ratio's
        ``RatioSpread`` over the rounds, next to the analytic FLOP ratio."""
        ratio = RatioSpread.of([t["mhf"] / t["standard"] for t in timings])
        return {
            "vocab_size": self.vocab_size,
            "tokens": self.tokens,
            "compiled": self.compiled,
            "mhf_s_per_token": statistics.median(t["mhf"] for t in timings) / self.tokens,
            "standard_s_per_token": statistics.median(t["standard"] for t in timings) / self.tokens,
            "ratio": ratio.median,
            "ratio_min": ratio.min,
            "ratio_max": ratio.max,
            "ratio_se": ratio.se,
            "rounds": len(timings),
            "flop_ratio": self.flop_ratio,
        }


def profile_scoring(
    vocab_sizes: list[int],
    cfg: ModelConfig,
    device: torch.device,
    *,
    dtype: str,
    repeats: int = 5,
    tokens: int = 1,
    compiled: bool = False,
    rounds: int = 5,
) -> list[dict]:
    """``InferenceHeads`` rows per vocabulary size: ``rounds`` rounds, each timing every size in turn (the best
    of ``repeats`` calls), so that a machine whose speed drifts moves every size alike; medians over the rounds.
    Every size's heads are held at once (a 1M-token Standard head at d = 768 is 3 GB in fp32)."""
    heads = [InferenceHeads(v, cfg, device, dtype, tokens, compiled) for v in vocab_sizes]
    timings = [[] for _ in heads]
    for _ in range(rounds):
        for h, times in zip(heads, timings):
            times.append(h.time(repeats))
    return [h.row(times) for h, times in zip(heads, timings)]
