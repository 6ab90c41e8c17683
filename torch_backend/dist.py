"""Process-group setup and teardown for a worker, under torchrun or alone."""
from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ms_llm.nodes import collective_timeout_s, free_port


def init_distributed() -> torch.device:
    """NCCL on GPUs (one per local rank), gloo on CPU. Without torchrun: a world of one. A
    collective blocked longer than collective_timeout_s() (a dead peer) fails instead of
    waiting forever."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    timeout = timedelta(seconds=collective_timeout_s())
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def is_loaded_instance(obj: object, module: str, cls: str) -> bool:
    """isinstance(obj, module.cls) without importing `module`: before some code has loaded it,
    nothing is an instance. DTensor and ZeroRedundancyOptimizer cost every worker most of a
    second (sympy, dispatch tables) at start-up, which jobs that never use them should not pay."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


def is_dtensor(t: object) -> bool:
    return is_loaded_instance(t, "torch.distributed.tensor", "DTensor")


def shutdown() -> None:
    """Collect first: wrappers kept alive by reference cycles (DDP's reducer, optimizer hooks)
    would otherwise release gloo work objects during interpreter teardown, which can abort
    the process after a successful run. Then a barrier: without it, runs using a DeviceMesh
    can abort at exit."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
