"""Inference over the real vocabulary: ``log P_inf`` (docs/spec.md §5), and the evaluation sums.

``score(w) = Σ_i log p_i[H_i(w)]`` over registered tokens (``registered`` is False for the pad token: ``-inf``), each
head's raw logits standing in for its ``log p_i`` (``CascadedDecoder.scores``). ``signature_columns`` maps every
signature coordinate, once per model, to its column of the heads' scores laid side by side (``side_by_side``), of
which each rank of a bucket-sharded model holds its own. ``log_p_inf`` returns ``[N, V]`` in large vocabulary
chunks; ``target_log_p_inf`` streams small ones and never holds ``[N, V]``. ``log_normaliser`` is ``log Z`` over
the vocabulary for the ``log P_inf`` training term (``model.hash.p_inf_loss_weight``), in bounded memory forward and
backward. ``EvalSums`` and ``calibration_sums``: the evaluation sums' layout and values. Why, and what it costs:
docs/design-model.md, "Scoring ``log P_inf``" and "Training on ``P_inf``".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from mhf_dist.model.tables import BucketTables

LOG_P_INF_CHUNK = 2**20  # values gathered per position in one chunk of log_p_inf
TARGET_CHUNK = 2**16  # ... and of target_log_p_inf


def signature_columns(codes: torch.Tensor, tables: BucketTables) -> torch.Tensor:
    """``codes [V, H]`` -> ``[H, V]``: each coordinate's column in ``side_by_side``'s layout on this rank."""
    local, owned = tables.local_index(codes.t())
    head_offset = (
        torch.arange(codes.shape[1], device=codes.device).unsqueeze(-1) * tables.local_rows
    )
    return torch.where(owned, local + head_offset, codes.shape[1] * tables.local_rows).contiguous()


def side_by_side(head_scores: list[torch.Tensor]) -> torch.Tensor:
    """H tensors ``[N, R_local]`` -> ``[N, H·R_local + 1]``, the last column zero."""
    return torch.cat([*head_scores, head_scores[0].new_zeros(head_scores[0].shape[0], 1)], dim=-1)


def signature_scores(
    side: torch.Tensor, columns: torch.Tensor, registered: torch.Tensor, tables: BucketTables
) -> torch.Tensor:
    """``score [N, V]`` from ``side_by_side`` head scores, ``columns [H, V]`` (``signature_columns``) and
    ``registered [V]``."""
    return torch.where(registered, tables.reduce_sum(_partial_scores(side, columns)), float("-inf"))


def _partial_scores(side: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``Σ_i side[:, columns[i]]``: the scores of the coordinates held here."""
    scores = side.index_select(1, columns[0])
    for head_columns in columns[1:]:
        scores += side.index_select(1, head_columns)
    return scores


def score_chunks(
    side: torch.Tensor,
    columns: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    chunk_size: int,
) -> Iterator[torch.Tensor]:
    """``signature_scores`` over consecutive vocabulary chunks, each gathering ``chunk_size`` values per
    token (``chunk_size / H`` tokens)."""
    step = max(1, chunk_size // columns.shape[0])
    for start in range(0, columns.shape[1], step):
        yield signature_scores(
            side, columns[:, start : start + step], registered[start : start + step], tables
        )


def log_p_inf(
    head_scores: list[torch.Tensor],
    columns: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    chunk_size: int = LOG_P_INF_CHUNK,
) -> torch.Tensor:
    """``log P_inf [N, V]``: signature scores renormalised over the registered vocabulary."""
    chunks = list(score_chunks(side_by_side(head_scores), columns, registered, tables, chunk_size))
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)).log_softmax(dim=-1)


def target_log_p_inf(
    head_scores: list[torch.Tensor],
    columns: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    targets: torch.Tensor,
    chunk_size: int = TARGET_CHUNK,
) -> torch.Tensor:
    """``log P_inf(target) [N]`` without materialising ``[N, V]``: a running logsumexp over vocabulary chunks."""
    side = side_by_side(head_scores)
    log_z = side.new_full((targets.shape[0],), float("-inf"))
    for scores in score_chunks(side, columns, registered, tables, chunk_size):
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
    target_score = tables.reduce_sum(side.gather(1, columns[:, targets].t()).sum(-1))
    return target_score - log_z


class _LogNormaliser(torch.autograd.Function):
    """``log Z [N]`` from H head scores ``[N, R_local]``; backward recomputes the chunks' scores
    (docs/design-model.md, "Training on ``P_inf``")."""

    @staticmethod
    def forward(ctx, columns, registered, tables, chunk_size, *head_scores):
        stats = torch.promote_types(head_scores[0].dtype, torch.float32)
        side = side_by_side(head_scores).to(stats)
        log_z = side.new_full((side.shape[0],), float("-inf"))
        for scores in score_chunks(side, columns, registered, tables, chunk_size):
            log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
        ctx.save_for_backward(columns, registered, log_z, *head_scores)
        ctx.tables, ctx.chunk_size = tables, chunk_size
        return log_z

    @staticmethod
    def backward(ctx, grad):
        columns, registered, log_z, *head_scores = ctx.saved_tensors
        side = side_by_side(head_scores).to(log_z.dtype)
        grad_side = torch.zeros_like(side)
        shift, weight = log_z[:, None], grad.to(log_z.dtype)[:, None]
        step = max(1, ctx.chunk_size // columns.shape[0])
        for start in range(0, columns.shape[1], step):
            chunk = columns[:, start : start + step]
            scores = ctx.tables.recompute_sum(_partial_scores(side, chunk))
            # ∂L/∂score(w) = g · P_inf(w); tokens that are not registered have neither
            d_scores = (
                scores.sub_(shift)
                .exp_()
                .mul_(weight)
                .masked_fill_(~registered[start : start + step], 0.0)
            )
            for head_columns in chunk:
                grad_side.index_add_(1, head_columns, d_scores)
        # the last column stands for coordinates held elsewhere: its gradient is theirs
        # (split by the scores' width: under ZeRO-3 the tables' weight is partitioned while this runs)
        grads = grad_side[:, :-1].to(head_scores[0].dtype).split(head_scores[0].shape[-1], dim=1)
        return (None, None, None, None, *grads)


def log_normaliser(
    head_scores: list[torch.Tensor],
    columns: torch.Tensor,
    registered: torch.Tensor,
    tables: BucketTables,
    chunk_size: int = TARGET_CHUNK,
) -> torch.Tensor:
    """``log Z = logsumexp_{w ∈ V} score(w)`` ``[N]`` (fp32 or wider) over the registered vocabulary, so that
    ``log P_inf(w) = score(w) − log Z``: differentiable in ``head_scores`` without materialising ``[N, V]``,
    forward or backward (docs/design-model.md, "Training on ``P_inf``")."""
    return _LogNormaliser.apply(columns, registered, tables, chunk_size, *head_scores)


TOP_K = 5  # the evaluation's top-5 accuracy; ``calibration_sums`` keeps one more candidate (ties)


@dataclass
class EvalSums:
    """``calibration_sums`` summed over tokens (and ranks), as means per token. The class also defines the sums'
    layout, float64 ``[4 + 2K]`` for ``K`` temperatures (``length``): ``TOKENS``, ``P_INF_NLL``,
    ``TOP1``, ``TOP5``, then the ``K`` NLL sums and the ``K`` slopes; the model writes it and every engine
    gathers it by it."""

    TOKENS, P_INF_NLL, TOP1, TOP5 = range(4)  # the first entries
    PER_TEMPERATURE = 4  # where the per-temperature entries begin

    temperatures: torch.Tensor  # [K] float64
    tokens: int
    p_inf_nll: float
    top1: float
    top5: float
    nll: torch.Tensor  # [K] mean -log P_τk(target)
    slope: torch.Tensor  # [K] its derivative in τ

    @classmethod
    def length(cls, temperatures: int) -> int:
        """The number of sums for ``temperatures`` temperatures."""
        return cls.PER_TEMPERATURE + 2 * temperatures

    @classmethod
    def from_sums(
        cls, temperatures: torch.Tensor, sums: Sequence[float] | torch.Tensor
    ) -> EvalSums:
        sums, k = (
            torch.as_tensor(sums, dtype=torch.float64).cpu().reshape(-1),
            temperatures.shape[0],
        )
        if sums.shape[0] <= 1 or sums[cls.TOKENS] <= 0:  # (a pass over nothing sums to 0)
            raise ValueError("no evaluation tokens: the split holds no sequences")
        if sums.shape[0] != cls.length(k):
            raise ValueError(
                f"{sums.shape[0]} sums for {k} temperatures (expected {cls.length(k)})"
            )
        n, first = sums[cls.TOKENS].item(), cls.PER_TEMPERATURE
        return cls(
            temperatures,
            int(n),
            sums[cls.P_INF_NLL].item() / n,
            sums[cls.TOP1].item() / n,
            sums[cls.TOP5].item() / n,
            sums[first : first + k] / n,
            sums[first + k :] / n,
        )


@torch.no_grad()
def calibration_sums(
    chunks: Iterable[torch.Tensor], targets: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """Evaluation sums over tokens for ``P_inf`` and its temperature-scaled form, streamed over vocabulary chunks.

    ``chunks``: consecutive column blocks ``[N, c]`` of ``score(w)`` over the whole vocabulary (``-inf`` for
    unregistered tokens; ``log P_inf`` works as well, as it differs by one constant per token), ``targets [N]``,
    ``temperatures [K]`` (τ > 0). With ``log P_τ(w) = τ·score(w) - logsumexp_{w'}(τ·score(w'))`` (``τ = 1``:
    ``log P_inf``; a constant added to every score of a token cancels), returns float64 ``[4 + 2K]`` laid out as
    ``EvalSums`` defines:

    - ``[TOKENS]`` N, ``[P_INF_NLL]`` ``Σ_t -log P_inf(target)``;
    - ``[TOP1]``, ``[TOP5]``: tokens whose target ranks first / in the first five under ``P_inf`` (the
      ranking does not depend on τ): fewer than k other registered tokens score at least as high as the target
      (a token tied with the target counts ahead of it);
    - ``[4 + k]``: ``Σ_t -log P_τk(target)``, and ``[4 + K + k]``: its derivative in τ,
      ``Σ_t (E_{P_τk}[score] - score(target))`` (the NLL is convex in τ: this is the slope the fit brackets with).

    One pass keeps, per token, the running maximum score ``M``, and per temperature ``Σ exp(τ_k (s - M))`` and
    ``Σ exp(τ_k (s - M)) (s - M)`` (rescaled when ``M`` grows), the target's score (taken from its chunk, so
    it compares exactly with the others) and the six highest scores, in fp32 (or the scores' wider dtype).
    Memory: ``O(N × c + K × N)``, never ``[N, V]``; time: ``K`` exponentials per score. Run on every rank of a
    tensor-parallel group, whose chunks are already reduced over the group, it gives every rank the same sums.
    Evaluation only: no gradient.
    """
    chunks = iter(chunks)
    first = next(chunks)
    n, device, dtype = (
        targets.shape[0],
        targets.device,
        torch.promote_types(first.dtype, torch.float32),
    )
    taus = temperatures.to(device, dtype)
    k = taus.shape[0]
    peak = torch.full((n,), float("-inf"), device=device, dtype=dtype)  # running max score M
    mass = torch.zeros(k, n, dtype=torch.float64, device=device)  # Σ exp(τ (s - M))
    moment = torch.zeros(k, n, dtype=torch.float64, device=device)  # Σ exp(τ (s - M)) (s - M)
    log_z = torch.full_like(peak, float("-inf"))  # logsumexp(score): log P_inf's normaliser
    target = torch.full_like(peak, float("-inf"))
    best = torch.full((n, TOP_K + 1), float("-inf"), device=device, dtype=dtype)
    start = 0
    for scores in itertools.chain([first], chunks):
        scores, width = scores.to(dtype), scores.shape[1]
        log_z = torch.logaddexp(log_z, torch.logsumexp(scores, dim=-1))
        index = targets - start
        inside = (index >= 0) & (index < width)
        picked = scores.gather(1, index.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
        target = torch.where(inside, picked, target)
        best = (
            torch.cat([best, scores.topk(min(TOP_K + 1, width), dim=-1).values], dim=-1)
            .topk(TOP_K + 1)
            .values
        )
        new_peak = torch.maximum(peak, scores.amax(dim=-1))
        safe_peak = torch.where(torch.isfinite(new_peak), new_peak, 0.0)
        shift = torch.where(
            torch.isfinite(peak), peak - safe_peak, 0.0
        ).double()  # <= 0; 0 while nothing seen
        centred = scores - safe_peak.unsqueeze(1)  # <= 0, -inf for unregistered tokens
        finite = torch.where(torch.isfinite(centred), centred, 0.0)
        weights, product = (
            torch.empty_like(centred),
            torch.empty_like(centred),
        )  # reused: 1.7× faster on a CPU
        for i in range(k):
            factor = (taus[i].double() * shift).exp()
            moment[i] = factor * (moment[i] + shift * mass[i])
            mass[i] *= factor
            torch.exp(torch.mul(centred, taus[i], out=weights), out=weights)
            mass[i] += weights.sum(dim=-1)
            moment[i] += torch.mul(weights, finite, out=product).sum(dim=-1)
        peak, start = new_peak, start + width
    relative = (target - peak).double()  # the target's score minus M
    nll = mass.log() - taus.double().unsqueeze(1) * relative
    slope = moment / mass - relative
    # the target itself included, at most TOP_K + 1
    ahead = (best >= target.unsqueeze(1)).sum(dim=-1)
    head = torch.stack(
        [
            torch.tensor(float(n), dtype=torch.float64, device=device),
            (log_z - target).double().sum(),
            (ahead <= 1).double().sum(),
            (ahead <= TOP_K).double().sum(),
        ]
    )
    return torch.cat([head, nll.sum(dim=-1), slope.sum(dim=-1)])


@torch.no_grad()
def target_calibration_sums(
    head_scores: list[torch.Tensor],
    columns: torch.Tensor,
    registered: torch.Tensor,
    *,
    tables: BucketTables,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int = TARGET_CHUNK,
) -> torch.Tensor:
    """``calibration_sums`` of the signature scores (in fp32 or wider), streamed over vocabulary chunks as
    ``target_log_p_inf`` streams them: ``[N, V]`` is never held."""
    side = side_by_side(head_scores).to(torch.promote_types(head_scores[0].dtype, torch.float32))
    return calibration_sums(
        score_chunks(side, columns, registered, tables, chunk_size), targets, temperatures
    )
