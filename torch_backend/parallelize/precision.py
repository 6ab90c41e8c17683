"""Mixed precision from strategy.precision: autocast for compute, FSDP2's policy for
parameters and gradient reduction (see dp.py). Master weights stay in master_dtype."""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

from ms_llm.errors import StrategyError
from ms_llm.strategy.plan import ModelPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_precision(plan: ModelPlan) -> None:
    prec = plan.strategy.precision
    if "float16" in (prec.param_dtype, prec.compute_dtype):
        raise StrategyError("strategy.precision: the torch backend trains in bfloat16 or float32; float16 "
                            "(with loss scaling) is not lowered, use bfloat16")
    if prec.master_dtype != "float32":
        raise StrategyError(f"strategy.precision.master_dtype: the torch backend keeps float32 master weights, "
                            f"got {prec.master_dtype}")


def autocast(plan: ModelPlan, device_type: str) -> ContextManager:
    """bf16 matmuls when compute_dtype asks for it (it works on CPUs with AVX-512 BF16 / AMX too)."""
    dtype = DTYPES[plan.strategy.precision.compute_dtype]
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype)
