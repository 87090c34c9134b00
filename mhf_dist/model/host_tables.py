"""``HostTables``: Engram tables kept in host memory, outside DeepSpeed (``model.engram.offload``).

The rows a micro-batch reads depend on its token ids alone, so they are known before its forward pass. ``HostTables``
has ``BucketTables``' lookup interface, but its ``weight [T, R, d]`` is a plain fp32 host tensor, not a parameter:
``prefetch`` (or ``lookup`` itself, when nothing was prefetched) gathers the micro-batch's unique rows to the device
(``GatheredRows``; on a GPU staged in pinned memory and copied on a side stream), the lookup reads them through
indices remapped onto that set, and their backward hook adds the gradient into the host buffer ``grad [T, R, d]`` (on
a GPU through a copy, ``PendingGrad``, that ``accumulate`` and ``advance`` wait for), marking ``touched`` rows when
the trainer keeps that mask (lazy update, or dp > 1). The optimizer step and the checkpoint files are
``mhf_dist.train.host_tables``'s; ``state_dict`` leaves the weight out. How and why:
docs/design-engram.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GatheredRows:
    index: torch.Tensor  # [U] unique flat host rows (t·R + row), on the host
    inverse: torch.Tensor  # [..., T] position of each looked-up row in ``rows``, on the device
    rows: torch.Tensor  # [U, d] the rows, on the device
    ready: torch.cuda.Event | None  # the side stream's copy finished (CUDA only)
    staged: tuple[torch.Tensor, ...] = ()  # the pinned sources, kept alive until the copy finished


@dataclass
class PendingGrad:
    """A gradient on its way from the device to the host (CUDA only)."""

    index: torch.Tensor  # [U] the flat host rows it belongs to
    values: torch.Tensor  # [U, d] pinned host buffer, in the compute dtype
    ready: torch.cuda.Event  # the copy into ``values`` finished


class HostTables(nn.Module):
    """``T`` tables of ``R`` rows of width ``d`` in host memory, looked up like ``BucketTables`` (tp = 1)."""

    def __init__(
        self, num_tables: int, num_rows: int, dim: int, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.num_rows = num_rows
        # host memory, whatever the default device
        self.weight = torch.empty(num_tables, num_rows, dim, device="cpu", dtype=dtype)
        # fp32 host gradient, allocated by the trainer; on a CUDA device complete only after accumulate()
        self.grad: torch.Tensor | None = None
        # bool [T·R]: the flat rows given a gradient, when the trainer keeps it (lazy update, or dp > 1)
        self.touched: torch.Tensor | None = None
        # where the gathered rows go (the trainer sets the engine's device)
        self.device = torch.device("cpu")
        self.transfer_dtype = torch.float32  # the model's compute dtype
        self._next: GatheredRows | None = None
        self._current: GatheredRows | None = None
        self._stream = None  # host -> device copies of gathered rows
        self._grad_stream = None  # device -> host copies of their gradients
        self._pending: list[PendingGrad] = []

    # ------------------------------------------------------------------ BucketTables' interface (tp = 1)
    @property
    def row_offset(self) -> int:
        return 0

    @property
    def local_rows(self) -> int:
        return self.num_rows  # a lookup reads every row

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [..., T]`` (row of each table) -> ``[..., T, d]``: ``u_i = E_i[rows_i]``, in ``transfer_dtype``."""
        return self(rows)

    # ------------------------------------------------------------------ gathering
    def flat_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., T]`` -> flat ids ``t·R + row`` over the whole tables (of ``weight.view(T·R, d)``
        when it holds them all)."""
        return rows + torch.arange(self.weight.shape[0], device=rows.device) * self.num_rows

    def gather(self, rows: torch.Tensor) -> GatheredRows:
        """The unique rows that ``rows [..., T]`` (on the host) reads, on their way to ``self.device``."""
        index, inverse = torch.unique(self.flat_rows(rows), return_inverse=True)
        pin = self.device.type == "cuda"
        selected = self.select(index, pin)
        if not pin:
            return GatheredRows(index, inverse.to(self.device), selected.to(self.device), None)
        # selected straight into pinned memory, then copied on the side stream
        staged = (selected, inverse.pin_memory())
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            rows_on_device = staged[0].to(self.device, non_blocking=True)
            inverse_on_device = staged[1].to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return GatheredRows(index, inverse_on_device, rows_on_device, ready, staged)

    def select(self, index: torch.Tensor, pin: bool) -> torch.Tensor:
        """The flat rows ``index [U]`` in ``transfer_dtype`` on the host (in pinned memory with ``pin``)."""
        weight = self.weight.view(-1, self.weight.shape[-1])
        if not pin:
            return weight.index_select(0, index).to(self.transfer_dtype)
        selected = torch.empty(
            (index.numel(), weight.shape[1]), dtype=self.transfer_dtype, pin_memory=True
        )
        if self.transfer_dtype == weight.dtype:
            torch.index_select(weight, 0, index, out=selected)
        else:
            selected.copy_(weight.index_select(0, index))
        return selected

    def prefetch(self, rows: torch.Tensor) -> None:
        """Start gathering the rows of the next micro-batch (``rows [B, S, T]`` on the host)."""
        self._next = self.gather(rows)

    def advance(self) -> None:
        """The prefetched rows become those the next forward (and its recomputation in backward) reads; the
        gradients of earlier micro-batches already copied to the host are added."""
        self._current, self._next = self._next, None
        self.accumulate(wait=False)

    def _prefetched(self) -> GatheredRows | None:
        """The rows gathered ahead for the next forward, if any."""
        return self._current

    def release(self) -> None:
        """Drop the gathered rows (end of a training step): later lookups gather for themselves."""
        self._current = self._next = None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``lookup``."""
        gathered = self._prefetched()
        if gathered is None or gathered.inverse.shape != rows.shape:
            gathered = self.gather(rows.cpu())
        if gathered.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(gathered.ready)
            gathered.rows.record_stream(torch.cuda.current_stream(self.device))
            gathered.inverse.record_stream(torch.cuda.current_stream(self.device))
        leaf = gathered.rows.detach().requires_grad_(torch.is_grad_enabled())
        if leaf.requires_grad:
            leaf.register_hook(lambda g, index=gathered.index: self._add_grad(index, g))
        return F.embedding(gathered.inverse, leaf)

    def _add_grad(self, index: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.device.type != "cuda":
            self._index_add(index, grad.detach())
            return
        # the backward pass must not wait for the host: start the copy and leave the addition to accumulate()
        current = torch.cuda.current_stream(grad.device)
        if self._grad_stream is None:
            self._grad_stream = torch.cuda.Stream(grad.device)
        self._grad_stream.wait_stream(current)  # the gradient is computed
        with torch.cuda.stream(self._grad_stream):
            values = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
            values.copy_(grad.detach(), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._grad_stream)
        grad.record_stream(self._grad_stream)  # its memory is not reused before the copy read it
        self._pending.append(PendingGrad(index, values, ready))

    def _index_add(self, index: torch.Tensor, grad: torch.Tensor) -> None:
        """Add the gradient ``grad [U, d]`` of the flat rows ``index [U]``."""
        if self.touched is not None:
            self.touched[index] = True
        if self.grad is None:
            self.grad = torch.zeros_like(self.weight, dtype=torch.float32)
        self.grad.view(-1, self.weight.shape[-1]).index_add_(0, index, grad.float())

    def accumulate(self, wait: bool = True) -> None:
        """Add the gradients copied from the device into ``grad``: all of them (``wait``: waiting for each copy's
        event, as before reading ``grad``), or those whose copy already finished. Nothing to do on a CPU device."""
        while self._pending and (wait or self._pending[0].ready.query()):
            pending = self._pending.pop(0)
            pending.ready.synchronize()
            self._index_add(pending.index, pending.values)

    # ------------------------------------------------------------------ state dict
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if (weight := state_dict.pop(prefix + "weight", None)) is not None:
            self.weight.copy_(weight)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
