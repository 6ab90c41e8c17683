"""torchtitan 0.3's ConfigManager reads the jobs ms_llm writes: run with PYTHONPATH=.oracles.

argv[1]: a JSON file {name: [argument, ...]} (--module, --config and the overrides, as torchrun
passes them to torchtitan.train). Each list goes through ConfigManager.parse_args, which loads the
registered config and applies the overrides with tyro (an unknown flag or a bad value exits). For
DeepSeek-V3 and Qwen3-MoE models the built model config is read back as the flavor's model args
(the names ms_llm/convert/torchtitan/flavors.py uses) plus what every flavor shares.
argv[2]: JSON out, {name: {"ok": values read back} or {"error": message}}.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys

from torchtitan.config.manager import ConfigManager


def read(args: list[str]) -> dict:
    cfg = ConfigManager().parse_args(args)
    p, t, o = cfg.parallelism, cfg.training, cfg.optimizer.param_groups[0].optimizer_kwargs
    return {"dp_replicate": p.data_parallel_replicate_degree, "dp_shard": p.data_parallel_shard_degree,
            "tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
            "pp_schedule": p.pipeline_parallel_schedule, "layers_per_stage": p.pipeline_parallel_layers_per_stage,
            "local_batch_size": t.local_batch_size, "global_batch_size": t.global_batch_size,
            "seq_len": t.seq_len, "steps": t.steps, "lr": o["lr"], "betas": list(o["betas"]),
            "activation_checkpoint": type(cfg.activation_checkpoint).__qualname__.split(".")[0],
            "checkpoint": [cfg.checkpoint.enable, cfg.checkpoint.interval], "seed": cfg.debug.seed,
            "model": model_args(cfg)}


def model_args(cfg) -> dict | None:
    """The MoE model torchtitan builds, in its flavor functions' argument names."""
    spec, m = cfg.model_spec, cfg.model_spec.model
    moe_layers = [layer for layer in m.layers if getattr(layer, "moe", None) is not None]
    if spec.name not in ("deepseek_v3", "qwen3") or not moe_layers:
        return None
    last, moe = m.layers[-1], moe_layers[-1].moe
    a, router, rope = last.attention, moe.router, last.attention.rope
    out = {"dim": m.dim, "n_layers": len(m.layers), "vocab_size": m.vocab_size, "n_heads": a.n_heads,
           "moe_hidden_dim": moe.routed_experts.inner_experts.hidden_dim, "num_experts": moe.num_experts,
           "rope": {"max_seq_len": rope.max_seq_len, "theta": rope.theta}}
    shared = {"norm_eps": m.norm.eps, "weight_tying": m.enable_weight_tying, "rope": type(rope).__qualname__,
              "load_balance_coeff": moe.load_balance_coeff, "score_func": router.score_func,
              "route_norm": router.route_norm, "route_scale": router.route_scale,
              "groups": [router.num_expert_groups, router.num_limited_groups],
              "mtp_layers": len(getattr(m, "mtp_layers", None) or []), "mtp_scale": getattr(cfg.loss, "mtp_scale", None)}
    if spec.name == "qwen3":
        out.update(n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, top_k=router.top_k)
        shared["qk_norm"] = a.qk_norm is not None
        return {"args": out, "shared": shared}
    dense = [layer.feed_forward for layer in m.layers if layer.moe is None]
    out.update({k: getattr(a, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim", "mscale")})
    out.update(dense_hidden_dim=dense[0].w1.out_features, n_dense_layers=len(dense),
               num_shared_experts=moe.shared_experts.w1.out_features // out["moe_hidden_dim"],
               router_top_k=router.top_k, router_score_func=router.score_func,
               router_num_expert_groups=router.num_expert_groups, router_num_limited_groups=router.num_limited_groups,
               router_route_scale=router.route_scale, router_route_norm=router.route_norm)
    out["rope"].update({k: getattr(rope, k) for k in ("rope_factor", "beta_fast", "beta_slow", "original_seq_len")})
    shared["yarn"] = rope.scaling
    return {"args": out, "shared": shared}


def main(cases: dict) -> dict:
    out = {}
    for name, args in cases.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                out[name] = {"ok": read(args)}
        except SystemExit:                      # tyro's verdict on a bad argument, printed to stderr
            out[name] = {"error": err.getvalue()[-2000:]}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(main(cases), f)
