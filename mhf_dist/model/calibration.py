"""Temperature calibration of ``P_inf`` (docs/spec.md §5): the ``τ`` that minimises the mean NLL of ``P_τ``.

``log P_τ(w) = τ·score(w) - logsumexp_{w'}(τ·score(w'))``, ``score`` as in ``scoring``; ``τ = 1`` is ``P_inf``.
``fit_temperature`` takes two passes over the evaluation tokens, each streaming the vocabulary once
(``scoring.calibration_sums``): the NLL and its slope at ``COARSE`` temperatures log-spaced over ``[TAU_MIN,
TAU_MAX]``, whose cubic Hermite interpolant locates the minimum ``τ̂`` (``estimate_minimum``), then the exact NLL at
``FINE`` temperatures ``τ̂ · exp(±j · FINE_STEP)``. The fitted ``τ`` is the best exact one, ``τ = 1`` included, so
the calibrated NLL is never above the raw one; the callers sum each pass over the data-parallel ranks, so every rank
fits the same ``τ``. Why and how well: docs/design-model.md, "Calibration".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mhf_dist.model.scoring import EvalSums

TAU_MIN, TAU_MAX = 0.02, 4.0
COARSE = 16  # temperatures of the first pass, log-spaced over [TAU_MIN, TAU_MAX]
FINE = 7  # temperatures of the second pass around the first pass's estimate
FINE_STEP = 0.005  # their log-spacing


def as_temperatures(values) -> torch.Tensor:
    """float64 temperatures that fp32 represents exactly (the scores are scaled in fp32): what is reported is
    what was evaluated."""
    return torch.as_tensor(values, dtype=torch.float64).float().double().reshape(-1)


def coarse_temperatures() -> torch.Tensor:
    return as_temperatures(
        torch.logspace(math.log10(TAU_MIN), math.log10(TAU_MAX), COARSE, dtype=torch.float64)
    )


def fine_temperatures(centre: float) -> torch.Tensor:
    steps = torch.arange(FINE, dtype=torch.float64) - FINE // 2
    return as_temperatures((centre * (FINE_STEP * steps).exp()).clamp(TAU_MIN, TAU_MAX))


def safe_exp(x: float) -> float:
    """``exp(x)`` that is ``inf`` instead of an OverflowError (an untrained MHF's perplexity can be that)."""
    return math.exp(x) if x < 709 else float("inf")


def _hermite_minimum(a: float, b: float, fa: float, fb: float, ga: float, gb: float) -> float:
    """The minimiser over ``[a, b]`` of the cubic with values ``fa, fb`` and derivatives ``ga, gb`` at the ends."""
    h = b - a
    c1, c2, c3 = h * ga, 3 * (fb - fa) - h * (2 * ga + gb), 2 * (fa - fb) + h * (ga + gb)
    # p(x) = fa + c1 x + c2 x² + c3 x³ on x ∈ [0, 1]; p'(x) = c1 + 2 c2 x + 3 c3 x²
    if abs(c3) > 1e-12 * (abs(c1) + abs(c2) + 1e-300):
        disc = (2 * c2) ** 2 - 12 * c3 * c1
        roots = [] if disc < 0 else [(-2 * c2 + s * math.sqrt(disc)) / (6 * c3) for s in (1, -1)]
    else:
        roots = [-c1 / (2 * c2)] if c2 else []
    candidates = [0.0, 1.0] + [x for x in roots if 0 < x < 1]
    x = min(candidates, key=lambda x: fa + c1 * x + c2 * x * x + c3 * x**3)
    return a + x * h


def estimate_minimum(coarse: EvalSums) -> float:
    """``τ̂``: where the NLL's derivative changes sign, located by the cubic Hermite interpolant
    (docs/design-model.md, "Calibration")."""
    taus, f, g = coarse.temperatures.tolist(), coarse.nll.tolist(), coarse.slope.tolist()
    if not all(math.isfinite(v) for v in f + g):
        return 1.0
    above = [i for i, slope in enumerate(g) if slope >= 0]
    if not above:
        return taus[-1]
    i = above[0]
    if i == 0:
        return taus[0]
    return _hermite_minimum(taus[i - 1], taus[i], f[i - 1], f[i], g[i - 1], g[i])


@dataclass
class Calibration:
    """Raw and calibrated metrics of one set of evaluation tokens."""

    tokens: int
    p_inf_nll: float  # mean -log P_inf(target)
    top1: float  # next-token accuracy under P_inf (fraction of tokens)
    top5: float
    temperature: float  # τ
    p_inf_nll_calibrated: float  # mean -log P_τ(target)

    @property
    def perplexity(self) -> float:
        return safe_exp(self.p_inf_nll)

    @property
    def perplexity_calibrated(self) -> float:
        return safe_exp(self.p_inf_nll_calibrated)


def fit_temperature(
    evaluate: Callable[[torch.Tensor], Sequence[float] | torch.Tensor],
) -> Calibration:
    """Fit ``τ`` by the module docstring's two passes (coarse, then fine). ``evaluate(temperatures [K])`` runs one
    pass over the evaluation tokens and returns the ``scoring.calibration_sums`` summed over all of them (and over
    every data-parallel rank)."""
    coarse_taus = coarse_temperatures()
    coarse = EvalSums.from_sums(coarse_taus, evaluate(coarse_taus))
    fine_taus = fine_temperatures(estimate_minimum(coarse))
    fine = EvalSums.from_sums(fine_taus, evaluate(fine_taus))
    taus = torch.cat([coarse_taus, fine_taus, torch.ones(1, dtype=torch.float64)])
    nll = torch.cat([coarse.nll, fine.nll, torch.tensor([coarse.p_inf_nll], dtype=torch.float64)])
    # τ = 1 (the last) when nothing is finite (a diverged model, or a target that is not registered: P_inf = 0)
    best = (
        int(torch.nan_to_num(nll, nan=math.inf).argmin())
        if torch.isfinite(nll).any()
        else len(nll) - 1
    )
    return Calibration(
        coarse.tokens,
        coarse.p_inf_nll,
        coarse.top1,
        coarse.top5,
        taus[best].item(),
        nll[best].item(),
    )


def evaluate_at(
    evaluate: Callable[[torch.Tensor], Sequence[float] | torch.Tensor], temperature: float
) -> Calibration:
    """The metrics at a given ``τ`` (one pass): for a ``τ`` fitted on other data."""
    taus = as_temperatures([temperature])
    sums = EvalSums.from_sums(taus, evaluate(taus))
    nll = sums.p_inf_nll if temperature == 1 else sums.nll[0].item()
    return Calibration(sums.tokens, sums.p_inf_nll, sums.top1, sums.top5, taus[0].item(), nll)


def validation_metrics(loss: float, head_losses: list[float], fit: Calibration) -> dict:
    """The ``val_*`` fields of ``metrics.jsonl`` from the training loss and a fit on the validation tokens."""
    return {
        "val_loss": loss,
        "val_p_inf_nll": fit.p_inf_nll,
        "val_ppl": fit.perplexity,
        "val_ppl_calibrated": fit.perplexity_calibrated,
        "val_temperature": fit.temperature,
        "val_p_inf_nll_calibrated": fit.p_inf_nll_calibrated,
        "val_top1": fit.top1,
        "val_top5": fit.top5,
        "val_head_losses": list(head_losses),
    }
