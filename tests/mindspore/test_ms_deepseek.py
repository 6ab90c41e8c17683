"""The MindSpore DeepSeek-V3-class and Qwen3-MoE models equal transformers' DeepseekV3ForCausalLM and
Qwen3MoeForCausalLM (fp32, tiny random weights, world 1 on CPU): logits and the gradient of every
parameter of the cross-entropy within 1e-4. Multi-latent attention with and without the low-rank
query, interleaved and rotate_half rotary, YaRN's softmax scale (mscale_all_dim); sigmoid routing
with group-limited top-k, routed_scaling_factor and a nonzero expert bias; Qwen3-MoE's q/k norms,
norm_topk_prob and mlp_only_layers."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ms_llm.config.model import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from ms_llm.mindspore.model import LossCell, Transformer

BASE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48, max_seq_len=16,
            norm_eps=1e-6, dtype="float32")
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
DEEPSEEK_MOE = dict(top_k=4, expert_ffn_hidden_size=8, shared_experts=1, first_dense_layers=1,
                    score_function="sigmoid", routed_scaling_factor=2.5, aux_loss_coeff=0.0, expert_bias=True)
CASES = {
    # 16 experts in 4 groups, the best 2 groups kept: 8 candidates for top 4 (transformers scores a
    # group by its best 2, top_k / group_top_k here).
    "deepseek-q-lora-groups": ModelConfig(mla=MLAConfig(q_lora_rank=24, **MLA),
                                          moe=MoEConfig(num_experts=16, num_groups=4, group_top_k=2, **DEEPSEEK_MOE),
                                          **BASE),
    "deepseek-q-proj-yarn": ModelConfig(mla=MLAConfig(q_lora_rank=None, rope_interleave=False, **MLA),
                                        moe=MoEConfig(num_experts=8, **DEEPSEEK_MOE),
                                        rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_seq_len=4,
                                                                 mscale=1.0, mscale_all_dim=0.8), **BASE),
    "qwen3-moe": ModelConfig(**{**BASE, "num_layers": 3}, num_kv_heads=2, head_dim=12, qk_norm=True, rope_theta=1e6,
                             moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=16, dense_layers=(1,),
                                           aux_loss_coeff=0.0)),
}
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """transformers' model of the same shape, eager attention, fp32."""
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                  moe_intermediate_size=cfg.expert_ffn_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_experts_per_tok=cfg.moe.top_k,
                  norm_topk_prob=cfg.moe.normalize_top_k, rms_norm_eps=cfg.norm_eps,
                  max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False)
    rope = {"rope_type": cfg.rope_scaling.type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.type == "yarn":
        r = cfg.rope_scaling
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_seq_len, mscale=r.mscale,
                    mscale_all_dim=r.mscale_all_dim, beta_fast=r.beta_fast, beta_slow=r.beta_slow)
    if cfg.mla is not None:
        a, m = cfg.mla, cfg.moe
        hf = DeepseekV3Config(**common, num_key_value_heads=cfg.num_heads, n_routed_experts=m.num_experts, n_shared_experts=m.shared_experts,
                              routed_scaling_factor=m.routed_scaling_factor, kv_lora_rank=a.kv_lora_rank,
                              q_lora_rank=a.q_lora_rank, qk_rope_head_dim=a.qk_rope_head_dim,
                              v_head_dim=a.v_head_dim, qk_nope_head_dim=a.qk_nope_head_dim, n_group=m.num_groups,
                              topk_group=m.group_top_k, first_k_dense_replace=m.first_dense_layers,
                              rope_interleave=a.rope_interleave, rope_parameters=rope, num_mtp_layers=0)
        model = DeepseekV3ForCausalLM(hf)
    else:
        hf = Qwen3MoeConfig(**common, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            num_experts=cfg.moe.num_experts, decoder_sparse_step=cfg.moe.layer_freq,
                            mlp_only_layers=list(cfg.moe.dense_layers), rope_parameters=rope)
        model = Qwen3MoeForCausalLM(hf)
    model.config._attn_implementation = "eager"
    return model.float()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights wide enough that routing has no near-ties, norm weights around 1 and the expert
    biases about as wide as the sigmoid scores' spread, so each one counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point() and "rotary" not in name:
                t.copy_((0.3 if name.endswith("gate.weight") else 0.1) * torch.randn(t.shape, generator=gen))


def ours_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """transformers 5's names -> ours: fused experts gate_up_proj (E, 2F, H) -> gate / up (E, F, H)."""
    out, f = {}, cfg.expert_ffn_size
    for name, value in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name[:-len("gate_up_proj")]
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = value[:, :f], value[:, f:]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = value
        else:
            out[name] = value
    return out


def ms_logits_and_grads(net: Transformer, tokens: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Logits of tokens[:, :-1] and the gradients of their mean cross-entropy against tokens[:, 1:]."""
    x, y = ms.Tensor(tokens[:, :-1], ms.int32), ms.Tensor(tokens[:, 1:], ms.int32)
    weights = ms.ParameterTuple(net.trainable_params())
    _, grads = ms.value_and_grad(LossCell(net), None, weights)(x, y)
    names = {id(p): n for n, p in net.parameters_and_names()}
    return net(x).asnumpy(), {names[id(p)]: g.asnumpy() for p, g in zip(weights, grads)}


def torch_logits_and_grads(model: torch.nn.Module, tokens: np.ndarray, cfg: ModelConfig):
    t = torch.from_numpy(tokens)
    model.zero_grad()
    logits = model(t[:, :-1], use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten()).backward()
    grads = ours_from_hf({n: p.grad.numpy() for n, p in model.named_parameters()}, cfg)
    return logits.detach().numpy(), grads


def max_diff(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    assert set(got) == set(want)
    return max((float(np.abs(got[n] - want[n]).max()), n) for n in want)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(name, cfg, our model, transformers' model, tokens), the weights transformers' random ones."""
    cfg = CASES[request.param]
    ref = hf_model(cfg)
    randomize(ref, seed=len(request.param))
    ours = Transformer(cfg)
    state = ours_from_hf({k: v.numpy() for k, v in ref.state_dict().items()}, cfg)
    assert {n: tuple(p.shape) for n, p in ours.parameters_and_names()} == {n: v.shape for n, v in state.items()}
    ours.load_numpy(state)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, cfg.max_seq_len + 1))
    return request.param, cfg, ours, ref, tokens


def test_logits_and_gradients_match_transformers(case):
    name, cfg, ours, ref, tokens = case
    logits, grads = ms_logits_and_grads(ours, tokens)
    want_logits, want_grads = torch_logits_and_grads(ref, tokens, cfg)
    logit_diff = float(np.abs(logits - want_logits).max())
    grad_diff, worst = max_diff(grads, want_grads)
    print(f"{name}: max |logits - transformers| {logit_diff:.2e}, max |grad - transformers| {grad_diff:.2e} ({worst})")
    assert logit_diff <= TOL
    assert grad_diff <= TOL
    routers = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert routers and all(np.abs(grads[n]).max() > 1e-3 for n in routers)       # routing is trained through
    if cfg.moe.expert_bias:          # the bias both models use steers the choice: without it, other logits
        biases = {n: b.clone() for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias")}
        with torch.no_grad():
            for n in biases:
                ref.get_buffer(n).zero_()
            unbiased = ref(torch.from_numpy(tokens[:, :-1]), use_cache=False).logits.numpy()
            for n, b in biases.items():
                ref.get_buffer(n).copy_(b)
        assert np.abs(unbiased - want_logits).max() > 1e-2
