"""MindFormers 2.x reads the YAMLs ms_llm writes: run under msrun (one CPU worker, so that
mindspore.communication.init() works, which MindFormers' mcore models need) with
PYTHONPATH=.oracles.

For each YAML (argv[1]: a JSON list of {"path", "build"}): MindFormerConfig loads it; MindSpore
takes its `parallel` section (set_auto_parallel_context checks every key, e.g. optimizer_level);
MindFormers' own parallel-config and model-config code converts it to its TransformerConfig with
the real degrees (which checks them, e.g. sequence parallel needs tensor parallel); its
LayerSetting places the layers with the real offset, interleave and recompute lists (which checks
their shapes and sums). Where "build" is set (small models: a 7B one does not fit a CI machine's
memory) the model is then built on the one device (degrees 1: MindFormers' process groups need the
cluster) and every parameter's name and shape is recorded. Output: JSON in argv[2].
"""
from __future__ import annotations

import copy
import json
import sys

import mindspore as ms
from mindspore.communication import init

MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}


# TransformerConfig fields that carry model.moe, model.mla, MTP, the expert-parallel degree and the cp algorithm.
MOE_KEYS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "norm_topk_prob", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
            "first_k_dense_replace", "moe_layer_freq", "expert_model_parallel_size", "context_parallel_algo",
            "use_ring_attention", "moe_router_score_function", "moe_router_topk_scaling_factor",
            "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
            "moe_router_bias_update_rate", "moe_router_load_balancing_type", "mtp_num_layers",
            "mtp_loss_scaling_factor", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm", "position_embedding_type", "rotary_scaling_factor",
            "mscale", "mscale_all_dim")


def check(path: str, build: bool) -> dict:
    from mindformers.core.context.build_context import MFContextOperator, is_legacy_model
    from mindformers.core.parallel_config import build_parallel_config
    from mindformers.models.build_config import get_model_config
    from mindformers.models.build_model import build_network
    from mindformers.parallel_core.training_graph.transformer.utils import LayerSetting
    from mindformers.tools.register import MindFormerConfig

    cfg = MindFormerConfig(path)
    MFContextOperator.reset_instance()
    MFContextOperator(cfg)
    out: dict = {"use_legacy": is_legacy_model()}
    # MindFormers hands `parallel` to MindSpore as it is (the mode may be a number): MindSpore checks it.
    parallel = dict(cfg.parallel)
    parallel["parallel_mode"] = MODES.get(parallel.get("parallel_mode"), parallel.get("parallel_mode"))
    if isinstance(parallel.get("dataset_strategy"), list):      # as MindFormers' ParallelOperator hands it over
        parallel["dataset_strategy"] = tuple(tuple(s) for s in parallel["dataset_strategy"])
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(**parallel)
    full = copy.deepcopy(cfg)
    build_parallel_config(full)
    if out["use_legacy"]:                   # r1.x: TransformerOpParallelConfig took the degrees; no mcore model
        return out
    model_config = get_model_config(full.model, default_args={"parallel_config": full.parallel_config})
    transformer = model_config.convert_to_transformer_config()
    setting = LayerSetting(transformer.num_layers, transformer.offset, transformer,
                           transformer.virtual_pipeline_model_parallel_size or 1)
    out["layers_per_stage"] = setting.layer_list.tolist()
    out["degrees"] = [transformer.data_parallel_size, transformer.tensor_model_parallel_size,
                      transformer.pipeline_model_parallel_size, transformer.context_parallel_size]
    out["moe"] = {key: getattr(transformer, key, None) for key in MOE_KEYS}
    if not build:
        return out
    for key in ("data_parallel", "model_parallel", "pipeline_stage", "context_parallel", "expert_parallel",
                "micro_batch_num"):
        cfg.parallel_config[key] = 1
    cfg.parallel_config.use_seq_parallel = False
    cfg.recompute_config.recompute = False
    cfg.model.model_config.offset = 0
    cfg.model.model_config.pp_interleave_num = 1
    ms.reset_auto_parallel_context()
    build_parallel_config(cfg)
    if cfg.model.model_config.model_type in ("qwen3", "qwen3_moe", "deepseek_v3"):
        # Qwen3ForCausalLM.__new__ (and Qwen3MoeForCausalLM's, DeepseekV3ForCausalLM's) asks MindFormers'
        # global Context for the mode, whose first build pins CPU affinity per device and divides by zero on
        # a CPU-only host: build the class it returns in graph mode from the same converted config.
        from mindformers.models.deepseek3.modeling_deepseek_v3_train import TrainingDeepseekV3ForCausalLM
        from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
        from mindformers.models.qwen3_moe.modeling_qwen3_moe_train import TrainingQwen3MoeForCausalLM
        train = {"qwen3": TrainingQwen3ForCausalLM, "qwen3_moe": TrainingQwen3MoeForCausalLM,
                 "deepseek_v3": TrainingDeepseekV3ForCausalLM}
        net = train[cfg.model.model_config.model_type](get_model_config(cfg.model, default_args={
            "parallel_config": cfg.parallel_config}))
    else:
        net = build_network(cfg.model, default_args={"parallel_config": cfg.parallel_config})
    out["model"] = type(net).__name__
    out["parameters"] = {name: list(p.shape) for name, p in net.parameters_and_names()}
    return out


def main(cases: list[dict]) -> dict:
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    import mindformers
    return {"mindformers": mindformers.__version__, "yamls": {c["path"]: check(c["path"], c["build"]) for c in cases}}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)
