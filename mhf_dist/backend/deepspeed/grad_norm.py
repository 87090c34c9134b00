"""The ZeRO optimizer's global gradient norm with gradients it does not hold (the host-memory Engram tables'):
DeepSpeed clips with it and reports it, so both are those of the run that keeps every table on the device.

The norm is computed inside DeepSpeed's step by private methods, which are replaced on the optimizer instance:
ZeRO-3's ``_get_norm_groups`` (the per-group norms it combines) gets one more group, ZeRO-1/2's
``scaled_global_norm`` combines its norm with the extra one (``combine_grad_norm_groups``, as DeepSpeed combines its
groups: an invalid group norm stays invalid). Both work on loss-scaled norms (``cur_scale``: fp16's loss scale, 1
otherwise). bf16 with ZeRO-1 (the pipeline's) steps through ``BF16_Optimizer``, whose ``get_grads_for_norm`` lists
the gradients whose norms it sums over the model-parallel group (stages × tp): one rank of that group lists the
extra norm as one more one-value gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.utils import combine_grad_norm_groups
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


def include_in_global_norm(
    opt, extra_norm: Callable[[torch.Tensor], torch.Tensor], counts: bool = True
) -> None:
    """Make the ZeRO optimizer ``opt``'s global gradient norm include the norm ``extra_norm(like)`` (given on ``like``'s
    device and dtype, asked of every rank), so that it is ``sqrt(n_zero² + n_extra²)``; ``counts``: this rank lists it
    for the bf16 optimizer (one rank of each model-parallel group: the first stage's first tp rank)."""
    if isinstance(opt, BF16_Optimizer):
        original_grads = opt.get_grads_for_norm

        def grads_for_norm(for_clipping=False):
            grads = original_grads(for_clipping=for_clipping)
            if for_clipping:  # the gradients it scales
                return grads
            listed, expert = grads
            extra = extra_norm(listed[0]).reshape(1)
            return ([*listed, extra] if counts else listed), expert

        opt.get_grads_for_norm = grads_for_norm
    elif isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        original_groups = opt._get_norm_groups

        def norm_groups():
            groups = original_groups()
            return [*groups, extra_norm(groups[0]) * opt.cur_scale]

        opt._get_norm_groups = norm_groups
    elif isinstance(opt, DeepSpeedZeroOptimizer):
        original_norm = opt.scaled_global_norm

        def scaled_global_norm(norm_type=2):
            norm = original_norm(norm_type)
            host = extra_norm(norm) * opt.cur_scale
            return combine_grad_norm_groups([norm, host])

        opt.scaled_global_norm = scaled_global_norm
    else:
        raise RuntimeError(
            f"model.engram.offload needs a DeepSpeed ZeRO optimizer (stage 1-3), not "
            f"{type(opt).__name__}"
        )
