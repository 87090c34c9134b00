"""One decoder head fused over token chunks (``FusedHead``): memory ``O(chunk × B)`` instead of ``O(tokens × B)``
(docs/spec.md §4, §5).

For ``c [N, d]`` and a head's table rows ``E [R, d]`` it returns, per token, ``log Z = logsumexp_b (E c)_b``, the
target's logit and the soft retrieval ``ē = Eᵀ softmax(E c)``, computing the bucket logits one chunk of tokens at a
time and again in backward; only ``c``, ``log Z`` and ``ē`` are kept, and the logits of a head that retrieves
nothing when its tokens make one chunk (its backward needs a buffer that size anyway, so the peak stays). With
upstream gradients ``g_Z, g_t, g_ē``: ``∂L/∂o_b = p_b (g_Z + E_b·g_ē − ē·g_ē) + g_t [b = target]``,
``∂L/∂c = Σ_b ∂L/∂o_b E_b`` and ``∂L/∂E_b = ∂L/∂o_b c + p_b g_ē``. On a bucket shard the forward reduces over the
shards (the ``tables`` reductions) and the backward needs no communication. Softmax statistics are fp32 (or wider),
and so is a lower-precision table's gradient while it sums over the chunks. ``KernelPolicy`` runs the elementwise
passes, compiled or eager. Why: docs/design-model.md, "Fused decoder".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_NEG_INF = float("-inf")
_EXP_BLOCK = 2**19  # values per block of ``_exp_total_by_rows`` (2 MB in fp32: within the caches)


class KernelPolicy:
    """How the elementwise passes below run for one model (its decoder's, built with the model's
    ``ModelModes.kernels``, ``train.fused_head_kernel``): ``auto`` compiles them on GPUs and runs them eagerly on
    CPUs, and the first compile that fails (a torch without Triton, an Inductor error) switches every pass to eager
    with one warning; ``compiled`` always compiles and lets a failure through; ``eager`` never compiles.

    Calling it runs a pass: as one fused kernel (``torch.compile``) on GPUs, where each elementwise pass over a
    chunk's ``chunk × R`` values costs a trip through memory; eagerly on CPU, where the pass works in place and
    compiling costs more than it saves. A pass is compiled on its first call that wants it, so CPU-only use never
    loads the compiler; a compile fails before the kernel touches its inputs, so the eager retry sees them
    unchanged."""

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "compiled", "eager"):
            raise ValueError(f"fused head kernels: {mode!r} is not auto, compiled or eager")
        self.mode, self.failed = mode, False
        self.compiled: dict[
            Callable, Callable
        ] = {}  # each pass's compiled form, made on its first compiled call

    def compiles(self, x: torch.Tensor) -> bool:
        if self.mode == "auto":
            return _on_gpu(x) and not self.failed
        return self.mode == "compiled"

    def fall_back(self, error: Exception) -> None:
        self.failed = True
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        log.warning(
            "the fused decoder head runs eagerly: compiling its kernels failed (%s: %s); set "
            "train.fused_head_kernel=eager to skip the attempt, or =compiled to stop on it",
            type(error).__name__,
            first_line,
        )

    def __call__(self, fn: Callable, *args):
        """``fn(*args)``, compiled or not as the policy says."""
        if not self.compiles(args[0]):
            return fn(*args)
        if (compiled := self.compiled.get(fn)) is None:
            compiled = self.compiled[fn] = torch.compile(fn, dynamic=True)
        if self.mode == "compiled":
            return compiled(*args)
        try:
            return compiled(*args)
        except (
            Exception
        ) as e:  # Inductor reports a missing Triton or a failed lowering in several exception types
            self.fall_back(e)
            return fn(*args)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _masked(logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return logits if valid is None else logits.masked_fill(~valid, _NEG_INF)


def _row_max(logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return _masked(logits, valid).amax(dim=-1).to(_stats_dtype(logits))


def _shifted_exp(logits: torch.Tensor, valid: torch.Tensor | None, peak: torch.Tensor):
    """``(exp(o − peak), Σ_b exp(o − peak))`` in fp32; in place when the logits already are."""
    e = _masked(logits.to(_stats_dtype(logits)), valid).sub_(peak[:, None]).exp_()
    return e, e.sum(dim=-1)


def _exp_total(
    logits: torch.Tensor, valid: torch.Tensor | None, peak: torch.Tensor
) -> torch.Tensor:
    """``Σ_b exp(o − peak)`` in fp32, the logits left as they are (compiled: one reduction, no ``[n, R]``
    temporary)."""
    return _masked(logits.to(_stats_dtype(logits)), valid).sub(peak[:, None]).exp_().sum(dim=-1)


def _exp_total_by_rows(
    logits: torch.Tensor, valid: torch.Tensor | None, peak: torch.Tensor
) -> torch.Tensor:
    """``_exp_total`` a block of rows at a time, through one small buffer (eager: a fresh temporary per block, or one
    of ``[n, R]``, would be new memory, which the host allocator faults in again at every call)."""
    n, width = logits.shape
    rows = max(1, min(n, _EXP_BLOCK // max(1, width)))
    buffer = logits.new_empty(rows, width, dtype=_stats_dtype(logits))
    total = buffer.new_empty(n)
    for s in range(0, n, rows):
        block = buffer[: min(rows, n - s)]
        torch.sub(logits[s : s + rows], peak[s : s + rows, None], out=block)
        if valid is not None:
            block.masked_fill_(~valid, _NEG_INF)
        total[s : s + rows] = block.exp_().sum(dim=-1)
    return total


def _normalised(e: torch.Tensor, total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return e.div_(total[:, None]).to(dtype)


def _logit_grads_(
    products: torch.Tensor,
    valid: torch.Tensor | None,
    log_z: torch.Tensor,
    coeff: torch.Tensor,
    retrieve: bool,
) -> None:
    """In place: the bottom rows (the logits, recomputed or kept) become ``p``; with retrieval the top rows
    (``E_b·g_ē``) become ``∂L/∂o = p (E_b·g_ē + coeff)``, else the bottom rows become ``∂L/∂o = p · coeff``."""
    n = log_z.shape[0]
    top, bottom = products[:n], products[-n:]
    # (in fp32 every step works in place and each copy_ below is a copy onto itself, which is skipped)
    p = _masked(bottom.to(_stats_dtype(products)), valid).sub_(log_z[:, None]).exp_()
    if retrieve:
        top.copy_(top.to(p.dtype).add_(coeff[:, None]).mul_(p))
        bottom.copy_(p)
    else:
        bottom.copy_(p.mul_(coeff[:, None]))


class FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        c,
        weight,
        rows,
        owned,
        valid,
        retrieve,
        chunk,
        tables,
        gradients,
        table,
        kernels,
        entropy=False,
    ):
        """``rows`` local target rows (clamped), ``owned`` whether held here, ``valid [R]`` real rows or None;
        ``weight``'s gradient goes to slot ``table`` of ``gradients`` (a ``TableGradients``); ``kernels`` runs the
        elementwise passes (a ``KernelPolicy``); ``entropy``: also
        return ``-Σ_b p_b log p_b`` over the rows held here, ``(S log Z − Σ_b e_b o_b) / T`` with
        ``e = exp(o − peak)``, ``S`` its local and ``T`` its global sum (no gradient; no logarithm per bucket)."""
        n = c.shape[0]
        stats = _stats_dtype(c)
        log_z, target = c.new_empty(n, dtype=stats), c.new_empty(n, dtype=stats)
        e_bar = c.new_empty(n, c.shape[1]) if retrieve else None
        ent = c.new_empty(n, dtype=stats) if entropy else None
        # one chunk of a head that retrieves nothing: its logits are kept for backward, which would otherwise
        # recompute them into a buffer of the same size (so the peak stays where it was)
        keep = 0 < n <= chunk and not retrieve and not entropy
        kept_logits = None
        for s in range(0, n, chunk):
            logits = c[s : s + chunk] @ weight.t()
            picked = logits.gather(-1, rows[s : s + chunk, None]).squeeze(-1).to(stats)
            target[s : s + chunk] = tables.reduce_sum(
                torch.where(owned[s : s + chunk], picked, 0.0)
            )
            peak = tables.reduce_max(kernels(_row_max, logits, valid))
            if keep:
                kept_logits = logits
                if kernels.compiles(logits):
                    local = kernels(_exp_total, logits, valid, peak)
                else:
                    local = _exp_total_by_rows(logits, valid, peak)
                log_z[s : s + chunk] = peak + tables.reduce_sum(local).log()
                continue
            # (the exponentials replace the logits in place)
            kept = logits.clone() if entropy else None
            e, local = kernels(_shifted_exp, logits, valid, peak)
            total = tables.reduce_sum(local)
            log_z[s : s + chunk] = peak + total.log()
            if entropy:  # masked rows have e = 0 beside a finite logit
                products = torch.einsum("nb,nb->n", e, kept.to(e.dtype))  # Σ_b e_b o_b
                ent[s : s + chunk] = (local * log_z[s : s + chunk] - products) / total
            if retrieve:
                e_bar[s : s + chunk] = tables.reduce_sum(
                    kernels(_normalised, e, total, weight.dtype) @ weight
                )
        ctx.save_for_backward(c, weight, rows, owned, valid, log_z, e_bar, kept_logits)
        ctx.chunk, ctx.gradients, ctx.table, ctx.kernels = chunk, gradients, table, kernels
        if entropy:
            ctx.mark_non_differentiable(ent)
        return log_z, target, e_bar, ent

    @staticmethod
    def backward(ctx, g_z, g_t, g_e, g_ent=None):
        c, weight, rows, owned, valid, log_z, e_bar, kept_logits = ctx.saved_tensors
        grad_c, slot = torch.empty_like(c), ctx.gradients.slot(ctx.table, weight)
        # ∂L/∂E is summed over the chunks in fp32 (or wider): in place in its slot when that is fp32, else in an
        # accumulator rounded into the slot once at the end
        grad_w = slot if slot.dtype == log_z.dtype else None
        retrieve = g_e is not None
        for s in range(0, c.shape[0], ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            n = c[sl].shape[0]
            # one matmul gives the products E_b·g_ē (top rows) and the logits again (bottom rows); both
            # become, in place, the stacked coefficients [∂L/∂o ; p] of one ∂L/∂E matmul with [c ; g_ē]
            # (a head kept its logits in forward: one chunk, no retrieval; they are turned in place, so a second
            # backward through the same graph, retain_graph=True, meets autograd's error for a changed saved tensor)
            if kept_logits is not None:
                products = kept_logits
            else:
                products = (torch.cat([g_e[sl], c[sl]]) if retrieve else c[sl]) @ weight.t()
            # ∂L/∂o = p (g_Z + E_b·g_ē − ē·g_ē) + g_t [b = target]
            coeff = torch.zeros_like(log_z[sl]) if g_z is None else g_z[sl].to(log_z.dtype)
            if retrieve:
                coeff = coeff - (e_bar[sl].to(log_z.dtype) * g_e[sl].to(log_z.dtype)).sum(-1)
            ctx.kernels(_logit_grads_, products, valid, log_z[sl], coeff, retrieve)
            d_logits = products[:n]
            if g_t is not None:
                picked = torch.where(owned[sl], g_t[sl], 0.0)
                d_logits.scatter_add_(-1, rows[sl, None], picked[:, None].to(d_logits.dtype))
            grad_c[sl] = d_logits @ weight
            inputs = torch.cat([c[sl], g_e[sl]]) if retrieve else c[sl]
            # ∂L/∂E = d_logitsᵀ c + pᵀ g_ē, accumulated over chunks
            if grad_w is slot and s == 0:
                torch.mm(products.t(), inputs, out=grad_w)
            elif grad_w is slot:
                grad_w.addmm_(products.t(), inputs)
            elif s == 0:  # (a chunk's product is rounded once, then summed in fp32)
                grad_w = (products.t() @ inputs).to(log_z.dtype)
            else:
                grad_w.add_(products.t() @ inputs)
        if c.shape[0] == 0:  # no tokens, no chunk wrote it
            slot.zero_()
        elif grad_w is not slot:
            slot.copy_(grad_w)
        return grad_c, slot, None, None, None, None, None, None, None, None, None, None
