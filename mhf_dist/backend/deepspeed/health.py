"""The health metrics of a DeepSpeed engine's step (``mhf_dist.model.health``): ``EngineHealth``.

The optimizer's part (``StepHealth``): on a log step a pre-hook on the torch optimizer adds the squares of each
parameter's fragment of the flat fp32 partitions it steps (reduced, already clipped gradients) and of its weights
into the parameter's slots and keeps a copy of the weights; a post-hook adds the squares of the update. The fragment
comes from ``safe_get_local_fp32_param`` under ZeRO-3, the parameter's ``_hp_mapping`` under ZeRO-1/2 and the bf16
optimizer (the one private symbol used here; tests/test_deepspeed_contract.py names it), the parameter itself without
ZeRO. The forward's part is ``ForwardHealth``'s. Each part is counted on one rank (``counted_here``): a parameter
replicated over tensor parallelism on tp rank 0, the tables tied between the pipeline's first and last stage on the
first, a parameter every data-parallel rank holds whole (no ZeRO) on dp rank 0. At the end of a log step the ranks
sum the vector in one all-reduce. How: docs/design-training.md, "Health metrics".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from deepspeed.utils import safe_get_local_fp32_param
from torch import nn

from mhf_dist.backend.deepspeed.zero import unpadded
from mhf_dist.model.health import ForwardHealth, HealthLayout, is_engram_table
from mhf_dist.parallel.groups import ParallelGroups
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.parallel.state_dict import split_dim


def local_fp32(param: nn.Parameter) -> torch.Tensor | None:
    """The fp32 values the torch optimizer steps of ``param`` on this rank: a view into a flat partition under ZeRO,
    the parameter itself without; None where this rank holds none of it."""
    if hasattr(param, "ds_id"):  # ZeRO-3 (the last partitions' padding is not the parameter's)
        return unpadded(param, safe_get_local_fp32_param(param))
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2, the bf16 optimizer
        return None if param._hp_mapping is None else param._hp_mapping.get_hp_fragment()
    return param


@dataclass
class _Fragments:
    """The parameters' fragments in one tensor the optimizer steps."""

    spans: list[tuple[int, int]]  # (start, length) in the flattened tensor, one per fragment
    rows: torch.Tensor  # for each (fragment, slot) pair: the fragment
    slots: torch.Tensor  # ... and the slot
    engram: list[int]  # the fragments of Engram tables


class StepHealth:
    """The optimizer's part of the sums: the squares of the gradients, the weights and the update per slot, and the
    Engram tables' entries that received gradient. ``named``: the trainable parameters in the model's naming;
    ``counted(name)``: whether this rank counts that parameter."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named: Sequence[tuple[str, nn.Parameter]],
        layout: HealthLayout,
        counted: Callable[[str], bool],
        device: torch.device,
    ):
        self.named = [(n, p) for n, p in named if p.requires_grad and counted(n)]
        self.layout, self.device = layout, device
        self.sums: torch.Tensor | None = None  # measuring while set
        self.fragments: dict[int, _Fragments] = {}
        self.weights: dict[
            int, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # (tensor, copy before the step)
        # host memory for those copies, kept between logged steps: the CPU allocator would hand it back to the
        # system and fault it in again each time (a GPU's caching allocator keeps freed memory for activations)
        self.host_copies: dict[int, torch.Tensor] = {}
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def arm(self) -> None:
        self.sums = self.layout.zeros(self.device)

    def take(self) -> torch.Tensor:
        sums, self.sums = self.sums, None
        return sums

    def _fragments_of(self, stepped: torch.Tensor) -> _Fragments:
        if id(stepped) not in self.fragments:
            storage, base = stepped.untyped_storage().data_ptr(), stepped.storage_offset()
            spans, rows, slots, engram = [], [], [], []
            for name, param in self.named:
                view = local_fp32(param)
                if view is None or not view.numel() or view.untyped_storage().data_ptr() != storage:
                    continue
                for slot in self.layout.slots_of(name):
                    rows.append(len(spans))
                    slots.append(slot)
                if is_engram_table(name):
                    engram.append(len(spans))
                spans.append((view.storage_offset() - base, view.numel()))
            as_index = lambda values: torch.tensor(values, dtype=torch.long).to(self.device)  # noqa: E731
            self.fragments[id(stepped)] = _Fragments(spans, as_index(rows), as_index(slots), engram)
        return self.fragments[id(stepped)]

    def _add(self, part: str, flat: torch.Tensor, fragments: _Fragments) -> None:
        squares = torch.stack([sum_of_squares(flat.narrow(0, s, n)) for s, n in fragments.spans])
        self.layout.part(self.sums, part).index_add_(0, fragments.slots, squares[fragments.rows])

    def _stepped(self, optimizer: torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.grad is not None and (fragments := self._fragments_of(tensor)).spans:
                    yield tensor, fragments

    def _before(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self.sums is None:
            return
        for tensor, fragments in self._stepped(optimizer):
            grad = tensor.grad.detach().reshape(-1)
            self._add("grad", grad, fragments)
            self._add("param", tensor.detach().reshape(-1), fragments)
            if fragments.engram:
                touched = self.layout.part(self.sums, "engram")
                for i in fragments.engram:
                    start, length = fragments.spans[i]
                    touched[0] += torch.count_nonzero(grad.narrow(0, start, length))
                    touched[1] += length
            self.weights[id(tensor)] = (tensor, self._copy(tensor))

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            return tensor.detach().clone()
        copy = self.host_copies.get(id(tensor))
        if copy is None or copy.shape != tensor.shape:
            copy = self.host_copies[id(tensor)] = torch.empty_like(tensor)
        return copy.copy_(tensor.detach())

    def _after(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for tensor, before in self.weights.values():
            update = torch.sub(tensor.detach(), before, out=before).reshape(-1)
            self._add("update", update, self._fragments_of(tensor))
        self.weights.clear()


ROW = 4096


def sum_of_squares(values: torch.Tensor) -> torch.Tensor:
    """``Σ x²`` of a flat tensor, in float64, to about 1e-6 at 10⁸ elements: fp32 norms of rows of 4096, summed in
    float64. (One fp32 sum over millions of squares is off in the 4th digit; a float64 pass costs 20x more on a
    CPU.)"""
    whole = values.numel() // ROW * ROW
    rows = torch.linalg.vector_norm(values[:whole].view(-1, ROW), dim=1).double().square().sum()
    return rows + torch.linalg.vector_norm(values[whole:], dtype=torch.float64).square()


def layout_for(model: nn.Module) -> HealthLayout:
    """The health layout of ``model`` (a ``LanguageModel``, a skeleton too)."""
    vocab = model.vocab
    hashed = vocab.encoder is not None
    return HealthLayout(
        [n for n, p in model.named_parameters() if p.requires_grad],
        vocab.decoder.num_heads,
        vocab.tables.num_rows if hashed else None,
    )


class EngineHealth:
    """A trainer's health metrics: the optimizer's part (``StepHealth``) and the forward's
    (``ForwardHealth``), summed over the ranks at the end of a log step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named: Sequence[tuple[str, nn.Parameter]],
        counted: Callable[[str], bool],
        forward: ForwardHealth,
        device: torch.device,
    ):
        self.layout, self.forward = forward.layout, forward
        self.step = StepHealth(optimizer, named, forward.layout, counted, device)
        self.grad_norms = (
            True  # False after a step whose gradients were clipped by a factor not known
        )

    def metrics(self, values: list[float]) -> dict[str, float]:
        """The metrics of a step's ``summary`` values, read on the host."""
        return self.layout.metrics(values, self.grad_norms)

    def arm(self) -> None:
        """Measure this step (a log step)."""
        self.step.arm()
        self.forward.arm()

    def summary(
        self, scalars: ScalarCollectives, grad_norm: torch.Tensor | float | None, clipping: float
    ) -> torch.Tensor:
        """The step's reported values, on the device (``HealthLayout.summary``), after one all-reduce over
        the job; ``grad_norm`` and ``clipping``: the global norm and the norm it was clipped to (0: none)."""
        total = scalars.sum_tensor(self.step.take() + self.forward.take())
        unclip = 1.0
        # without ZeRO, DeepSpeed clips the gradients and keeps no norm: the factor is not known
        self.grad_norms = clipping == 0 or grad_norm is not None
        if (
            clipping > 0 and grad_norm is not None
        ):  # DeepSpeed divides by max(1, (norm + 1e-6) / clipping)
            unclip = torch.clamp(
                (torch.as_tensor(grad_norm, device=total.device).double() + 1e-6) / clipping,
                min=1.0,
            )
        return self.layout.summary(total, unclip)


def counted_here(
    groups: ParallelGroups,
    split_dims: list[tuple[re.Pattern, int]],
    partitioned: bool,
    first_stage: bool,
) -> Callable[[str], bool]:
    """Whether this rank counts a parameter (module docstring): ``split_dims`` the tensor-parallel plan's split
    parameters (``tp_split_dims``), ``partitioned`` whether ZeRO partitions
    the optimizer's tensors over data parallelism, ``first_stage`` whether this is the pipeline's first stage."""

    def counted(name: str) -> bool:
        if not partitioned and groups.dp_rank != 0:
            return False
        if groups.tp_rank != 0 and split_dim(name, split_dims) is None:  # replicated over tp
            return False
        return first_stage or not name.startswith("vocab.tables.")

    return counted
