"""One decoder head fused over token chunks: memory ``O(chunk × B)`` instead of ``O(tokens × B)`` (SPEC §4, §5).

For ``c [N, d]`` and a head's table rows ``E [R, d]`` it returns, per token,
the softmax normaliser ``log Z = logsumexp_b (E c)_b``, the target's logit and
the soft retrieval ``ē = Eᵀ softmax(E c)``, computing the bucket logits one
chunk of tokens at a time and recomputing them in backward (the
Cut-Cross-Entropy / fused-linear-cross-entropy idea). Only ``c``, ``log Z`` and
``ē`` are kept for backward. With upstream gradients ``g_Z, g_t, g_ē`` the
gradient of the logits is

    ∂L/∂o_b = p_b (g_Z + E_b·g_ē − ē·g_ē) + g_t [b = target]

(``ē = Σ_b p_b E_b`` so ``∂ē/∂o_b = p_b (E_b − ē)``), then ``∂L/∂c = Σ_b ∂L/∂o_b E_b``
and ``∂L/∂E_b = ∂L/∂o_b c + p_b g_ē``. On a bucket shard the forward reduces
the max, the sum of exponentials, ``ē`` and the target logit over the shards
(the ``tables`` reductions); backward needs no communication: ``log Z`` and
``ē`` are global, every other term is local, and the partial ``∂L/∂c`` is
summed by the caller's ``copy_to_tp``. Softmax statistics are kept in fp32
(or wider) whatever the training dtype; ``ē`` and the gradients come back in ``c``'s dtype.
"""

from __future__ import annotations

import torch


class FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, weight, rows, owned, valid, retrieve, chunk, tables):
        """``rows`` local target rows (clamped), ``owned`` whether held here, ``valid [R]`` real rows or None."""
        n = c.shape[0]
        stats = torch.promote_types(c.dtype, torch.float32)
        log_z, target = c.new_empty(n, dtype=stats), c.new_empty(n, dtype=stats)
        e_bar = c.new_empty(n, c.shape[1]) if retrieve else None
        for s in range(0, n, chunk):
            logits = FusedHead._logits(c[s:s + chunk], weight, valid)
            picked = logits.gather(-1, rows[s:s + chunk, None]).squeeze(-1)
            target[s:s + chunk] = tables.reduce_sum(torch.where(owned[s:s + chunk], picked, 0.0))
            peak = tables.reduce_max(logits.amax(dim=-1))
            # the chunk's logits become exp(o - max) in place, then (with retrieval) the softmax itself
            shifted = logits.sub_(peak[:, None]).exp_()
            total = tables.reduce_sum(shifted.sum(dim=-1))
            log_z[s:s + chunk] = peak + total.log()
            if retrieve:
                e_bar[s:s + chunk] = tables.reduce_sum(shifted.div_(total[:, None]).to(weight.dtype) @ weight)
        ctx.save_for_backward(c, weight, rows, owned, valid, log_z, e_bar)
        ctx.chunk = chunk
        return log_z, target, e_bar

    @staticmethod
    def _logits(c, weight, valid):
        """A chunk's bucket logits in (at least) fp32: a fresh tensor, free to modify in place."""
        logits = (c @ weight.t()).to(torch.promote_types(c.dtype, torch.float32))
        return logits if valid is None else logits.masked_fill_(~valid, float("-inf"))

    @staticmethod
    def backward(ctx, g_z, g_t, g_e):
        c, weight, rows, owned, valid, log_z, e_bar = ctx.saved_tensors
        grad_c, grad_w = torch.empty_like(c), torch.empty_like(weight)
        for s in range(0, c.shape[0], ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            n = c[sl].shape[0]
            # one matmul gives the products E_b·g_ē (top rows) and the recomputed logits (bottom rows); both
            # become, in place, the stacked coefficients [∂L/∂o ; p] of one ∂L/∂E matmul with [c ; g_ē]
            products = (c[sl] if g_e is None else torch.cat([g_e[sl], c[sl]])) @ weight.t()
            wide = products.to(torch.promote_types(products.dtype, torch.float32))  # the same tensor in fp32
            p = wide[-n:]
            if valid is not None:
                p.masked_fill_(~valid, float("-inf"))
            p.sub_(log_z[sl, None]).exp_()
            coeff = torch.zeros_like(log_z[sl]) if g_z is None else g_z[sl].to(p.dtype)
            # ∂L/∂o = p (g_Z + E_b·g_ē − ē·g_ē) + g_t [b = target]
            if g_e is None:
                d_logits = p.mul_(coeff[:, None])
            else:
                coeff = coeff - (e_bar[sl] * g_e[sl]).sum(-1).to(p.dtype)
                d_logits = wide[:n].add_(coeff[:, None]).mul_(p)
            if g_t is not None:
                picked = torch.where(owned[sl], g_t[sl], 0.0)
                d_logits.scatter_add_(-1, rows[sl, None], picked[:, None].to(d_logits.dtype))
            if wide is not products:
                products.copy_(wide)
            grad_c[sl] = products[:n] @ weight
            inputs = c[sl] if g_e is None else torch.cat([c[sl], g_e[sl]])
            # ∂L/∂E = d_logitsᵀ c + pᵀ g_ē, accumulated over chunks
            if s == 0:
                torch.mm(products.t(), inputs, out=grad_w)
            else:
                grad_w.addmm_(products.t(), inputs)
        return grad_c, grad_w, None, None, None, None, None, None
