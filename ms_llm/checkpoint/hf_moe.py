"""Mixtral tensor names on the Hugging Face Hub <-> ms_llm's canonical (stacked) expert tensors.

The Hub's Mixtral checkpoints keep one tensor per expert (`block_sparse_moe.experts.E.w1.weight`,
w1 = gate, w3 = up, w2 = down) and the router as `block_sparse_moe.gate.weight`; ms_llm stacks
the experts along dim 0 (`mlp.experts.gate_proj.weight` (E, F, H)) so expert parallelism is a
split of that dimension. Everything else keeps its LLaMA name.
"""
from __future__ import annotations

import re
from typing import Optional

from ms_llm.config.model import ModelConfig

# canonical stacked projection -> the Hub's per-expert weight
EXPERT_WEIGHTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_CANONICAL = re.compile(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.(gate_proj|up_proj|down_proj)\.weight)$")


def is_mixtral(model: ModelConfig) -> bool:
    """A model Mixtral's layout holds: MoE in every layer, no shared experts, normalised top-k."""
    m = model.moe
    return (m is not None and m.shared_experts == 0 and m.layer_freq == 1 and m.first_dense_layers == 0
            and m.normalize_top_k and model.expert_ffn_size == model.ffn_hidden_size)


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


def mixtral_config(model: ModelConfig, dtype: str, llama: dict) -> dict:
    """config.json for transformers' MixtralForCausalLM, from the LLaMA one (`llama`)."""
    m = model.moe
    drop = ("attention_bias", "mlp_bias")
    return {**{k: v for k, v in llama.items() if k not in drop}, "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coeff, "router_jitter_noise": 0.0, "sliding_window": None,
            "torch_dtype": dtype}
