"""What a training run reports of its model's health every log interval (docs/usage.md, "Health metrics").

Per parameter family (``families``) and per backbone block: the gradient norm (before clipping, as the global
``grad_norm``), the parameter norm (the weights the step started from) and the update to weight ratio
``‖Δw‖ / ‖w‖``; per MultiHashFormer head (docs/spec.md §2, §4) the share of its B buckets that the interval's target
tokens fall in, the entropy of those counts and the gate's mean weight ``α_i``; every model's mean entropy of each
decoder head's ``p_i``; per Engram memory (docs/spec.md §8) the share of its table entries that received gradient.
``HealthLayout`` lays out the one vector of sums each rank adds its part into (each part counted once), turns its
sum into the reported values on the device (``summary``) and names them (``metrics``); ``ForwardHealth`` gathers the
forward's part. How they are measured: docs/design-training.md, "Health metrics".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from mhf_dist.model.families import FAMILIES, families

_BLOCK = re.compile(r"backbone\.layers\.(\d+)\.")


def is_engram_table(name: str) -> bool:
    """Whether parameter ``name`` is an Engram memory's table (its gradient touches only the rows read)."""
    return ".engram." in name and name.endswith("tables.weight")


class HealthLayout:
    """Where each sum sits in the vector the ranks add up at a log step, for a model whose trainable parameters
    are ``names`` (``LanguageModel`` naming), with ``num_heads`` decoder heads,
    ``num_buckets`` rows per bucket table (None: no hash signatures, so no bucket or gate statistics)."""

    def __init__(self, names: Iterable[str], num_heads: int, num_buckets: int | None):
        names = list(names)
        present = set().union(*(families(n) for n in names))
        blocks = sorted({int(m[1]) for n in names if (m := _BLOCK.match(n))})
        self.slots = [f for f in FAMILIES if f in present] + [f"block{i}" for i in blocks]
        self.heads, self.buckets = num_heads, num_buckets
        self.engram = any(is_engram_table(n) for n in names)
        n, hashed = len(self.slots), num_buckets is not None
        sizes = {
            "grad": n,
            "param": n,
            "update": n,
            "engram": 2 * self.engram,
            "gate": (num_heads + 1) * hashed,
            "entropy": num_heads,
            "buckets": num_heads * (num_buckets or 0) * hashed,
        }
        self.parts, start = {}, 0
        for part, size in sizes.items():
            self.parts[part] = slice(start, start + size)
            start += size
        self.size = start

    def slots_of(self, name: str) -> list[int]:
        """The slots parameter ``name`` adds to: its families and its block."""
        found = [self.slots.index(f) for f in families(name)]
        if m := _BLOCK.match(name):
            found.append(self.slots.index(f"block{m[1]}"))
        return found

    def zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=device)

    def part(self, sums: torch.Tensor, name: str) -> torch.Tensor:
        """The view of ``sums`` that holds part ``name`` (grad, param, update, engram, gate, entropy, buckets)."""
        return sums[self.parts[name]]

    def summary(self, total: torch.Tensor, unclip: torch.Tensor | float = 1.0) -> torch.Tensor:
        """The reported values from the ranks' summed vector, on its device: per slot the gradient norm (times
        ``unclip``, the factor the optimizer's gradients were clipped by), the parameter norm and the update ratio;
        then the Engram share, the gate weights, the head entropies, and per head the share of buckets used and
        the entropy of their counts."""
        total = total.double()
        grad, param, update = (self.part(total, p).sqrt() for p in ("grad", "param", "update"))
        values = [grad * unclip, param, update / param]
        if self.engram:
            touched, entries = self.part(total, "engram")
            values.append((touched / entries).reshape(1))
        if self.buckets is not None:
            gate = self.part(total, "gate")
            values.append(gate[:-1] / gate[-1])
        values.append(self.part(total, "entropy"))
        if self.buckets is not None:
            counts = self.part(total, "buckets").view(self.heads, self.buckets)
            share = counts / counts.sum(-1, keepdim=True)
            values += [(counts > 0).double().mean(-1), torch.special.entr(share).sum(-1)]
        return torch.cat(values)

    def metrics(self, values: list[float], grad_norms: bool = True) -> dict[str, float]:
        """``summary``'s values by metric name (``grad_norm/tables``, ``bucket_entropy/head0``, ...); without
        ``grad_norms`` (the gradients were clipped by an unknown factor) those are left out, and the optimizer's part
        all of it when the optimizer did not run (DeepSpeed skipped the step for an overflow)."""
        names = [
            f"{kind}/{slot}"
            for kind in ("grad_norm", "param_norm", "update_ratio")
            for slot in self.slots
        ]
        names += ["engram_rows_touched"] if self.engram else []
        heads = [f"head{i}" for i in range(self.heads)]
        names += [f"gate_weight/{h}" for h in heads] if self.buckets is not None else []
        names += [f"head_entropy/{h}" for h in heads]
        if self.buckets is not None:
            names += [f"{kind}/{h}" for kind in ("buckets_used", "bucket_entropy") for h in heads]
        found = dict(zip(names, values, strict=True))
        left_out = () if grad_norms else ("grad_norm/",)
        if not any(
            found[f"param_norm/{slot}"] for slot in self.slots
        ):  # the optimizer did not run (an overflow)
            left_out = ("grad_norm/", "param_norm/", "update_ratio/", "engram_rows_touched")
        return {k: v for k, v in found.items() if not k.startswith(left_out)} if left_out else found


class ForwardHealth:
    """The forward's part of the sums (``layout``'s gate, entropy and buckets parts) on one rank: the targets'
    bucket counts, added every step (``count_targets``; cheap, so the log step sees the whole interval), and,
    while ``armed`` (a log step), the gate's weights (a forward hook on the encoder's scorer: docs/spec.md §2's
    ``a_i``); on a log step the training forwards also return the heads' entropies, which the trainer asks for and
    adds (``add_entropy``). ``counts``: this rank counts the tokens (one rank per batch, where the vocabulary's
    loss runs); ``gate``: this rank counts the gate (one rank per batch, where the vocabulary embeds). ``vocab`` is
    None on a pipeline stage without it."""

    def __init__(
        self,
        vocab: nn.Module | None,
        layout: HealthLayout,
        device: torch.device,
        counts: bool,
        gate: bool,
    ):
        self.vocab, self.layout, self.counts, self.gate = vocab, layout, counts, gate
        self.sums = layout.zeros(device)
        self._hook = None

    def count_targets(self, targets: torch.Tensor) -> None:
        """Add the bucket of each head of each kept target (``>= 0``) to the counts."""
        if self.layout.buckets is None or not self.counts:
            return
        targets = targets.reshape(-1).to(self.sums.device)
        keep = targets >= 0
        rows = self.vocab.codes[targets.clamp_min(0)]  # [N, H]
        rows = rows + torch.arange(self.layout.heads, device=rows.device) * self.layout.buckets
        weights = keep[:, None].expand_as(rows).to(self.sums.dtype)
        self.layout.part(self.sums, "buckets").index_add_(0, rows.reshape(-1), weights.reshape(-1))

    def arm(self) -> None:
        """Measure the gate in the forwards until ``take``."""
        if self.vocab is None:  # a pipeline stage without the vocabulary
            return
        encoder = self.vocab.encoder
        if self.gate and self.layout.buckets is not None and encoder is not None:
            self._hook = encoder.scorer.register_forward_hook(self._gate_weights)

    def _gate_weights(self, module: nn.Module, args, scores: torch.Tensor) -> None:
        # a_i -> α_i
        alpha = torch.softmax(scores.detach().double(), dim=-2).reshape(-1, self.layout.heads)
        gate = self.layout.part(self.sums, "gate")
        gate[:-1] += alpha.sum(0)
        gate[-1] += alpha.shape[0]

    def add_entropy(self, head_entropy: torch.Tensor | None, weight: float) -> None:
        """Add a micro-batch's head entropies (``TrainingLoss.head_entropy``) with ``weight`` (its share of
        the global batch)."""
        if head_entropy is not None:
            self.layout.part(self.sums, "entropy").add_(
                head_entropy.detach().double(), alpha=weight
            )

    def take(self) -> torch.Tensor:
        """The sums gathered since the last take, and stop measuring."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        return sums
