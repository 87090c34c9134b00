"""Shared by the equivalence tests (fused vs plain decoder, tensor parallel vs one process, compiled vs eager)."""

from __future__ import annotations

import torch

from mhf_dist.model.scoring import TARGET_CHUNK
from mhf_dist.parallel.comm import count_collectives

# Weights well above the training init (0.02): with tiny weights the decoder's soft-retrieval gradients are
# ~1e-8, and a wrong reduction of them hides under the tolerance.
INIT_STD = 0.1

EVAL_CHUNKS = (
    TARGET_CHUNK,
    21,
)  # evaluation sums over the vocabulary in one chunk, and in chunks that split it


def assert_tensor_close(
    got: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5, floor: float = 1e-6
):
    """Max elementwise error within ``rel`` of the tensor's largest entry: fp32 sums run in another order, so
    single small entries differ in the 5th digit. The floor covers gradients that are zero in exact arithmetic
    (the gate's last bias: softmax over heads ignores a shared shift) and hold only rounding noise; at
    ``INIT_STD`` the real gradients are 1e-3 to 1, so a wrong reduction still fails by orders of magnitude."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rel * scale + floor, f"{what}: max error {err:.3e} > {rel} x scale {scale:.3e}"


def step(model, batch):
    """Loss, gradients by parameter name, log P_inf, collectives of one forward + backward, and the evaluation
    sums over the vocabulary in each of ``EVAL_CHUNKS``."""
    with count_collectives() as log:
        out = model(batch[:, :-1], batch[:, 1:])
        out.loss.backward()
    with torch.no_grad():
        logp = model.log_p_inf(batch[:, :-1])
        h = model.hidden(batch[:, :-1]).flatten(0, 1)
        sums = [
            model.vocab.calibration_sums(h, batch[:, 1:].flatten(), chunk_size=c)
            for c in EVAL_CHUNKS
        ]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {
        "loss": out.loss.detach(),
        "heads": out.head_losses.detach(),
        "grads": grads,
        "logp": logp,
        "bytes": dict(log.bytes),
        "eval": sums,
    }


def batch_with_ignored_targets(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[2, 8]`` of ids in ``[1, vocab)`` and their next-token targets, the second row's last two ignored
    (-100), which every mean of the loss leaves out."""
    x = torch.randint(1, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    y = x[:, 1:].clone()
    y[1, -2:] = -100
    return x[:, :-1], y


def loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_fn(model)`` and the gradients its backward leaves on ``model``'s parameters, by name."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
