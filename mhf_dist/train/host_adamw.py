"""``HostAdamW``: the AdamW of the Engram tables kept in host memory (``model.engram.offload``), on every row or on
chosen rows, computed in fp32 by torch's fused kernel whatever the tables' and the moments' storage dtypes
(``model.engram.table_dtype``, ``moment_dtype``): bf16 values are read into fp32 a block of rows at a time and
rounded back once per step. Why: docs/design-engram.md.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

BLOCK_ROWS = 1 << 16  # rows converted to fp32 at a time (bounds the temporaries)


class HostAdamW:
    """AdamW over ``{layer: weight [T, R, d]}``, its state (``step``, ``exp_avg``, ``exp_avg_sq``) per layer, made
    at the first step or loaded; ``step`` counts every step of the run, read or not, for bias correction."""

    def __init__(self, weights: dict[int, torch.Tensor], moment_dtype: torch.dtype):
        self.weights, self.moment_dtype = weights, moment_dtype
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    def _state(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self.state:  # as torch.optim.AdamW(fused=True) initialises it
            weight = self.weights[i]
            self.state[i] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(weight, dtype=self.moment_dtype),
                "exp_avg_sq": torch.zeros_like(weight, dtype=self.moment_dtype),
            }
        return self.state[i]

    def load(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Layer ``i``'s state from a checkpoint (moments converted to ``moment_dtype``)."""
        self.state[i] = {
            key: value.float() if key == "step" else value.to(self.moment_dtype)
            for key, value in state.items()
        }

    @torch.no_grad()
    def step(self, i: int, grad: torch.Tensor, rows: torch.Tensor | None, hyper: dict) -> None:
        """One AdamW step of layer ``i`` with ``hyper`` (lr, betas, eps, weight_decay): ``grad [T·R, d]`` on every
        row (``rows`` None), or ``grad [U, d]`` on the flat rows ``rows [U]`` only."""
        state, weight = self._state(i), self.weights[i]
        width = weight.shape[-1]
        full = [x.view(-1, width) for x in (weight, state["exp_avg"], state["exp_avg_sq"])]
        if rows is None and all(x.dtype == torch.float32 for x in full):  # in place, as one tensor
            self._adamw(full, grad, state["step"], hyper)
            return
        count = grad.shape[0]
        first = state["step"].clone()
        for start in range(0, count, BLOCK_ROWS):
            block = slice(start, min(start + BLOCK_ROWS, count))
            index = rows[block] if rows is not None else None
            values = [
                (x[block] if index is None else x.index_select(0, index)).float() for x in full
            ]
            self._adamw(values, grad[block], first.clone(), hyper)
            for x, value in zip(full, values, strict=True):  # rounded once
                if index is None:
                    x[block] = value
                else:
                    x.index_copy_(0, index, value.to(x.dtype))
        state["step"] = first + 1

    @staticmethod
    def _adamw(values: list[torch.Tensor], grad: torch.Tensor, step: torch.Tensor, hyper) -> None:
        weight, exp_avg, exp_avg_sq = values
        adamw(
            [weight],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [step],
            fused=True,
            amsgrad=False,
            beta1=hyper["betas"][0],
            beta2=hyper["betas"][1],
            lr=hyper["lr"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            maximize=False,
        )
