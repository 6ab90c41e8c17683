"""megatron-core's TransformerConfig reads the arguments ms_llm writes for Megatron-LM: run with
PYTHONPATH=.oracles (megatron-core 0.16.1 ships the config classes, not Megatron-LM's argparse).

argv[1]: a JSON file {name: {flag: value or true}}. Each argument list becomes TransformerConfig
keywords (MLATransformerConfig with --multi-latent-attention) the way Megatron-LM's
core_transformer_config_from_args builds them (every field whose name is an argument, with
arguments.py's defaults where they differ from the dataclass's, --num-experts as num_moe_experts,
--moe-layer-freq patterns evaluated, --bf16/--fp16 as params_dtype and pipeline_dtype, --swiglu
as a gated SiLU, --num-layers-per-virtual-pipeline-stage as virtual stages); its __post_init__
checks them.
argv[2]: JSON out, {name: {"ok": fields read back} or {"error": message}}.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

# Megatron-LM's arguments.py defaults that differ from the config dataclasses' (_add_mla_args).
MLA_ARG_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "rotary_scaling_factor": 1.0, "mscale": 1.0,
                    "mscale_all_dim": 0.0}


def _value(text):
    """An argument as argparse would type it: a number where it is one, else the string (true: a flag);
    several values as a list; a --moe-layer-freq pattern evaluated as Megatron-LM's _eval_pattern does."""
    if isinstance(text, list):
        return [_value(t) for t in text]
    if isinstance(text, str) and "[" in text and not re.search(r"[^,\d\[\]\(\)\+\*]", text):
        return eval(text)              # digits, brackets, + and * only, as Megatron-LM checks before its eval
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return text


def config(flags: dict) -> TransformerConfig:
    args = {flag[2:].replace("-", "_"): _value(value) for flag, value in flags.items()}
    cls = MLATransformerConfig if args.get("multi_latent_attention") else TransformerConfig
    if cls is MLATransformerConfig:
        args = {**MLA_ARG_DEFAULTS, **args}
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {name: value for name, value in args.items() if name in fields}
    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype, bf16=bool(args.get("bf16")), fp16=bool(args.get("fp16")))
    if args.get("swiglu"):
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    if args.get("disable_bias_linear"):
        kw["add_bias_linear"] = False
    if "num_experts" in args:
        kw["num_moe_experts"] = args["num_experts"]
    if not args.get("group_query_attention"):
        kw.pop("num_query_groups", None)
    if "num_layers_per_virtual_pipeline_stage" in args:
        per_stage = args["num_layers"] // args["pipeline_model_parallel_size"]
        kw["virtual_pipeline_model_parallel_size"] = per_stage // args["num_layers_per_virtual_pipeline_stage"]
    return cls(**kw)


def main(cases: dict) -> dict:
    out = {}
    for name, flags in cases.items():
        try:
            c = config(flags)
        except (ValueError, AssertionError, TypeError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"ok": {k: getattr(c, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel", "virtual_pipeline_model_parallel_size",
            "recompute_granularity", "recompute_method", "recompute_num_layers", "gated_linear_unit",
            "add_bias_linear", "add_qkv_bias", "qk_layernorm", "normalization", "bf16", "fp16", "cp_comm_type",
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_router_pre_softmax", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
            "moe_layer_freq", "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
            "moe_router_load_balancing_type", "mtp_num_layers", "mtp_loss_scaling_factor", "multi_latent_attention")}}
        if c.multi_latent_attention:
            out[name]["ok"].update({k: getattr(c, k) for k in (
                "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
                "beta_slow")})
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(main(cases), f)
