"""A peer's whole training state under ms_llm names, read lazily: what `ms-llm import-run` writes
and what `ms-llm export-run` hands a peer's writer.

Each peer reader (Megatron-LM, DeepSpeed, torchtitan, MindFormers) maps its files to one
ForeignRun: the model weights under canonical (Hugging Face) names, the Adam moments under
optim_name("exp_avg" | "exp_avg_sq", name), fp32 master weights under optim_name("master", name)
where the peer keeps them apart from bf16/fp16 weights, and the training state a checkpoint head
holds (ms_llm/run/saved_state.py: optimizer_step, lr, loss_scale, sampler). A tensor is read only
when the writer asks for it, so a conversion holds one tensor (and its pieces) at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ms_llm.config.model import ModelConfig


@dataclass(frozen=True)
class LazyTensor:
    """One whole tensor of a foreign checkpoint: its shape and ms_llm dtype name ("float32",
    "bfloat16" as raw uint16 bits, "float16"), and how to read it when it is needed."""
    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]


@dataclass
class ForeignRun:
    """A peer's training state at `step`, ready to be written as an ms_llm checkpoint."""
    source: str                              # "megatron", "deepspeed", "torchtitan", "mindformers"
    model: ModelConfig
    step: int
    tensors: dict[str, LazyTensor]
    state: dict[str, Any] = field(default_factory=dict)     # the checkpoint head's training state
    job: Optional[dict[str, Any]] = None     # the ms_llm job document converted from the peer's config
    notes: list[str] = field(default_factory=list)          # what the import could not carry, said to the user
