"""The torch DeepSeek-V3 and Qwen3-MoE models equal transformers' DeepseekV3ForCausalLM and
Qwen3MoeForCausalLM (fp32, tiny random weights): logits and the gradient of every parameter within
1e-5. Weights go transformers -> save_pretrained -> `ms-llm convert-checkpoint --from hf` -> ours,
so the import is checked too. Run with -s for the table of max abs differences."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ms_llm.checkpoint import Checkpoint
from ms_llm.cli import main as cli
from torch_backend.model import Transformer

transformers = pytest.importorskip("transformers")

TOL = 1e-5
DEEPSEEK = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, num_experts_per_tok=4, first_k_dense_replace=1,
                max_position_embeddings=32, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.707, "mscale_all_dim": 1.0}
QWEN3_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=32, rms_norm_eps=1e-6, router_aux_loss_coef=0.0)   # no aux loss in the grads
CASES = {
    # q through the low-rank path, 4 groups of 2 (2 of them kept), interleaved rotary pairs
    "deepseek_v3-q_lora-groups": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": 24, "n_group": 4, "topk_group": 2}),
    # q_proj straight from the hidden state, one group, rotate_half rotary
    "deepseek_v3-q_proj": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1,
                                           "rope_interleave": False}),
    # YaRN with DeepSeek's mscale / mscale_all_dim: cos/sin factor and softmax scale
    "deepseek_v3-yarn": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": 24, "n_group": 2, "topk_group": 1,
                                         "num_experts_per_tok": 2, "rope_parameters": YARN}),
    "qwen3_moe-norm_topk-mlp_only": ("Qwen3Moe", {**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-sparse_step2": ("Qwen3Moe", {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2}),
}


def hf_model(family: str, kwargs: dict):
    """transformers' model with weights spread enough that routing and every norm matter, and
    DeepSeek's expert bias set to random values that change which experts are chosen."""
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(**kwargs)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf


def imported(hf, tmp_path) -> Transformer:
    """Ours, from transformers' save_pretrained folder through the HF import."""
    hf.save_pretrained(tmp_path / "hub")
    assert cli(["convert-checkpoint", str(tmp_path / "hub"), str(tmp_path / "ckpt"), "--from", "hf"]) == 0
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        ours = Transformer(ckpt.model_config())
        state = ours.state_dict()
        assert set(state) <= set(ckpt.names()), sorted(set(state) - set(ckpt.names()))
        ours.load_state_dict({n: torch.from_numpy(ckpt.read_full(n)) for n in state})
    return ours


def hf_grad(hf_params: dict, name: str) -> torch.Tensor:
    """transformers' gradient of our parameter `name` (its fused gate_up_proj split into gate and up)."""
    if ".mlp.experts." not in name:
        return hf_params[name].grad
    prefix, proj = name.rsplit(".mlp.experts.", 1)
    if proj == "down_proj.weight":
        return hf_params[f"{prefix}.mlp.experts.down_proj"].grad
    gate, up = hf_params[f"{prefix}.mlp.experts.gate_up_proj"].grad.chunk(2, dim=1)
    return gate if proj == "gate_proj.weight" else up


def bias_changes_routing(ours: Transformer, tokens: torch.Tensor) -> bool:
    """Whether some MoE layer picks other experts than it would without its expert bias."""
    changed = []

    def hook(moe, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        with_bias = moe.route(x)[3].sort(-1).values
        saved = moe.expert_bias.clone()
        moe.expert_bias.zero_()
        changed.append(not torch.equal(with_bias, moe.route(x)[3].sort(-1).values))
        moe.expert_bias.copy_(saved)

    handles = [m.register_forward_pre_hook(hook) for m in ours.modules() if hasattr(m, "expert_bias")]
    with torch.no_grad():
        ours(tokens)
    for h in handles:
        h.remove()
    return any(changed)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_grads_match_transformers(tmp_path, case):
    family, kwargs = CASES[case]
    hf = hf_model(family, kwargs)
    ours = imported(hf, tmp_path)
    tokens = torch.randint(0, kwargs["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, kwargs["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    if family == "DeepseekV3":
        assert bias_changes_routing(ours, tokens)
    logits, want = ours(tokens), hf(tokens).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()
    logit_diff = (logits - want).abs().max().item()
    hf_params = dict(hf.named_parameters())
    grad_diffs = {n: (p.grad - hf_grad(hf_params, n)).abs().max().item() for n, p in ours.named_parameters()}
    grad_diff = max(grad_diffs.values())
    print(f"\n{case} | transformers {family}ForCausalLM | max abs diff logits {logit_diff:.2e} / grads {grad_diff:.2e}")
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diffs)
    assert len(grad_diffs) == len(hf_params) + sum(".gate_up_proj" in n for n in hf_params)   # every one compared
    assert all(np.isfinite(list(grad_diffs.values())))
