"""DeepSpeed's buffers on a rank, as ``plan`` counts them (``mhf_dist.commands.plan``). Nothing here imports
DeepSpeed; tests/test_memory_plan.py checks ``ZERO_DEFAULTS`` against the installed one."""

from __future__ import annotations

from mhf_dist.backend.deepspeed.config import fp32_accumulation, zero_stage

# DeepSpeed's defaults for the ``zero_optimization`` keys the plan reads, as its ``DeepSpeedZeroConfig`` fills them in
# (deepspeed/runtime/zero/config.py)
ZERO_DEFAULTS = {
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
}


def zero_setting(ds_config: dict, key: str):
    """``zero_optimization.<key>`` of the engine's DeepSpeed config, else DeepSpeed's default (``ZERO_DEFAULTS``;
    ``overlap_comm`` defaults to on under ZeRO-3 only)."""
    zero = ds_config["zero_optimization"]
    if key in zero:
        return zero[key]
    return zero["stage"] == 3 if key == "overlap_comm" else ZERO_DEFAULTS[key]


def bf16_optimizer(ds_config: dict) -> bool:
    """Whether DeepSpeed runs its bf16 optimizer (``BF16_Optimizer``) instead of its ZeRO one: bf16 with fp32
    gradient accumulation under ZeRO-1, the optimizer's states not offloaded (DeepSpeed's own rule)."""
    offload = ds_config["zero_optimization"].get("offload_optimizer") or {}
    return (
        fp32_accumulation(ds_config)
        and zero_stage(ds_config) == 1
        and offload.get("device") != "cpu"
    )


def communication_bytes(ds_config: dict, e: int) -> int:
    """Bytes per value of DeepSpeed's gradient reduction: ``communication_data_type``, else the run's."""
    return {"fp32": 4, "bf16": 2, "fp16": 2}.get(ds_config.get("communication_data_type"), e)


def engine_buffer_bytes(ds_config: dict, params: int, largest: int, e: int, device: str) -> float:
    """DeepSpeed's buffers on a rank holding ``params`` parameters (its stage's tensor-parallel share) in a run of
    ``e`` bytes per value, plus the largest parameter's whole gradient (see the module docstring). ``device``
    ``cpu``: a buffer is resident only where written, at most ``params`` elements."""
    stage, contiguous = zero_stage(ds_config), zero_setting(ds_config, "contiguous_gradients")
    bucket = zero_setting(ds_config, "reduce_bucket_size")
    comm = communication_bytes(ds_config, e)

    def allocated(elements: int) -> int:
        return min(elements, params) if device == "cpu" else elements

    if bf16_optimizer(
        ds_config
    ):  # no reduce buckets: the fp32 gradients are all-reduced in place (in fp32), or
        # through a copy in the communication dtype
        return (0 if comm == 4 else comm * params) + e * largest
    buckets = 0.0  # ZeRO-0, or gradients not made contiguous
    if contiguous and stage == 3:
        # the reduce bucket holds the gradients in the communication dtype
        buckets = comm * allocated(bucket)
    elif contiguous and stage in (1, 2):
        buckets = (
            (2 if zero_setting(ds_config, "overlap_comm") else 1)
            * (4 if stage == 1 else e)
            * allocated(bucket)
        )
    gathered = 0.0
    if (
        stage == 3
    ):  # the prefetched parameters, and the largest one gathered twice in backward: autograd's saved
        # views of the forward's copy (the fused heads save their tables') outlive its release, backward gathers again
        ahead = min(
            zero_setting(ds_config, "stage3_prefetch_bucket_size"),
            zero_setting(ds_config, "stage3_max_live_parameters"),
        )
        gathered = e * (allocated(ahead) + largest)
    return buckets + gathered + e * largest
