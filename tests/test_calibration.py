"""Evaluation metrics under P_inf and its temperature calibration, against brute force on the full [N, V] matrix."""

from __future__ import annotations

import math

import pytest
import torch

from mhf_dist.model.calibration import (
    TAU_MAX,
    TAU_MIN,
    coarse_temperatures,
    evaluate_at,
    fit_temperature,
)
from mhf_dist.model.scoring import (
    TARGET_CHUNK,
    EvalSums,
    calibration_sums,
    log_p_inf,
    signature_columns,
    target_calibration_sums,
)
from mhf_dist.model.tables import BucketTables
from mhf_dist.vocab.signatures import SignatureTable

H, B, V, N = 3, 16, 61, 400
TRUE_TAU = (
    0.3  # targets are drawn from P_τ at this τ, so the fit has a minimum inside the range to find
)


def make_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    table = SignatureTable.build([f"tok{i}" for i in range(V)], H, B, pad_id=0)
    tables = BucketTables(H, B, 8)
    registered = (table.codes != 0).any(dim=1)
    heads = [3 * torch.randn(N, B, generator=g) for _ in range(H)]
    columns = signature_columns(table.codes.long(), tables)
    # [N, V], the brute-force reference's input
    logp = log_p_inf(heads, columns, registered, tables)
    targets = torch.multinomial((TRUE_TAU * logp).softmax(-1), 1, generator=g).squeeze(1)
    return heads, columns, registered, tables, logp, targets


def brute_nll(logp: torch.Tensor, targets: torch.Tensor, tau: float) -> float:
    """Mean -log P_τ(target) from the full matrix (fp64)."""
    return -(tau * logp.double()).log_softmax(-1).gather(1, targets[:, None]).mean().item()


def brute_slope(logp: torch.Tensor, targets: torch.Tensor, tau: float) -> float:
    """d/dτ of ``brute_nll``: E_{P_τ}[log P_inf] - log P_inf(target)."""
    lp = logp.double()
    p = (tau * lp).softmax(-1)
    expected = torch.where(p > 0, p * lp, 0.0).sum(-1)
    return (expected - lp.gather(1, targets[:, None]).squeeze(1)).mean().item()


def brute_minimum(logp: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(τ*, NLL(τ*)) by golden-section search in log τ over [TAU_MIN, TAU_MAX] (the NLL is convex in τ)."""
    lo, hi = math.log(TAU_MIN), math.log(TAU_MAX)
    r = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - r * (hi - lo), lo + r * (hi - lo)
        if brute_nll(logp, targets, math.exp(a)) < brute_nll(logp, targets, math.exp(b)):
            hi = b
        else:
            lo = a
    tau = math.exp((lo + hi) / 2)
    return tau, brute_nll(logp, targets, tau)


@pytest.mark.parametrize("chunk", [TARGET_CHUNK, H * 1, H * 7, H * V])
def test_streamed_sums_equal_brute_force(chunk):
    heads, columns, registered, tables, logp, targets = make_case()
    taus = coarse_temperatures()
    sums = EvalSums.from_sums(
        taus,
        target_calibration_sums(
            heads,
            columns,
            registered,
            tables=tables,
            targets=targets,
            temperatures=taus,
            chunk_size=chunk,
        ),
    )
    assert sums.tokens == N
    assert sums.p_inf_nll == pytest.approx(brute_nll(logp, targets, 1.0), rel=1e-6)
    for k, tau in enumerate(taus.tolist()):
        assert sums.nll[k].item() == pytest.approx(
            brute_nll(logp, targets, tau), rel=1e-6, abs=1e-6
        ), tau
        assert sums.slope[k].item() == pytest.approx(
            brute_slope(logp, targets, tau), rel=1e-5, abs=1e-5
        ), tau
    top5 = logp.topk(5, dim=-1).indices
    assert sums.top1 == (top5[:, 0] == targets).double().mean().item()
    assert sums.top5 == (top5 == targets[:, None]).any(-1).double().mean().item()
    assert 0 < sums.top1 < sums.top5 < 1
    # log P_inf itself (as `mhf-dist eval` has it from the exported model's logits) gives the same sums
    dense = EvalSums.from_sums(taus, calibration_sums(logp.split(10, dim=1), targets, taus))
    torch.testing.assert_close(dense.nll, sums.nll, rtol=1e-6, atol=1e-6)
    assert (dense.top1, dense.top5) == (sums.top1, sums.top5)


def test_fitted_temperature_is_the_brute_force_minimum():
    heads, columns, registered, tables, logp, targets = make_case(seed=1)
    passes = []

    def evaluate(taus):
        passes.append(taus)
        return target_calibration_sums(
            heads,
            columns,
            registered,
            tables=tables,
            targets=targets,
            temperatures=taus,
            chunk_size=H * 7,
        )

    fit = fit_temperature(evaluate)
    assert len(passes) == 2  # a coarse grid, then a fine one around its estimate
    tau_star, nll_star = brute_minimum(logp, targets)
    assert 0.1 < tau_star < 0.6  # the targets were drawn at τ = 0.3
    assert fit.temperature == pytest.approx(tau_star, rel=0.01)
    # the reported NLL is an exact evaluation at the reported τ, and within 1e-6 of the true minimum
    assert fit.p_inf_nll_calibrated == pytest.approx(
        brute_nll(logp, targets, fit.temperature), rel=1e-6
    )
    assert nll_star - 1e-6 <= fit.p_inf_nll_calibrated <= nll_star + 1e-6
    assert fit.p_inf_nll_calibrated < fit.p_inf_nll - 0.1
    assert fit.perplexity_calibrated == pytest.approx(math.exp(fit.p_inf_nll_calibrated))
    # a τ fitted elsewhere, applied in one pass
    at = evaluate_at(evaluate, fit.temperature)
    assert at.p_inf_nll_calibrated == pytest.approx(fit.p_inf_nll_calibrated, rel=1e-9)
    assert evaluate_at(evaluate, 1.0).p_inf_nll_calibrated == fit.p_inf_nll


def test_a_minimum_outside_the_range_gives_its_end():
    heads, columns, registered, tables, logp, _ = make_case()
    # the least likely registered token (column 0: -inf, the pad)
    uncorrelated = logp.argsort(-1)[:, 1]
    for targets, end in (
        (logp.argmax(-1), TAU_MAX),
        (uncorrelated, TAU_MIN),
    ):  # sure / always wrong
        fit = fit_temperature(
            lambda taus: target_calibration_sums(
                heads, columns, registered, tables=tables, targets=targets, temperatures=taus
            )
        )
        assert fit.temperature == pytest.approx(end, rel=1e-6)


def test_ties_count_against_the_target():
    """Scores [5, 5, 1, ...]: the target tied at the top is not a top-1 hit (another token scores as high)."""
    scores = torch.tensor([[5.0, 5.0, 1.0, 0.0, -1.0, -2.0, -3.0, float("-inf")]])
    taus = coarse_temperatures()
    for target, top1, top5 in ((0, 0.0, 1.0), (1, 0.0, 1.0), (2, 0.0, 1.0), (6, 0.0, 0.0)):
        sums = EvalSums.from_sums(taus, calibration_sums([scores], torch.tensor([target]), taus))
        assert (sums.top1, sums.top5) == (top1, top5), target
    sums = EvalSums.from_sums(taus, calibration_sums([scores[:, 1:]], torch.tensor([0]), taus))
    assert sums.top1 == 1.0
