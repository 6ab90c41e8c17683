"""megatron-core's TransformerConfig reads the arguments ms_llm writes for Megatron-LM: run with
PYTHONPATH=.oracles (megatron-core 0.16.1 ships the config classes, not Megatron-LM's argparse).

argv[1]: a JSON file {name: {flag: value or true}}. Each argument list becomes TransformerConfig
keywords the way Megatron-LM's core_transformer_config_from_args builds them (every field whose
name is an argument, --num-experts as num_moe_experts, --bf16/--fp16 as params_dtype and
pipeline_dtype, --swiglu as a gated SiLU, --num-layers-per-virtual-pipeline-stage as virtual
stages); its __post_init__ checks them.
argv[2]: JSON out, {name: {"ok": fields read back} or {"error": message}}.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


def _value(text):
    """An argument as argparse would type it: a number where it is one, else the string (true: a flag)."""
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return text


def config(flags: dict) -> TransformerConfig:
    args = {flag[2:].replace("-", "_"): _value(value) for flag, value in flags.items()}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
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
    return TransformerConfig(**kw)


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
            "expert_model_parallel_size", "sequence_parallel", "virtual_pipeline_model_parallel_size",
            "recompute_granularity", "recompute_method", "recompute_num_layers", "gated_linear_unit",
            "add_bias_linear", "add_qkv_bias", "qk_layernorm", "normalization", "bf16", "fp16", "cp_comm_type",
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_router_pre_softmax", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
            "moe_layer_freq")}}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(main(cases), f)
