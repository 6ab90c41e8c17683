"""The torch MoE layer: logits equal transformers' MixtralForCausalLM, the Hub checkpoint layout
round-trips through export, the router's losses equal a hand computation, and the grouped expert
compute (torch._grouped_mm, or the padded batched matmul) equals the experts run one by one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

from ckpt_helpers import plan_for
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, param_pieces, run_config
from ms_llm.checkpoint.interop.hf import export_hf
from ms_llm.checkpoint.interop.hf_moe import mixtral_names
from ms_llm.cli import main as cli
from ms_llm.config.model import ModelConfig, MoEConfig
from torch_backend.model import Transformer
from torch_backend.moe import Experts, MoE

transformers = pytest.importorskip("transformers")

MIXTRAL = ModelConfig(name="tiny_mixtral", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96, max_seq_len=32, rope_theta=10000.0, norm_eps=1e-6, dtype="float32",
                      moe=MoEConfig(num_experts=4, top_k=2))


def hf_mixtral(cfg: ModelConfig):
    hf_cfg = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(hf_cfg).eval()


def from_hub(hub: dict[str, np.ndarray], model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict from the Hub's tensors, through the name table under test."""
    out = {}
    for name in model.state_dict():
        names = mixtral_names(name, model.cfg.moe.num_experts) or [name]
        arrays = [hub[n] for n in names]
        out[name] = torch.from_numpy(np.stack(arrays) if "experts" in name else arrays[0])
    return out


def test_logits_match_transformers_mixtral(tmp_path):
    hf = hf_mixtral(MIXTRAL)
    hf.save_pretrained(tmp_path / "hub")          # the Hub layout: block_sparse_moe.experts.E.w1.weight, ...
    hub = load_file(str(tmp_path / "hub" / "model.safetensors"))
    ours = Transformer(MIXTRAL).eval()
    ours.load_state_dict(from_hub(hub, ours))
    tokens = torch.randint(0, MIXTRAL.vocab_size, (3, 17))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_hub_mixtral_imports_and_exports_back_bit_equal(tmp_path):
    """`convert-checkpoint --from hf` of a save_pretrained MixtralForCausalLM: the per-expert Hub
    tensors are stacked into ours, the model computes transformers' logits, and exporting the
    import gives back the Hub's tensors bit for bit."""
    hf = hf_mixtral(MIXTRAL)
    hf.save_pretrained(tmp_path / "hub")
    assert cli(["convert-checkpoint", str(tmp_path / "hub"), str(tmp_path / "ckpt"), "--from", "hf"]) == 0
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        model = ckpt.model_config()
        assert model.moe == MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=hf.config.router_aux_loss_coef)
        ours = Transformer(model).eval()
        ours.load_state_dict({n: torch.from_numpy(ckpt.read_full(n)) for n in ours.state_dict()})
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".hf-stacked")]    # staging removed
    tokens = torch.randint(0, MIXTRAL.vocab_size, (3, 17))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
    export_hf(tmp_path / "ckpt", tmp_path / "back")
    hub, back = load_file(str(tmp_path / "hub" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(hub)
    assert all(np.array_equal(back[n], hub[n]) for n in hub)


def test_export_is_the_hub_layout_transformers_loads(tmp_path):
    plan = plan_for({"dp": 2, "ep": 2}, 2, MIXTRAL)
    ref = {n: np.random.default_rng(len(n)).standard_normal(p.shape).astype(np.float32) * 0.05
           for n, p in plan.params.items()}
    for rank in reversed(range(2)):              # each rank writes its own experts
        w = CheckpointWriter(tmp_path / "ckpt", rank, 2)
        items = [SaveItem(p, np.ascontiguousarray(ref[n][tuple(slice(o, o + s) for o, s in
                                                                zip(p.region.offsets, p.region.sizes))]))
                 for n, p in param_pieces(plan, rank).items() if p.primary]
        w.save(1, items, state={"step": 1}, config=run_config(plan, "torch"))
        w.close()
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = Transformer(MIXTRAL).eval()
    ours.load_state_dict({n: torch.from_numpy(a) for n, a in ref.items()})
    tokens = torch.randint(0, MIXTRAL.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def moe_layer(**moe) -> MoE:
    cfg = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=12,
                      dtype="float32", moe=MoEConfig(**{"num_experts": 4, "top_k": 2, **moe}))
    torch.manual_seed(1)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def test_router_losses_equal_a_hand_computation():
    layer = moe_layer(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(2, 5, 8)
    layer(x)
    logits = (x.reshape(-1, 8) @ layer.gate.weight.t()).detach().double().numpy()      # (10, 4)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=1)[:, :2]
    share = np.array([(chosen == e).sum() for e in range(4)]) / chosen.size       # f_e over the 20 copies
    balance = 4 * sum(share[e] * probs[:, e].mean() for e in range(4))
    zl = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    assert layer.last_aux.item() == pytest.approx(0.1 * balance + 0.01 * zl, rel=1e-5)


def test_aux_loss_gradient_reaches_the_router():
    """Backward of the output alone carries d(aux)/d(router) (scaled by aux_scale)."""
    layer = moe_layer(aux_loss_coeff=1.0)
    x = torch.randn(2, 5, 8)
    layer(x).sum().backward()
    with_aux = layer.gate.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coeff = 0.0
    layer(x).sum().backward()
    without = layer.gate.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coeff = 1.0
    probs = torch.softmax(x.reshape(-1, 8) @ layer.gate.weight.t(), -1)
    top = torch.topk(probs, 2).indices
    f = torch.bincount(top.flatten(), minlength=4).float() / top.numel()
    (4 * (f * probs.mean(0)).sum()).backward()
    # The gradients are ~12: their difference carries fp32 rounding of ~12 x 6e-8.
    torch.testing.assert_close(with_aux - without, layer.gate.weight.grad, rtol=1e-5, atol=1e-5)


def test_capacity_drops_the_latest_copies_of_a_full_expert():
    dropless, capped = moe_layer(), moe_layer(capacity_factor=0.5)
    x = torch.randn(1, 8, 8)
    flat = torch.topk(dropless.route(x.reshape(-1, 8))[1], 2).indices.flatten()
    order = torch.argsort(flat, stable=True)
    keep = capped.capacity_mask(flat, order)
    capacity = 2                                  # ceil(0.5 * 16 copies / 4 experts)
    for e in range(4):
        kept = keep[flat[order] == e]
        assert kept.sum() == min(capacity, kept.numel()) and kept[:capacity].all()
    assert not torch.allclose(dropless(x), capped(x))


def loop_experts(experts: Experts, rows: torch.Tensor, counts: list[int], scale: torch.Tensor) -> torch.Tensor:
    """The experts one by one over their rows, outputs times the routing weights: what the grouped
    compute (which scales the activation before down_proj instead) must equal."""
    out = []
    for e, chunk in enumerate(rows.split(counts)):
        h = F.silu(chunk @ experts.gate_proj.weight[e].t()) * (chunk @ experts.up_proj.weight[e].t())
        out.append(h @ experts.down_proj.weight[e].t())
    return (torch.cat(out) if out else rows[:0]) * scale[:, None]


def expert_grads(run, experts: Experts, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Output, then the gradients of rows, routing weights and the three stacked weights, for a
    fixed upstream gradient."""
    rows = rows.detach().requires_grad_()
    scale = torch.rand(rows.shape[0], generator=torch.Generator().manual_seed(2)).to(rows.dtype).requires_grad_()
    out = run(rows, counts, scale)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    weights = [experts.gate_proj.weight, experts.up_proj.weight, experts.down_proj.weight]
    return [out, *torch.autograd.grad(out, [rows, scale, *weights], upstream)]


COUNTS = {"uneven, empty experts": [5, 0, 11, 0], "all rows to one expert": [0, 0, 16, 0], "no rows": [0, 0, 0, 0]}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("hidden, width", [(16, 8), (6, 5)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_grouped_experts_equal_the_loop_forward_and_backward(grouped, hidden, width, counts):
    """torch._grouped_mm and the padded batched matmul (sizes _grouped_mm's 16-byte alignment
    refuses fall back to it) give the loop's outputs and gradients within fp32 rounding: 1e-6 of
    the largest value (1e-6 absolute below 1)."""
    torch.manual_seed(0)
    experts = Experts(len(counts), hidden, width)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    experts.grouped = grouped
    rows = torch.randn(sum(counts), hidden)
    got = expert_grads(experts, experts, rows, counts)
    want = expert_grads(lambda r, c, w: loop_experts(experts, r, c, w), experts, rows, counts)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert g.numel() == 0 or (g - w).abs().max().item() <= 1e-6 * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded_bmm"])
def test_grouped_experts_in_bfloat16_and_under_autocast(grouped):
    """bf16 weights and rows, and fp32 ones under bf16 autocast (which does not cover _grouped_mm):
    a bf16 result equal to the loop's (autocast casts its matmuls the same way)."""
    torch.manual_seed(0)
    counts = [7, 0, 25, 0]
    experts = Experts(4, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    experts.grouped = grouped
    rows = torch.randn(32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = expert_grads(experts, experts, rows, counts)
        want = expert_grads(lambda r, c, w: loop_experts(experts, r, c, w), experts, rows, counts)
    assert got[0].dtype == torch.bfloat16 and [g.dtype for g in got[1:]] == [torch.float32] * 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    experts.bfloat16()
    got = expert_grads(experts, experts, rows.bfloat16(), counts)
    want = expert_grads(lambda r, c, w: loop_experts(experts, r, c, w), experts, rows.bfloat16(), counts)
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_moe_layer_equal_with_grouped_mm_and_padded_bmm():
    """The whole layer (routing, dispatch, combine) through either path: same output and gradients."""
    layer = moe_layer(num_experts=8, top_k=2)
    x = torch.randn(2, 9, 8)
    results = []
    for grouped in (True, False):
        layer.experts.grouped = grouped
        out = layer(x)
        results.append([out, *torch.autograd.grad(out.square().sum(), list(layer.parameters()))])
    for g, p in zip(*results):
        assert (g - p).abs().max().item() <= 1e-6 * max(1.0, p.abs().max().item())
