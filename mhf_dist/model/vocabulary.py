"""The vocabulary side of a model (``TiedVocabulary``): bucket tables tied between the input map and the output head.

- ``HashVocabulary`` (MultiHashFormer, docs/spec.md §2, §4, §5): a token's input is the ``HashEncoder`` fusion of its
  signature's H rows; the ``CascadedDecoder`` predicts the H coordinates; ``codes`` is the signature table.
- ``TokenVocabulary`` (Standard): one table of (padded) vocabulary rows, a plain row lookup in and a one-head tied
  decoder out; ``codes`` is the identity.

``loss`` is the docs/spec.md §5 training loss (``TrainingLoss``), the optional ``P_inf`` and z-loss terms included;
``evaluation`` adds the sums of ``P_inf``'s NLL, top-1/top-5 hits and temperature calibration (``Evaluation``);
``row_scores`` sums them per row (a downstream task's request); ``log_p_inf`` scores registered tokens. One module,
so that the pipeline engine places it on the first and last stage as one tied unit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from mhf_dist.model.calibration import coarse_temperatures
from mhf_dist.model.decoder import CascadedDecoder, head_entropies
from mhf_dist.model.hash_encoder import HashEncoder
from mhf_dist.model.scoring import (
    LOG_P_INF_CHUNK,
    TARGET_CHUNK,
    EvalSums,
    log_normaliser,
    log_p_inf,
    signature_columns,
    target_calibration_sums,
)
from mhf_dist.model.tables import BucketTables


class TrainingLoss(NamedTuple):
    """A micro-batch's training loss (docs/spec.md §5). A named tuple, so that DeepSpeed's ZeRO-3 finds the tensors
    in it and hooks them like any module's outputs."""

    # what training differentiates: sum over heads of the mean per-head NLL (+ λ × p_inf_nll) (+ z_loss)
    loss: torch.Tensor
    head_losses: torch.Tensor  # [H]
    # the loss's log P_inf term, mean -log P_inf(target), detached; None for a model without it (λ = 0)
    p_inf_nll: torch.Tensor | None = None
    # [H] each head's entropy over the rows held here, mean over the kept tokens, detached; only when the forward
    # asks for it (entropy=True: the health metrics' log steps)
    head_entropy: torch.Tensor | None = None
    # the z-loss term in ``loss``, weight × Σ_i mean (log Z_i)² over the kept tokens, detached; None without it
    # (a forward with z_loss_weight = 0)
    z_loss: torch.Tensor | None = None

    @property
    def logged_loss(self) -> torch.Tensor:
        """``loss`` without its z-loss term, detached: the loss a trainer logs (the z-loss is logged apart)."""
        loss = self.loss.detach()
        return loss if self.z_loss is None else loss - self.z_loss


class Evaluation(NamedTuple):
    """A micro-batch's evaluation: its training loss and the sums for ``P_inf`` and temperature calibration."""

    loss: torch.Tensor
    head_losses: torch.Tensor  # [H]
    # float64, laid out as mhf_dist.model.scoring.EvalSums (tokens, NLL, top-1/top-5 hits, NLL and its slope at
    # each τ_k)
    sums: torch.Tensor

    @property
    def p_inf_nll(self) -> torch.Tensor:
        """The mean ``-log P_inf(target)`` over the micro-batch's tokens (perplexity comparable across models)."""
        return (self.sums[EvalSums.P_INF_NLL] / self.sums[EvalSums.TOKENS]).to(
            torch.promote_types(self.loss.dtype, torch.float32)
        )


def _kept_mean(values: torch.Tensor, keep: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The mean over the first dimension of ``values [N, ...]`` at the positions ``keep [N]`` (``count`` of them), as
    a sum: the others count as exactly 0, in value and in gradient, whatever they hold (``torch.where``, not a
    product, so an infinite term there cannot turn into NaN). Summed in fp32 at least and rounded once, as ``mean``.
    A floating ``count`` (a trainer's ``divisor``, ``TiedVocabulary.loss``) divides at the sum's precision."""
    keep = keep.view(-1, *([1] * (values.dim() - 1)))
    total = torch.where(keep, values, 0).sum(
        dim=0, dtype=torch.promote_types(values.dtype, torch.float32)
    )
    if count.is_floating_point():
        count = count.to(total.dtype)
    return (total / count).to(values.dtype)


class TiedVocabulary(nn.Module):
    p_inf_loss_chunk = (
        TARGET_CHUNK  # values gathered per position in one chunk of the log P_inf term's log Z
    )

    def __init__(
        self,
        tables: BucketTables,
        encoder: nn.Module | None,
        decoder: CascadedDecoder,
        codes: torch.Tensor,
        registered: torch.Tensor,
        p_inf_loss_weight: float = 0.0,
    ):
        super().__init__()
        self.tables, self.encoder, self.decoder = tables, encoder, decoder
        self.p_inf_loss_weight = p_inf_loss_weight  # λ of the training loss's log P_inf term
        self.register_buffer("codes", codes.long(), persistent=False)
        self.register_buffer("registered", registered.bool(), persistent=False)
        self._columns: tuple[tuple, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.codes.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def signature_columns(self) -> torch.Tensor:
        """``scoring.signature_columns`` of ``codes`` on this rank's rows, made on first use
        (after tensor parallelism has sharded the tables) and again only if the rows or the device change."""
        key = (self.tables.row_offset, self.tables.local_rows, self.codes.device)
        if self._columns is None or self._columns[0] != key:
            self._columns = (key, signature_columns(self.codes, self.tables))
        return self._columns[1]

    def loss(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        entropy: bool = False,
        z_loss_weight: float = 0.0,
        divisor: torch.Tensor | None = None,
    ) -> TrainingLoss:
        """``h [..., d]`` (final-norm output), ``targets [...]`` token ids -> docs/spec.md §5 training loss;
        ``entropy``: with each head's entropy (``TrainingLoss.head_entropy``); ``z_loss_weight`` > 0: with the
        z-loss, that weight × the mean over the kept tokens of each head's ``(log Z_i)²``, summed over the heads
        (``TrainingLoss.z_loss``), from the ``log Z_i`` the heads compute anyway. ``divisor`` (a device scalar):
        what the sums over the kept tokens are divided by instead of their count here, so that the mean over a
        step's micro-batches and ranks is the mean over all their tokens (``loss_divisor`` of the trainers)."""
        # targets < 0 are ignored by weight, not by selection: every position goes through the decoder (ignored ones
        # reading token 0) and the means are sums over the kept positions / their count, so no shape depends on
        # the data (boolean indexing would wait for the device to count the kept positions)
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        keep = targets >= 0
        count = keep.sum() if divisor is None else divisor
        safe = targets.clamp_min(0)
        z_loss = z_loss_weight > 0
        if not self.p_inf_loss_weight:
            terms = self.decoder.head_terms(
                h, self.tables, self.codes[safe], entropy=entropy, log_z=z_loss
            )
            head_losses = _kept_mean(terms.nll, keep, count)
            entropies = None if terms.entropy is None else _kept_mean(terms.entropy, keep, count)
            out = TrainingLoss(
                loss=head_losses.sum(), head_losses=head_losses, head_entropy=entropies
            )
            log_z = terms.log_z
        else:
            head_losses, p_inf_nll, entropies, log_z = self._head_and_p_inf_losses(
                h, safe, keep, count, entropy, z_loss
            )
            out = TrainingLoss(
                loss=head_losses.sum() + self.p_inf_loss_weight * p_inf_nll,
                head_losses=head_losses,
                p_inf_nll=p_inf_nll.detach(),
                head_entropy=entropies,
            )
        if not z_loss:
            return out
        # summed in fp32 (or wider), as log Z is: a bf16 loss would round the small term away, and with it the
        # logged loss (loss - z_loss)
        term = z_loss_weight * _kept_mean(log_z.square(), keep, count).sum()
        return out._replace(loss=out.loss.to(term.dtype) + term, z_loss=term.detach())

    def evaluation(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        temperatures: torch.Tensor | None = None,
        divisor: torch.Tensor | None = None,
    ) -> Evaluation:
        """``loss`` (without a z-loss; its sums divided by ``divisor`` when given) with the evaluation sums of
        ``calibration_sums`` at ``temperatures``, which count tokens, so they take the kept positions only (targets
        ``>= 0``)."""
        training = self.loss(h, targets, divisor=divisor)
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        keep = targets >= 0
        return Evaluation(
            loss=training.loss,
            head_losses=training.head_losses,
            sums=self.calibration_sums(h[keep], targets[keep], temperatures),
        )

    def row_scores(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``h [B, S, d]``, ``targets [B, S]`` -> float64 ``[B, 3]``: per row, over its kept positions (targets
        ``>= 0``), ``Σ -log P_inf(target)``, the targets ranked first (``calibration_sums``' top-1) and their
        count: a downstream task's per-request scores, one request a row. Every rank of a tensor-parallel group
        scores the same rows, in the same order."""
        rows, ones = [], torch.ones(1, dtype=torch.float64)
        for row, wanted in zip(h, targets):
            keep = wanted >= 0
            # a row with nothing to score (the same on every rank of the group)
            if not bool(keep.any()):
                rows.append(torch.zeros(3, dtype=torch.float64, device=h.device))
                continue
            sums = self.calibration_sums(row[keep], wanted[keep], ones)
            rows.append(sums[[EvalSums.P_INF_NLL, EvalSums.TOP1, EvalSums.TOKENS]])
        return torch.stack(rows)

    def _head_and_p_inf_losses(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        keep: torch.Tensor,
        count: torch.Tensor,
        entropy: bool,
        normalisers: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(head losses [H], mean -log P_inf(target), head entropies [H] or None, with ``normalisers`` each
        head's log Z_i [N, H] or else None)``, the first two with gradients, over the positions ``keep``
        (``count`` of them), from one plain pass down the cascade
        (``CascadedDecoder.nll_and_log_probs``): ``-log P_inf(w) = log Z - Σ_i log p_i[H_i(w)] = log Z +
        Σ_i nll_i``, with ``log Z`` from ``log_normaliser``. The fused decoder path
        is not used: this term needs every head's scores ``[N, R_local]`` anyway, and the plain path's are them.
        A target that is not registered (the pad token) has ``P_inf = 0``: its term is ``+inf``, as in evaluation."""
        nll, log_probs, head_log_z = self.decoder.nll_and_log_probs(
            h, self.tables, self.codes[targets], normalisers
        )
        log_z = log_normaliser(
            log_probs, self.signature_columns(), self.registered, self.tables, self.p_inf_loss_chunk
        )
        p_inf_nll = torch.where(self.registered[targets], log_z + nll.sum(dim=-1), float("inf"))
        entropies = _kept_mean(head_entropies(log_probs), keep, count) if entropy else None
        return (
            _kept_mean(nll, keep, count),
            _kept_mean(p_inf_nll, keep, count),
            entropies,
            head_log_z,
        )

    def calibration_sums(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        temperatures: torch.Tensor | None = None,
        chunk_size: int = TARGET_CHUNK,
    ) -> torch.Tensor:
        """``h [N, d]``, ``targets [N]`` -> ``scoring.calibration_sums`` (``P_inf`` NLL, top-1/5
        hits, and the NLL of ``P_τ`` with its slope at each of ``temperatures``, default
        ``coarse_temperatures``), streamed over the vocabulary."""
        if temperatures is None:
            temperatures = coarse_temperatures()
        return target_calibration_sums(
            self.decoder.scores(h, self.tables),
            self.signature_columns(),
            self.registered,
            tables=self.tables,
            targets=targets,
            temperatures=temperatures,
            chunk_size=chunk_size,
        )

    def log_p_inf(self, h: torch.Tensor, chunk_size: int = LOG_P_INF_CHUNK) -> torch.Tensor:
        """``h [..., d]`` -> ``log P_inf [..., V]``."""
        flat = h.reshape(-1, h.shape[-1])
        logp = log_p_inf(
            self.decoder.scores(flat, self.tables),
            self.signature_columns(),
            self.registered,
            self.tables,
            chunk_size,
        )
        return logp.view(*h.shape[:-1], -1)


class HashVocabulary(TiedVocabulary):
    def __init__(
        self,
        codes: torch.Tensor,
        num_buckets: int,
        dim: int,
        *,
        gate_dim: int,
        mixer_dim: int,
        chunk_tokens: int = 0,
        p_inf_loss_weight: float = 0.0,
        kernels: str = "auto",
    ):
        num_hashes = codes.shape[1]
        super().__init__(
            tables=BucketTables(num_hashes, num_buckets, dim),
            encoder=HashEncoder(dim, gate_dim),
            decoder=CascadedDecoder(
                dim, num_hashes, mixer_dim, chunk_tokens=chunk_tokens, kernels=kernels
            ),
            codes=codes,
            registered=(codes != 0).any(dim=1),
            p_inf_loss_weight=p_inf_loss_weight,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.tables.lookup(self.codes[input_ids]))


class TokenVocabulary(TiedVocabulary):
    def __init__(
        self,
        vocab_size: int,
        padded_rows: int,
        dim: int,
        chunk_tokens: int = 0,
        kernels: str = "auto",
    ):
        # data, as a signature table is: real on a meta skeleton too
        ids = torch.arange(vocab_size, device="cpu")
        super().__init__(
            tables=BucketTables(1, padded_rows, dim),
            encoder=None,
            decoder=CascadedDecoder(
                dim,
                1,
                mixer_dim=1,
                num_valid_rows=vocab_size,
                chunk_tokens=chunk_tokens,
                kernels=kernels,
            ),
            codes=ids[:, None],
            registered=torch.ones_like(ids, dtype=torch.bool),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tables.lookup(input_ids.unsqueeze(-1)).squeeze(-2)
