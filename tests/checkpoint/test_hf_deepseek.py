"""Hugging Face interop of DeepSeek-V3 and Qwen3-MoE checkpoints: the Hub layout (one tensor per expert,
DeepSeek's MTP layers at model.layers.{num_layers + d}) and transformers 5's fused gate_up_proj import,
export gives the same tensors back bit for bit (both ways), the MTP modules are kept or dropped on
export, and config.json <-> ModelConfig holds the model both ways, the published configs included."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from ms_llm.checkpoint import Checkpoint
from ms_llm.checkpoint.interop.hf import export_hf, hf_source
from ms_llm.checkpoint.reshard import write_full
from ms_llm.cli import main as cli
from ms_llm.config.hf import hf_config, model_from_hf_config
from ms_llm.config.model import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from ms_llm.errors import CheckpointError
from torch_backend.model import Transformer

transformers = pytest.importorskip("transformers")

DEEPSEEK = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
                num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=32, num_mtp_layers=0)
QWEN3_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=32)
HUB = {"deepseek_v3": ("DeepseekV3", DEEPSEEK), "qwen3_moe": ("Qwen3Moe", QWEN3_MOE)}

# The model part of the published config.json files (deepseek-ai/DeepSeek-V3, Qwen/Qwen3-30B-A3B).
DEEPSEEK_V3_671B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}

TINY_MTP = ModelConfig(
    name="tiny_deepseek_mtp", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
    max_seq_len=32, norm_eps=1e-6, dtype="float32",
    mla=MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12),
    moe=MoEConfig(num_experts=8, top_k=4, expert_ffn_hidden_size=16, shared_experts=2, first_dense_layers=1,
                  score_function="sigmoid", routed_scaling_factor=2.5, num_groups=4, group_top_k=2, expert_bias=True,
                  aux_loss_coeff=0.0, seq_aux_loss_coeff=1e-4),
    mtp_layers=2)


def hub_folder(family: str, folder):
    """transformers' save_pretrained of a tiny random model (the Hub layout), and the model."""
    cls, kwargs = HUB[family]
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**kwargs)).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.save_pretrained(folder)
    return hf


def ours_with_mtp(folder):
    """An ms_llm checkpoint of TINY_MTP with random weights and expert bias."""
    model = Transformer(TINY_MTP)
    model.init_weights(0, std=0.1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.3)
    arrays = {n: (t.detach().numpy().copy(), "float32") for n, t in model.state_dict().items()}
    return write_full(arrays, folder, TINY_MTP), {n: a for n, (a, _) in arrays.items()}


def read_all(ckpt_dir) -> dict[str, np.ndarray]:
    with Checkpoint.open(ckpt_dir) as ckpt:
        return {n: ckpt.read_full(n) for n in ckpt.names()}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Same names, dtypes and bits."""
    return sorted(a) == sorted(b) and all(a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("family", list(HUB))
def test_hub_checkpoint_round_trips_bit_exact(tmp_path, family):
    """Hub folder -> `convert-checkpoint --from hf` -> `--to hf`: the same tensors, bit for bit, and a
    config.json transformers reads as the same model (equal logits)."""
    hf = hub_folder(family, tmp_path / "hub")
    assert cli(["convert-checkpoint", str(tmp_path / "hub"), str(tmp_path / "ckpt"), "--from", "hf"]) == 0
    assert cli(["convert-checkpoint", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--to", "hf"]) == 0
    hub, back = load_file(str(tmp_path / "hub" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert any(".mlp.experts.7.gate_proj.weight" in n for n in hub) and same(hub, back)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reread) is type(hf)
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(reread(tokens).logits, hf(tokens).logits)


def test_fused_gate_up_proj_imports_as_the_per_expert_layout(tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj (E, 2F, H), down_proj (E, H, F))
    saved as is imports to the same checkpoint as save_pretrained's per-expert tensors."""
    hf = hub_folder("deepseek_v3", tmp_path / "hub")
    (tmp_path / "fused").mkdir()
    state = {n: t.detach().numpy() for n, t in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    for name in ("hub", "fused"):
        assert cli(["convert-checkpoint", str(tmp_path / name), str(tmp_path / f"ckpt_{name}"), "--from", "hf"]) == 0
    per_expert, fused = read_all(tmp_path / "ckpt_hub"), read_all(tmp_path / "ckpt_fused")
    assert per_expert["model.layers.1.mlp.experts.up_proj.weight"].shape == (8, 16, 32)
    assert same(per_expert, fused)


def test_mtp_modules_export_kept_or_dropped_and_round_trip(tmp_path):
    """ms_llm -> HF -> ms_llm -> HF, bit-exact both ways, with the MTP modules in DeepSeek's layout
    (and its copies of the embedding and head); --drop-mtp leaves them out, which transformers
    then loads without an unexpected tensor."""
    src, arrays = ours_with_mtp(tmp_path / "ckpt")
    assert cli(["convert-checkpoint", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hub = load_file(str(tmp_path / "hf" / "model.safetensors"))
    L = TINY_MTP.num_layers
    for d in range(TINY_MTP.mtp_layers):
        assert np.array_equal(hub[f"model.layers.{L + d}.eh_proj.weight"], arrays[f"model.mtp.{d}.eh_proj.weight"])
        assert np.array_equal(hub[f"model.layers.{L + d}.shared_head.norm.weight"], arrays[f"model.mtp.{d}.norm.weight"])
        assert np.array_equal(hub[f"model.layers.{L + d}.mlp.experts.5.down_proj.weight"],
                              arrays[f"model.mtp.{d}.layer.mlp.experts.down_proj.weight"][5])
        assert np.array_equal(hub[f"model.layers.{L + d}.embed_tokens.weight"], arrays["model.embed_tokens.weight"])
        assert np.array_equal(hub[f"model.layers.{L + d}.shared_head.head.weight"], arrays["lm_head.weight"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2

    assert cli(["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "back"), "--from", "hf"]) == 0
    with Checkpoint.open(tmp_path / "back") as back:
        assert back.model_config() == dataclasses.replace(TINY_MTP, name=back.model_config().name)
    assert same(read_all(tmp_path / "back"), arrays)
    assert cli(["convert-checkpoint", str(tmp_path / "back"), str(tmp_path / "hf2"), "--to", "hf"]) == 0
    assert same(load_file(str(tmp_path / "hf2" / "model.safetensors")), hub)

    assert cli(["convert-checkpoint", str(src), str(tmp_path / "main"), "--to", "hf", "--drop-mtp"]) == 0
    main = load_file(str(tmp_path / "main" / "model.safetensors"))
    assert same(main, {n: a for n, a in hub.items() if not re.match(rf"model\.layers\.({L}|{L + 1})\.", n)})
    assert json.loads((tmp_path / "main" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "main", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    (tmp_path / "staging").mkdir()
    with hf_source(tmp_path / "main", tmp_path / "staging") as dropped:
        assert dropped.model_config().mtp_layers == 0


def test_bf16_export_keeps_the_expert_bias_fp32(tmp_path):
    src, arrays = ours_with_mtp(tmp_path / "ckpt")
    export_hf(src, tmp_path / "hf", dtype="bfloat16")
    import safetensors.torch
    hub = safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hub[bias].dtype == torch.float32 and np.array_equal(hub[bias].numpy(), arrays[bias])
    assert hub["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def qwen3_dense_layers() -> ModelConfig:
    return ModelConfig(name="q", vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffn_hidden_size=64, qk_norm=True, norm_eps=1e-6, dtype="bfloat16",
                       moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=16, dense_layers=(0, 2),
                                     aux_loss_coeff=0.001, normalize_top_k=False))


@pytest.mark.parametrize("model", [
    TINY_MTP,
    dataclasses.replace(TINY_MTP, mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                v_head_dim=12, rope_interleave=False), mtp_layers=0,
                        rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_seq_len=8, mscale=0.707,
                                                 mscale_all_dim=1.0, attention_factor=0.9643)),
    dataclasses.replace(TINY_MTP, moe=None, mtp_layers=1),              # dense multi-latent attention
    qwen3_dense_layers(),
], ids=["deepseek_v3-mtp", "deepseek_v3-yarn", "deepseek_v3-dense", "qwen3_moe-dense_layers"])
def test_config_json_round_trips_and_transformers_builds_the_same_layers(model):
    cfg = hf_config(model, model.dtype)
    assert model_from_hf_config(json.loads(json.dumps(cfg)), "config.json") == dataclasses.replace(
        model, name=f"hf_{cfg['model_type']}")
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert type(hf).__name__ == cfg["architectures"][0]
    for i, layer in enumerate(hf.model.layers):
        assert hasattr(layer.mlp, "experts") == model.is_moe_layer(i), i
    with torch.device("meta"):
        ours = Transformer(model)
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        if ".mlp.experts." in name or name.startswith("model.mtp."):
            continue
        assert theirs[name] == tuple(p.shape), name


def test_published_configs_import_with_their_parameter_counts():
    """DeepSeek-V3: 671B parameters, 37B activated (the paper's figures, MTP apart); Qwen3-30B-A3B:
    30.5B, 3.3B activated (its model card)."""
    ds = model_from_hf_config(DEEPSEEK_V3_671B, "config.json")
    assert ds.mla.q_lora_rank == 1536 and ds.mtp_layers == 1 and ds.rope_scaling.mscale_all_dim == 1.0
    assert ds.moe.score_function == "sigmoid" and ds.moe.expert_bias and ds.moe.num_groups == 8
    assert round(ds.num_params(mtp=False) / 1e9) == 671 and round(ds.active_params(mtp=False) / 1e9) in (37, 38)
    qwen = model_from_hf_config(QWEN3_30B_A3B, "config.json")
    assert qwen.qk_norm and qwen.moe.num_experts == 128 and qwen.moe.normalize_top_k
    assert round(qwen.num_params() / 1e8) == 305 and round(qwen.active_params() / 1e8) in (33, 34)


@pytest.mark.parametrize("change,match", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"num_key_value_heads": 16}, "num_key_value_heads=16"),
    ({"topk_group": 2}, "topk_group=2"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config='fp8'"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
])
def test_deepseek_config_values_transformers_computes_otherwise_are_refused(change, match):
    with pytest.raises(CheckpointError, match=re.escape(match)):
        model_from_hf_config({**DEEPSEEK_V3_671B, **change}, "config.json")


@pytest.mark.parametrize("change,match", [
    ({"moe": dataclasses.replace(TINY_MTP.moe, score_function="softmax")}, "model.moe.score_function"),
    ({"moe": dataclasses.replace(TINY_MTP.moe, shared_experts=0)}, "model.moe.shared_experts"),
    ({"moe": dataclasses.replace(TINY_MTP.moe, top_k=2, num_groups=4, group_top_k=2)}, "model.moe.group_top_k"),
    ({"mla": None, "mtp_layers": 0}, "model.moe: score_function"),
    ({"norm_eps": 1e-5}, "model.norm_eps: 1e-05 is not 1e-06"),
])
def test_export_refuses_models_no_transformers_class_computes(change, match):
    with pytest.raises(CheckpointError, match=re.escape(match)):
        hf_config(dataclasses.replace(TINY_MTP, **change), "float32")
