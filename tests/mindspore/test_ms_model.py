"""The MindSpore LLaMA equals the torch backend's: same weights -> same logits, and the same
AdamW (with clipping and micro-batch accumulation) -> the same loss after a step."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import OptimizerConfig
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.step import TrainCell
from model_families import FAMILIES, family_config
from torch_backend.model import Transformer as TorchTransformer

CFG = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=160, max_seq_len=32,
           dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


def _pair(cfg, seed=5):
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    ours.init_weights(seed)
    ref.init_weights(seed)
    return ours, ref


@pytest.mark.parametrize("kv_heads,tied", [(2, False), (4, True)])
def test_logits_match_torch(kv_heads, tied):
    cfg = ModelConfig(num_kv_heads=kv_heads, tie_embeddings=tied, **CFG)
    ours, ref = _pair(cfg)
    assert {n for n, _ in ours.parameters_and_names()} >= {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert tuple(p.shape) == tuple(dict(ours.parameters_and_names())[name].shape), name
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 17))
    got = ours(ms.Tensor(tokens, ms.int32)).asnumpy()
    want = ref(torch.from_numpy(tokens)).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_match_torch(family):
    """Rope scaling, q/k/v biases, q/k norms and head_dim apart from hidden / heads: the same logits
    as the torch model (which equals transformers, tests/torch/test_torch_model.py), biases and norm
    weights randomised so each one counts."""
    cfg = family_config(family)
    ours, ref = _pair(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    assert {n for n, _ in ours.parameters_and_names()} == set(state)
    ours.load_numpy(state)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, cfg.max_seq_len))
    got = ours(ms.Tensor(tokens, ms.int32)).asnumpy()
    want = ref(torch.from_numpy(tokens)).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4


def test_weights_load_from_a_torch_state_dict():
    cfg = ModelConfig(num_kv_heads=2, **CFG)
    ours, ref = _pair(cfg, seed=1)
    ref.init_weights(9)
    ours.load_numpy({k: v.numpy() for k, v in ref.state_dict().items()})
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9))
    diff = np.abs(ours(ms.Tensor(tokens, ms.int32)).asnumpy() - ref(torch.from_numpy(tokens)).detach().numpy())
    assert diff.max() <= 1e-4


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_one_adamw_step_gives_the_same_next_loss(micro_batches):
    cfg = ModelConfig(num_kv_heads=2, **CFG)
    opt_cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    ours, ref = _pair(cfg)
    loss_cell = LossCell(ours)
    optimizer = AdamW(loss_cell.trainable_params(), opt_cfg)
    step = TrainCell(loss_cell, optimizer, micro_batches, opt_cfg.grad_clip)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                                  eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    rng = np.random.default_rng(0)
    batch, after = rng.integers(0, cfg.vocab_size, (2, micro_batches, 2, 17))
    x = after.reshape(-1, 17)
    before = loss_cell(ms.Tensor(x[:, :-1], ms.int32), ms.Tensor(x[:, 1:], ms.int32)).asnumpy()

    loss, norm = step(ms.Tensor(batch[:, :, :-1], ms.int32), ms.Tensor(batch[:, :, 1:], ms.int32),
                      ms.Tensor(1.0, ms.float32), ms.Tensor(opt_cfg.lr, ms.float32))
    torch_loss = 0.0
    for mb in torch.from_numpy(batch):
        part = F.cross_entropy(ref(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten()) / micro_batches
        part.backward()
        torch_loss += part.item()
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), opt_cfg.grad_clip).item()
    torch_opt.step()
    assert abs(loss.asnumpy() - torch_loss) <= 1e-5
    assert abs(norm.asnumpy() - torch_norm) <= 1e-5 * torch_norm
    assert torch_norm > opt_cfg.grad_clip                     # the clip was active

    next_ours = loss_cell(ms.Tensor(x[:, :-1], ms.int32), ms.Tensor(x[:, 1:], ms.int32)).asnumpy()
    with torch.no_grad():
        xt = torch.from_numpy(x)
        next_ref = F.cross_entropy(ref(xt[:, :-1]).flatten(0, 1), xt[:, 1:].flatten()).item()
    assert abs(next_ours - next_ref) <= 1e-5
    assert abs(next_ours - before) > 1e-3                    # the step moved the weights
