"""Step 1: which torch build runs, what devices it sees, and which attention backend runs the model's GQA call."""

from __future__ import annotations

import os
import statistics
import time

from mhf_dist.commands.gpu_check.runner import FAIL, MEASURED, Check, Context, StepFailed


def step_preflight(ctx: Context) -> list[Check]:
    import torch

    if ctx.mode.device == "cuda":
        if not torch.cuda.is_available():
            raise StepFailed(
                f"torch {torch.__version__} ({build_name()}) sees no GPU; run on a GPU machine with a "
                "CUDA or ROCm torch, or pass --cpu"
            )
        if (
            os.environ.get("DS_ACCELERATOR", "cuda") != "cuda"
        ):  # ROCm GPUs are DeepSpeed's cuda accelerator too
            raise StepFailed(
                f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} would keep DeepSpeed off the GPU; "
                "unset it"
            )
    return [build_check(ctx), sdpa_check(ctx)]


def build_name() -> str:
    """The torch build: ROCm (``torch.version.hip``; its GPUs are torch's ``cuda`` devices), CUDA, or CPU only."""
    import torch

    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    return f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"


def build_check(ctx: Context) -> Check:
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = (
        f"{devices} GPU(s), the first {torch.cuda.get_device_name()}"
        if devices
        else "no GPU visible"
    )
    return Check(
        "build",
        MEASURED,
        f"torch {torch.__version__}: {build_name()}; {seen}",
        {
            "rocm": float(bool(torch.version.hip)),
            "cuda": float(bool(torch.version.cuda)),
            "devices": float(devices),
        },
    )


SDPA_OPS = {  # the aten op each scaled-dot-product-attention backend runs as, in the profiler's events
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_backend(
    device: str, dtype: str, heads: int, kv_heads: int, head_dim: int, seq_len: int
) -> tuple[str, float]:
    """The backend that runs the model's attention call (``mhf_dist.model.backbone.Attention``: causal, GQA) at
    this shape, forward and backward, and its milliseconds (median of 3)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from mhf_dist.profiling.timing import torch_dtype

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, n, seq_len, head_dim, generator=gen)
        .to(device, torch_dtype(dtype))
        .requires_grad_()
        for n in (heads, kv_heads, kv_heads)
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=heads != kv_heads
        ).sum().backward()
        sync()

    call()  # first-use set-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ran = {event.name for event in prof.events()}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return "/".join(
        backend for op, backend in SDPA_OPS.items() if op in ran
    ) or "none seen", statistics.median(times) * 1e3


def sdpa_check(ctx: Context) -> Check:
    from mhf_dist.config import load_config

    size, seq_len = ctx.mode.profiles[0]
    cfg = load_config(f"{size}-h4b16k").model
    shape = (cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, seq_len)
    try:
        found = {
            dtype: sdpa_backend(ctx.mode.device, dtype, *shape) for dtype in ctx.mode.sdpa_dtypes
        }
    except Exception as e:  # a backend that fails to run is a finding, not the end of the check
        return Check("sdpa", FAIL, f"scaled_dot_product_attention failed: {type(e).__name__}: {e}")
    return Check(
        "sdpa",
        MEASURED,
        f"attention backend at {size}'s shape ({shape[0]} query / {shape[1]} kv heads of {shape[2]}, seq "
        f"{seq_len}, causal GQA, forward + backward): "
        + ", ".join(f"{dtype} {backend} ({ms:.2f} ms)" for dtype, (backend, ms) in found.items()),
        {f"{dtype}_ms": ms for dtype, (_, ms) in found.items()},
    )
