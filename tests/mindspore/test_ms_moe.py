"""The MindSpore MoE layer equals the torch one: same parameter names and shapes, the same logits
(dropless; a capacity that drops nothing, E / top_k; capacities that drop copies, with softmax or
DeepSeek's routing; shared experts and a leading dense layer; token groups of one data-parallel
rank each, as under semi_auto_parallel), and the same router-loss gradient. The expert FLOPs per
token, counted from the shapes the expert BatchMatMuls are called with and from the lowering's
per-rank layouts under ep, are top_k x capacity_factor expert MLPs, not E (E only when dropless, the
worst-case capacity). A capacity that drops under data parallel on 2 msrun workers, against torchrun,
is in test_ms_deepseek_train, beside the same job's dropless run."""
import dataclasses
import math

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from mindspore import ops as P

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.mindspore.lower import lower
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.moe import set_token_groups
from ms_llm.mindspore.step import ScaledLoss
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan
from torch_backend.model import Transformer as TorchTransformer

BASE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
            max_seq_len=32, dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.mark.parametrize("moe", [
    dict(num_experts=4, top_k=2),
    dict(num_experts=8, top_k=3, expert_ffn_hidden_size=16, shared_experts=2, normalize_top_k=False,
         first_dense_layers=1),
    dict(num_experts=4, top_k=2, capacity_factor=0.5),
    dict(num_experts=4, top_k=2, capacity_factor=2.0),
    dict(num_experts=8, top_k=2, capacity_factor=1.0, score_function="sigmoid", num_groups=4, group_top_k=2,
         expert_bias=True, routed_scaling_factor=2.5, shared_experts=1, expert_ffn_hidden_size=16),
], ids=["mixtral", "deepseek", "capacity", "no_drop", "deepseek_capacity"])
def test_logits_match_torch(moe):
    cfg = ModelConfig(moe=MoEConfig(**moe), **BASE)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ref.init_weights(3, std=0.2)                     # wide router logits: no near-ties in top-k
    ours.load_numpy({k: v.numpy() for k, v in ref.state_dict().items()})
    assert {n: tuple(p.shape) for n, p in ours.parameters_and_names()} == \
        {n: tuple(p.shape) for n, p in ref.state_dict().items()}    # the expert bias: a buffer in torch
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11))
    got = ours(ms.Tensor(tokens, ms.int32)).asnumpy()
    want = ref(torch.from_numpy(tokens)).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4
    if cfg.moe.capacity_factor > 0:     # a capacity that drops changes the logits; one of E / top_k does not
        dropless = TorchTransformer(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=-1.0)))
        dropless.load_state_dict(ref.state_dict())
        moved = np.abs(dropless(torch.from_numpy(tokens)).detach().numpy() - want).max()
        drops = cfg.moe.capacity_factor < cfg.moe.num_experts / cfg.moe.top_k
        assert (moved > 1e-3) if drops else (moved == 0.0), moved


def test_token_groups_match_torch_data_parallel():
    """Two token groups (semi_auto_parallel's layout at dp2: one group per rank) on one device equal
    torch run on each group's rows apart, as two data-parallel ranks run them, with a capacity that drops."""
    cfg = ModelConfig(moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=0.75), **BASE)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ref.init_weights(5, std=0.2)
    ours.load_numpy({k: v.numpy() for k, v in ref.state_dict().items()})
    set_token_groups(ours, 2)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 12))
    got = ours(ms.Tensor(tokens, ms.int32)).asnumpy()
    want = np.concatenate([ref(torch.from_numpy(tokens[i:i + 1])).detach().numpy() for i in range(2)])
    assert np.abs(got - want).max() <= 1e-4
    whole = ref(torch.from_numpy(tokens)).detach().numpy()     # one capacity over both rows drops otherwise
    assert np.abs(whole - want).max() > 1e-3


def _expert_mlps_per_token(cfg: ModelConfig, tokens: np.ndarray, groups: int, monkeypatch) -> float:
    """Expert FLOPs of one forward pass over `tokens`, from the shapes every expert BatchMatMul is called
    with (PyNative), per token, in expert MLPs (3 matmuls of H x F: 6 H F FLOPs)."""
    net = Transformer(cfg)
    net.init_weights(0, std=0.2)
    set_token_groups(net, groups)
    bmms = {id(getattr(layer.mlp.experts, f"bmm_{proj}")) for layer in net.model.layers if layer.is_moe
            for proj in ("gate", "up", "down")}
    flops = []
    call = P.BatchMatMul.__call__

    def record(prim, a, b):
        if id(prim) in bmms:
            out = b.shape[-2] if prim.transpose_b else b.shape[-1]
            flops.append(2 * math.prod(a.shape[:-1]) * a.shape[-1] * out)
        return call(prim, a, b)

    monkeypatch.setattr(P.BatchMatMul, "__call__", record)
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        net(ms.Tensor(tokens, ms.int32))
    finally:
        ms.set_context(mode=mode)
        monkeypatch.undo()
    assert len(flops) == len(bmms)
    layers = sum(layer.is_moe for layer in net.model.layers)
    return sum(flops) / (6 * cfg.hidden_size * cfg.expert_ffn_size * tokens.size * layers)


@pytest.mark.parametrize("factor,groups,want", [(1.0, 1, 2.0), (1.25, 1, 2.5), (1.0, 2, 2.0), (0.5, 1, 1.0),
                                                (-1.0, 1, 8.0)])
def test_expert_flops_per_token_are_top_k_times_capacity_factor(factor, groups, want, monkeypatch):
    """8 experts, top-2, 32 tokens: top_k x capacity_factor expert MLPs per token (2, 2.5; per group at
    2 groups; 1 when the capacity halves them), E = 8 only when dropless (the worst-case capacity, the
    cost of the layer that ran every expert over every token)."""
    cfg = ModelConfig(moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=factor, expert_ffn_hidden_size=16),
                      **BASE)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 16))
    assert _expert_mlps_per_token(cfg, tokens, groups, monkeypatch) == want


@pytest.mark.parametrize("strategy", [{"dp": 4, "ep": 2}, {"dp": 4, "ep": 4}, {"dp": 2, "tp": 2, "ep": 2}])
def test_expert_rows_per_rank_follow_the_capacity_under_ep(strategy):
    """The lowering's own layouts: each rank's slice of the expert BatchMatMul's rows (E/ep experts x its
    edp groups' slots) over the tokens that rank routes is top_k x capacity_factor, not E."""
    cfg = ModelConfig(moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.5, expert_ffn_hidden_size=16), **BASE)
    p = plan(cfg, from_dict(ParallelStrategy, strategy, "strategy"),
             TrainConfig(global_batch_size=8, micro_batch_size=2, seq_len=16))
    ops = {o.op: o for o in lower(p).ops}
    rows = ops["model.layers.0.mlp.experts.bmm_gate"].layouts[0]            # (E, groups * C, H)
    experts, slots, _ = rows.local_shape()
    tokens = math.prod(p.activations["hidden"].local_shape()[:2])          # the tokens each rank routes
    assert experts == 8 // strategy["ep"] and experts * slots / tokens == 2 * 1.5


class SumOfLogits(ms.nn.Cell):
    """sum(logits) + router losses: what torch's AuxLoss backpropagates for sum(logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, tokens):
        logits, aux = self.model.with_aux(tokens)
        return logits.sum() + aux


def test_router_loss_gradient_matches_torch():
    cfg = ModelConfig(moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.5, z_loss_coeff=0.1), **BASE)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ref.init_weights(4, std=0.2)
    ours.load_numpy({k: v.numpy() for k, v in ref.state_dict().items()})
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9))
    ref(torch.from_numpy(tokens)).sum().backward()
    weights = ms.ParameterTuple(ours.trainable_params())
    grads = ms.grad(SumOfLogits(ours), grad_position=None, weights=weights)(ms.Tensor(tokens, ms.int32))
    names = {id(p): n for n, p in ours.parameters_and_names()}
    got = {names[id(p)]: g.asnumpy() for p, g in zip(weights, grads)}
    for name, p in ref.named_parameters():
        if name.endswith("mlp.gate.weight"):
            assert np.abs(got[name] - p.grad.numpy()).max() <= 1e-4, name


def test_router_loss_gradient_scales_with_the_loss():
    """A loss scale multiplies the loss and divides the gradients (step.TrainCell): the router
    losses' share of the router gradient is scaled with it, so the unscaled gradient is the same
    at any scale (float16 training with dynamic loss scaling relies on it)."""
    cfg = ModelConfig(moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.5, z_loss_coeff=0.1), **BASE)
    model = Transformer(cfg)
    model.init_weights(5, std=0.2)
    rows = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 10))
    x, y = ms.Tensor(rows[:, :-1], ms.int32), ms.Tensor(rows[:, 1:], ms.int32)
    weights = ms.ParameterTuple(model.trainable_params())
    grad = ms.grad(ScaledLoss(LossCell(model)), grad_position=None, weights=weights)
    plain, scaled = grad(x, y, ms.Tensor(1.0, ms.float32)), grad(x, y, ms.Tensor(1024.0, ms.float32))
    for p, g, h in zip(weights, plain, scaled):
        if p.name.endswith("mlp.gate.weight"):
            assert np.abs(g.asnumpy() - h.asnumpy() / 1024).max() <= 1e-6 * np.abs(g.asnumpy()).max(), p.name
