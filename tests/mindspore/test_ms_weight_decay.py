"""train.optimizer.weight_decay_1d false on MindSpore: the compiled step (TrainCell + AdamW, what
semi_auto_parallel compiles on Ascend) and the shared ZeRO engine's update equal torch.optim.AdamW
with Megatron-LM's param groups (no decay on biases and 1-D parameters) within 1e-5."""
import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import OptimizerConfig
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.step import TrainCell
from ms_llm.mindspore.zero import MsOps
from ms_llm.zero.protocol import SGD, AdamW as AdamWHyper
from torch_backend.model import Transformer as TorchTransformer
from torch_backend.zero.ops import TorchOps

from decay_reference import MICRO, MODEL, OPT, batches, train, worst

CFG = ModelConfig(**MODEL)
OPTIM = OptimizerConfig(**OPT)


def _graph_step(cfg: OptimizerConfig, seed: int = 5) -> tuple[dict[str, np.ndarray], list[float]]:
    ms.set_context(mode=ms.GRAPH_MODE)
    net = Transformer(CFG)
    net.init_weights(seed)
    loss_cell = LossCell(net)
    step = TrainCell(loss_cell, AdamW(loss_cell.trainable_params(), cfg), MICRO, cfg.grad_clip)
    losses = []
    for rows in batches(CFG.vocab_size):
        micro = rows.reshape(MICRO, -1, rows.shape[-1]).astype(np.int32)
        loss, _ = step(ms.Tensor(micro[:, :, :-1]), ms.Tensor(micro[:, :, 1:]), ms.Tensor(1.0, ms.float32),
                       ms.Tensor(cfg.lr, ms.float32))
        losses.append(float(loss.asnumpy()))
    return {n: p.asnumpy() for n, p in net.parameters_and_names()}, losses


def _reference(exempt: bool) -> tuple[TorchTransformer, list[float]]:
    ref = TorchTransformer(CFG)
    ref.init_weights(5)
    return ref, train(ref, batches(CFG.vocab_size), MICRO, OPTIM, exempt)


def test_graph_step_exempts_1d_parameters_like_torch_param_groups():
    got, losses = _graph_step(OPTIM)
    ref, ref_losses = _reference(exempt=True)
    assert worst(got, ref) <= 1e-5
    assert np.abs(np.array(losses) - ref_losses).max() <= 1e-5
    # The control: decaying the norm weights and biases too moves them by lr * wd * p per step.
    assert worst(got, _reference(exempt=False)[0]) > 1e-3


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_engine_update_decays_only_the_given_ranges_as_torch_does(kind):
    """MsOps (no writable views: it concatenates) against TorchOps (in-place views) on a flat
    segment whose decay skips two pieces, two steps; and the whole range equals no ranges."""
    rng = np.random.default_rng(0)
    p, g1, g2 = (rng.standard_normal(40).astype(np.float32) for _ in range(3))
    hp = AdamWHyper(0.9, 0.95, 1e-8, 0.1) if kind == "adamw" else SGD(0.1)
    decay = ((0, 10), (13, 30), (35, 38))
    mops, tops = MsOps(), TorchOps(torch.device("cpu"))
    results = []
    for ops_, as_t in ((mops, ms.Tensor), (tops, torch.from_numpy)):
        for ranges in (decay, None, ((0, 40),)):
            x, m, v = as_t(p.copy()), as_t(np.zeros(40, np.float32)), as_t(np.zeros(40, np.float32))
            for step, g in enumerate((g1, g2), 1):
                if kind == "adamw":
                    x, m, v = ops_.adamw(x, as_t(g.copy()), m, v, step, 0.05, hp, ranges)
                else:
                    x = ops_.sgd(x, as_t(g.copy()), 0.05, hp, ranges)
            results.append(x.asnumpy() if hasattr(x, "asnumpy") else x.numpy())
    ms_ranged, ms_none, ms_whole, t_ranged, t_none, t_whole = results
    assert np.abs(ms_ranged - t_ranged).max() <= 1e-6
    assert np.array_equal(ms_none, ms_whole) and np.array_equal(t_none, t_whole)
    outside = np.r_[10:13, 30:35, 38:40]
    undecayed = np.abs(ms_ranged - ms_none)
    assert undecayed[outside].min() > 1e-4 and undecayed[np.r_[0:10, 13:30, 35:38]].max() == 0
