"""The MindSpore MoE layer equals the torch one: same parameter names and shapes, the same logits
(dropless, and with a capacity that drops copies; shared experts and a leading dense layer), and
the same router-loss gradient."""
import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.step import ScaledLoss
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
], ids=["mixtral", "deepseek", "capacity"])
def test_logits_match_torch(moe):
    cfg = ModelConfig(moe=MoEConfig(**moe), **BASE)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ref.init_weights(3, std=0.2)                     # wide router logits: no near-ties in top-k
    ours.load_numpy({k: v.numpy() for k, v in ref.state_dict().items()})
    assert {n: tuple(p.shape) for n, p in ours.parameters_and_names()} == \
        {n: tuple(p.shape) for n, p in ref.named_parameters()}
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11))
    got = ours(ms.Tensor(tokens, ms.int32)).asnumpy()
    want = ref(torch.from_numpy(tokens)).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4


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
