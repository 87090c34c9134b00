"""Shared by the equivalence tests (fused vs plain decoder, tensor parallel vs one process, compiled vs eager)."""

from __future__ import annotations

import torch

# Weights well above the training init (0.02): with tiny weights the decoder's soft-retrieval gradients are
# ~1e-8, and a wrong reduction of them hides under the tolerance.
INIT_STD = 0.1


def assert_tensor_close(got: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5, floor: float = 1e-6):
    """Max elementwise error within ``rel`` of the tensor's largest entry: fp32 sums run in another order, so
    single small entries differ in the 5th digit. The floor covers gradients that are zero in exact arithmetic
    (the gate's last bias: softmax over heads ignores a shared shift) and hold only rounding noise; at
    ``INIT_STD`` the real gradients are 1e-3 to 1, so a wrong reduction still fails by orders of magnitude."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rel * scale + floor, f"{what}: max error {err:.3e} > {rel} x scale {scale:.3e}"
