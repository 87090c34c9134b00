"""The dtypes a command writes or loads weights in (``--dtype``), by name."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
