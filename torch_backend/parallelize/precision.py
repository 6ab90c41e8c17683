"""Mixed precision: autocast for compute as the lowering says, FSDP2's policy for parameters and
gradient reduction (see dp.py). Master weights stay in master_dtype."""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(compute_dtype: str, device_type: str) -> ContextManager:
    """bf16 or fp16 matmuls when compute_dtype asks for it. Both work on CPU too (bf16 fast with
    AVX-512 BF16 / AMX); fp16 needs the loss scaling TrainStep applies."""
    dtype = DTYPES[compute_dtype]
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype)
