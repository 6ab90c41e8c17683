"""The shared ZeRO engine (ms_llm.zero) on torch.distributed."""
from torch_backend.zero.data_parallel import ZeroDataParallel

__all__ = ["ZeroDataParallel"]
