"""The MindSpore DeepSeek-V3-class and Qwen3-MoE models (fp32, tiny random weights, world 1 on CPU):

- equal transformers' DeepseekV3ForCausalLM and Qwen3MoeForCausalLM within 1e-4 on logits and the
  gradient of every parameter: multi-latent attention with and without the low-rank query,
  interleaved and rotate_half rotary, YaRN's softmax scale (mscale_all_dim); sigmoid routing with
  group-limited top-k, routed_scaling_factor and a nonzero expert bias; Qwen3-MoE's q/k norms,
  norm_topk_prob and mlp_only_layers;
- the MTP loss and its gradients equal DeepSeek-V3 eq. 21-25 written out over transformers' layers;
- the router losses (sequence-wise, Switch over normalised sigmoid scores) and loads equal numpy;
- the aux-loss-free bias update in the compiled step rebalances a skewed router, and a worker
  resumed from a checkpoint repeats the run with the same biases;
- the whole model equals the torch backend's from the same ms_llm.init seed.
Run with -s for the max abs differences and the loads per step."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ms_llm.checkpoint import Checkpoint
from ms_llm.config.model import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from ms_llm.config.train import OptimizerConfig
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.moe import ExpertBiasUpdate, MoE
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.step import TrainCell

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
        hf = DeepseekV3Config(**common, num_key_value_heads=cfg.num_heads, n_routed_experts=m.num_experts,
                              n_shared_experts=m.shared_experts, routed_scaling_factor=m.routed_scaling_factor,
                              kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank,
                              qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                              qk_nope_head_dim=a.qk_nope_head_dim, n_group=m.num_groups, topk_group=m.group_top_k,
                              first_k_dense_replace=m.first_dense_layers, rope_interleave=a.rope_interleave,
                              rope_parameters=rope, num_mtp_layers=0)
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


class LossAndOutputs(ms.nn.Cell):
    """The training loss (LossCell), then the logits and the cross-entropy alone as auxiliary outputs:
    one compiled graph where three cost three compiles (the values are the separate graphs', bit for bit)."""

    def __init__(self, net: Transformer):
        super().__init__()
        self.net, self.loss, self.main = net, LossCell(net), LossCell(net, training=False)

    def construct(self, x, y):
        return self.loss(x, y), self.net(x), self.main(x, y)


def ms_loss_logits_grads(net: Transformer, tokens: np.ndarray) -> tuple[float, np.ndarray, float, dict]:
    """The training loss of tokens[:, :-1] against tokens[:, 1:], their logits, the cross-entropy
    alone, and the training loss's gradients by parameter name."""
    x, y = ms.Tensor(tokens[:, :-1], ms.int32), ms.Tensor(tokens[:, 1:], ms.int32)
    weights = ms.ParameterTuple(net.trainable_params())
    (loss, logits, main), grads = ms.value_and_grad(LossAndOutputs(net), None, weights, has_aux=True)(x, y)
    names = {id(p): n for n, p in net.parameters_and_names()}
    return (float(loss.asnumpy()), logits.asnumpy(), float(main.asnumpy()),
            {names[id(p)]: g.asnumpy() for p, g in zip(weights, grads)})


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
    _, logits, _, grads = ms_loss_logits_grads(ours, tokens)
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


# ---- multi-token prediction: against DeepSeek-V3 eq. 21-25 written out over transformers' layers ----
MTP_CFG = ModelConfig(mla=MLAConfig(q_lora_rank=24, **MLA), mtp_layers=2, mtp_loss_factor=0.3,
                      moe=MoEConfig(num_experts=16, num_groups=4, group_top_k=2, **DEEPSEEK_MOE), **BASE)


class TorchMTP(torch.nn.Module):
    """One MTP depth from the spec's names: enorm, hnorm, eh_proj, a transformers decoder layer, norm."""

    def __init__(self, hf_config, cfg: ModelConfig, layer: int):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        h = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = (DeepseekV3RMSNorm(h, cfg.norm_eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(hf_config, layer)


def reference_loss(ref, mtp, tokens: np.ndarray, cfg: ModelConfig) -> torch.Tensor:
    """Main cross-entropy + mtp_loss_factor x the mean over depths k of eq. 21-25: h'_k =
    eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]) (embedding first, as Megatron and DeepSeek's
    checkpoint), h_k = layer(h'_k), logits_k = lm_head(norm(h_k)), trained on t_{i+1+k} where it exists."""
    t = torch.from_numpy(tokens)
    inputs, labels = t[:, :-1], t[:, 1:]
    n = inputs.shape[1]
    hidden = ref.model(inputs, use_cache=False).last_hidden_state               # h_0: after model.norm
    loss = F.cross_entropy(ref.lm_head(hidden).flatten(0, 1), labels.flatten())
    embedded = ref.model.embed_tokens(inputs)
    rotary = ref.model.rotary_emb(hidden, torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    depths = []
    for k, m in enumerate(mtp, start=1):
        e = torch.cat([embedded[:, k:], torch.zeros_like(embedded[:, :k])], dim=1)     # Emb(t_{i+k}), 0 past T
        hidden = m.layer(m.eh_proj(torch.cat([m.enorm(e), m.hnorm(hidden)], dim=-1)), attention_mask=mask,
                         position_embeddings=rotary)
        logits = ref.lm_head(m.norm(hidden))
        depths.append(F.cross_entropy(logits[:, :n - k].flatten(0, 1), labels[:, k:].flatten()))
    return loss + cfg.mtp_loss_factor * torch.stack(depths).mean()


def test_mtp_loss_and_gradients_match_eq_21_25():
    cfg = MTP_CFG
    ref = hf_model(cfg)
    mtp = torch.nn.ModuleList([TorchMTP(ref.config, cfg, cfg.num_layers + d) for d in range(cfg.mtp_layers)])
    randomize(ref, seed=1)
    randomize(mtp, seed=2)
    state = {**{k: v.numpy() for k, v in ref.state_dict().items()},
             **{f"model.mtp.{k}": v.numpy() for k, v in mtp.state_dict().items()}}
    ours = Transformer(cfg)
    state = ours_from_hf(state, cfg)
    assert {n: tuple(p.shape) for n, p in ours.parameters_and_names()} == {n: v.shape for n, v in state.items()}
    ours.load_numpy(state)
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, cfg.max_seq_len + 1))

    loss, _, main_only, grads = ms_loss_logits_grads(ours, tokens)

    want = reference_loss(ref, mtp, tokens, cfg)
    want.backward()
    want_grads = ours_from_hf({**{n: p.grad.numpy() for n, p in ref.named_parameters()},
                               **{f"model.mtp.{n}": p.grad.numpy() for n, p in mtp.named_parameters()}}, cfg)
    loss_diff = abs(loss - want.item())
    grad_diff, worst = max_diff(grads, want_grads)
    print(f"mtp: loss {loss:.6f} (main alone {main_only:.6f}), max |loss - eq. 21-25| "
          f"{loss_diff:.2e}, max |grad| diff {grad_diff:.2e} ({worst})")
    assert loss_diff <= TOL and grad_diff <= TOL
    assert loss - main_only > 0.1                                  # the MTP loss is in the training loss
    assert all(np.abs(g).max() > 1e-4 for n, g in grads.items() if n.startswith("model.mtp.") and "experts" not in n)


# ---- the router's losses and loads, against numpy ----
class RouteOutputs(ms.nn.Cell):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def construct(self, x):
        _, losses, load = self.moe.route(x)
        return losses, load


def numpy_route(x: np.ndarray, w: np.ndarray, bias: np.ndarray, m: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """(chosen experts (B, T, k), normalised scores s' (B, T, E)): sigmoid scores, the choice with
    the bias, groups scored by their best top_k / group_top_k choices, the best group_top_k kept."""
    scores = 1.0 / (1.0 + np.exp(-(x @ w.T).astype(np.float64)))
    choice = scores + bias
    b, t, e = choice.shape
    grouped = choice.reshape(b, t, m.num_groups, e // m.num_groups)
    group_score = np.sort(grouped, -1)[..., -(m.top_k // m.group_top_k):].sum(-1)
    dropped = np.argsort(-group_score, -1)[..., m.group_top_k:]
    masked = grouped.copy()
    np.put_along_axis(masked, dropped[..., None].repeat(e // m.num_groups, -1), -np.inf, axis=2)
    top = np.argsort(-masked.reshape(b, t, e), -1)[..., :m.top_k]
    return top, scores / scores.sum(-1, keepdims=True)


def test_sequence_aux_loss_and_loads_match_numpy():
    """DeepSeek-V3 eq. 17-20 per sequence, Switch's loss over s' and the copies per expert."""
    moe = MoEConfig(num_experts=16, num_groups=4, group_top_k=2, top_k=4, expert_ffn_hidden_size=8,
                    score_function="sigmoid", expert_bias=True, aux_loss_coeff=0.3, seq_aux_loss_coeff=0.7)
    cfg = ModelConfig(moe=moe, **BASE)
    layer = MoE(cfg)
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.3, (16, cfg.hidden_size)).astype(np.float32)
    bias = rng.normal(0, 0.3, 16).astype(np.float32)
    layer.gate.weight.set_data(ms.Tensor(w))
    layer.gate.e_score_correction_bias.set_data(ms.Tensor(bias))
    x = rng.normal(0, 1, (3, 10, cfg.hidden_size)).astype(np.float32)
    losses, load = (v.asnumpy() for v in RouteOutputs(layer)(ms.Tensor(x)))

    top, probs = numpy_route(x, w, bias, moe)
    counts = np.stack([np.bincount(top[i].ravel(), minlength=16) for i in range(3)])          # (B, E)
    e, k, t = 16, moe.top_k, x.shape[1]
    seq = (e / (k * t) * counts * probs.mean(1)).sum(-1).mean()
    switch = e * (counts.sum(0) / counts.sum() * probs.reshape(-1, e).mean(0)).sum()
    want = moe.seq_aux_loss_coeff * seq + moe.aux_loss_coeff * switch
    print(f"router losses {float(losses):.6f} vs numpy {want:.6f}; loads {load.astype(int).tolist()}")
    assert abs(float(losses) - want) <= 1e-5
    np.testing.assert_array_equal(load, counts.sum(0))


# ---- aux-loss-free balancing in the compiled training step ----
def skewed_training(rate: float, steps: int = 20) -> tuple[list[float], list[np.ndarray], np.ndarray]:
    """A tiny sigmoid-routed model whose hidden states share a direction u that the routers of
    experts 0 and 1 lean along, so they take most tokens; AdamW at lr 1e-3 with the bias update
    at `rate`. Returns max/mean expert load per step, the biases after each step and the
    first step's loads."""
    moe = MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=8, score_function="sigmoid", expert_bias=True,
                    bias_update_rate=rate, aux_loss_coeff=0.0)
    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=32,
                      max_seq_len=16, dtype="float32", moe=moe)
    net = Transformer(cfg)
    net.init_weights(3)
    rng = np.random.default_rng(0)
    u = rng.normal(size=16).astype(np.float32)
    u /= np.linalg.norm(u)
    skew = np.where(np.arange(8)[:, None] < 2, u, 0.0)
    embed = net.model.embed_tokens.weight
    embed.set_data(ms.Tensor(embed.asnumpy() + 0.05 * u))
    net.model.layers[0].mlp.gate.weight.set_data(ms.Tensor((rng.normal(0, 0.3, (8, 16)) + skew).astype(np.float32)))
    loss_cell = LossCell(net, loads=True)
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0)
    step = TrainCell(loss_cell, AdamW(loss_cell.trainable_params(), opt), 1, opt.grad_clip,
                     expert_bias=ExpertBiasUpdate(net.expert_biases(), rate))
    ratios, biases, first = [], [], None
    for _ in range(steps):
        rows = rng.integers(0, cfg.vocab_size, (1, 4, 17))
        _, _, loads = step(ms.Tensor(rows[..., :-1], ms.int32), ms.Tensor(rows[..., 1:], ms.int32),
                           ms.Tensor(1.0, ms.float32), ms.Tensor(opt.lr, ms.float32))
        loads = loads.asnumpy()[0]
        first = loads if first is None else first
        ratios.append(float(loads.max() / loads.mean()))
        biases.append(net.expert_biases()[0].asnumpy().copy())
    print(f"bias_update_rate {rate}: max/mean expert load per step " + " ".join(f"{r:.2f}" for r in ratios))
    return ratios, biases, first


def test_expert_bias_update_balances_the_load():
    ratios, biases, loads = skewed_training(rate=0.02)
    # The first update: exactly rate x sign(mean load - load), in fp32, from a zero bias.
    np.testing.assert_array_equal(biases[0], np.float32(0.02) * np.sign(loads.mean() - loads).astype(np.float32))
    start = np.mean(ratios[:3])
    assert start > 2.5                                           # the skew: two experts take most copies
    assert np.mean(ratios[-5:]) < 0.6 * start
    still, unmoved, _ = skewed_training(rate=0.0)
    assert np.mean(still[-5:]) > 0.9 * np.mean(still[:3])       # AdamW alone does not rebalance in 20 steps
    assert not np.any(unmoved[-1])


# ---- the trainer: the expert biases are checkpointed and a resume repeats the run exactly ----
@pytest.mark.slow
def test_resume_restores_the_expert_biases_exactly(tmp_path):
    """ms_llm.mindspore.worker at world 1, a tiny DeepSeek (MLA, sigmoid groups with the expert
    bias, MTP), 2 micro-batches a step, a checkpoint every 3 steps: started again from step 3
    it repeats steps 4-6 and ends with the same biases, bit for bit."""
    from test_ms_worker import run_worker

    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 96, 20_000, dtype=np.uint16).tofile(tokens)
    model = {"vocab_size": 96, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 48,
             "max_seq_len": 16, "norm_eps": 1e-6, "dtype": "float32", "mtp_layers": 1,
             "mla": {"q_lora_rank": 24, **MLA},
             "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 8, "shared_experts": 1,
                     "first_dense_layers": 1, "score_function": "sigmoid", "num_groups": 4, "group_top_k": 2,
                     "expert_bias": True, "bias_update_rate": 0.05, "aux_loss_coeff": 0.0,
                     "seq_aux_loss_coeff": 0.01}}
    job = {"name": "tiny_ms_deepseek", "backend": "mindspore", "device": "cpu", "model": model,
           "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 6, "seed": 7,
                     "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0},
                     "data": {"source": str(tokens)}, "checkpoint": {"interval": 3}}}
    full = run_worker(tmp_path / "full", job)
    job["train"]["checkpoint"] = {"interval": 3, "load": str(tmp_path / "full" / "checkpoints" / "step_00000003")}
    resumed = run_worker(tmp_path / "resumed", job)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]

    names = ["model.layers.1.mlp.gate.e_score_correction_bias", "model.mtp.0.layer.mlp.gate.e_score_correction_bias"]
    at = {run: Checkpoint.open(tmp_path / run / "checkpoints" / "step_00000006") for run in ("full", "resumed")}
    mid = Checkpoint.open(tmp_path / "full" / "checkpoints" / "step_00000003")
    for name in names:
        end = at["full"].read_full(name)
        print(f"{name}: step 3 {mid.read_full(name)}, step 6 {end}")
        np.testing.assert_array_equal(at["resumed"].read_full(name), end)
        assert np.abs(end - mid.read_full(name)).max() > 0.04          # moved after the checkpoint too


# ---- the torch backend's model, same seed ----
def test_matches_the_torch_model_with_mtp_and_router_losses():
    """ms_llm.init gives both backends the same weights; with the same random expert biases, the
    Switch, z- and sequence-wise losses and two MTP depths, the training loss, the logits and every
    gradient agree within 1e-4."""
    from torch_backend.model import Transformer as TorchTransformer
    from torch_backend.moe import MoE as TorchMoE

    moe = MoEConfig(num_experts=16, num_groups=4, group_top_k=2, **{**DEEPSEEK_MOE, "aux_loss_coeff": 0.01},
                    z_loss_coeff=1e-3, seq_aux_loss_coeff=0.01)
    cfg = ModelConfig(mla=MLAConfig(q_lora_rank=24, **MLA), moe=moe, mtp_layers=2, **BASE)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ours.init_weights(5, std=0.2)
    ref.init_weights(5, std=0.2)
    rng = np.random.default_rng(6)
    for name, bias in ref.named_buffers():
        if name.endswith("e_score_correction_bias"):
            value = rng.normal(0, 0.3, bias.shape).astype(np.float32)
            bias.copy_(torch.from_numpy(value))
            dict(ours.parameters_and_names())[name].set_data(ms.Tensor(value))
    tokens = rng.integers(0, cfg.vocab_size, (2, cfg.max_seq_len + 1))

    loss, logits, _, grads = ms_loss_logits_grads(ours, tokens)

    t = torch.from_numpy(tokens)
    want_logits = ref(t[:, :-1], targets=t[:, 1:])
    F.cross_entropy(want_logits.flatten(0, 1), t[:, 1:].flatten()).backward()     # + aux and MTP losses, in backward
    routers = [m for m in ref.modules() if isinstance(m, TorchMoE)]
    want_loss = (F.cross_entropy(want_logits.flatten(0, 1), t[:, 1:].flatten()).item()
                 + sum(m.take_aux(1).item() for m in routers) + ref.model.mtp.take_aux(1).item())
    want_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    logit_diff = float(np.abs(logits - want_logits.detach().numpy()).max())
    grad_diff, worst = max_diff(grads, want_grads)
    loss_diff = abs(loss - want_loss)
    print(f"torch model: loss {want_loss:.6f}, max |loss| diff {loss_diff:.2e}, |logits| {logit_diff:.2e}, "
          f"|grad| {grad_diff:.2e} ({worst})")
    assert loss_diff <= TOL and logit_diff <= TOL and grad_diff <= TOL
