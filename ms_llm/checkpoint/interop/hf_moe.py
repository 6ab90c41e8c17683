"""Mixtral tensor names on the Hugging Face Hub <-> ms_llm's canonical (stacked) expert tensors.

The Hub's Mixtral checkpoints keep one tensor per expert (`block_sparse_moe.experts.E.w1.weight`,
w1 = gate, w3 = up, w2 = down) and the router as `block_sparse_moe.gate.weight`; ms_llm stacks
the experts along dim 0 (`mlp.experts.gate_proj.weight` (E, F, H)) so expert parallelism is a
split of that dimension. Everything else keeps its LLaMA name.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.storage.safetensors_io import write_file
from ms_llm.errors import CheckpointError
from ms_llm.strategy.plan import ParamPlan
from ms_llm.zero.partition import EXPERT_KINDS

# canonical stacked projection -> the Hub's per-expert weight
EXPERT_WEIGHTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_CANONICAL = re.compile(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.(gate_proj|up_proj|down_proj)\.weight)$")


def mixtral_names(name: str, num_experts: int) -> Optional[list[str]]:
    """The Hub names holding canonical tensor `name` (one per expert for a stacked tensor, in
    expert order); None for a tensor named alike in both."""
    match = _CANONICAL.match(name)
    if match is None:
        return None
    prefix, _, proj = match.groups()
    if proj is None:
        return [f"{prefix}block_sparse_moe.gate.weight"]
    return [f"{prefix}block_sparse_moe.experts.{e}.{EXPERT_WEIGHTS[proj]}.weight" for e in range(num_experts)]


def stack_experts(hub: Checkpoint, params: dict[str, ParamPlan], num_experts: int, path: str) -> None:
    """Write the weights of Hub checkpoint `hub` to safetensors `path` under their canonical
    names `params`, each expert projection stacked from its per-expert tensors; one stacked
    tensor is in memory at a time."""
    sources, entries = {}, []
    for name, p in params.items():
        hub_names = mixtral_names(name, num_experts) or [name]
        missing = [h for h in hub_names if h not in hub.index.tensors]
        if missing:
            raise CheckpointError(f"{hub.folder}: lacks {missing[0]!r} (part of {name}); not a Mixtral checkpoint?")
        dtypes = {hub.entry(h).dtype for h in hub_names}
        if len(dtypes) > 1:
            raise CheckpointError(f"{hub.folder}: the tensors of {name} mix dtypes {sorted(dtypes)}")
        sources[name] = hub_names
        entries.append((name, dtypes.pop(), tuple(p.shape)))

    def fetch(name: str) -> np.ndarray:
        arrays = [hub.read_full(h) for h in sources[name]]
        return np.stack(arrays) if params[name].kind in EXPERT_KINDS else arrays[0]

    write_file(path, entries, fetch)
