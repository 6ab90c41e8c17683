"""moe.use_gmm (dropless by sorting, MindFormers' MoEV3) against the capacity path's dropless result.

GroupedMatmul has only an Ascend kernel, so on CPU GroupedExperts' `matmul` (the one piece that
calls it) is replaced, in this test only, by an exact per-group matmul that reads the same
group_list: each row r goes through expert #{e: group_list[e] <= r}. What is checked is our index
math (the sort by expert, the counts and group_list, the unsort and the weighted combine), not the
Ascend kernel; the capacity path's dropless run (C = n) is the reference, with the same weights."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from mindspore import nn, ops

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.errors import ConfigError
from ms_llm.mindspore.moe import MoE

BASE = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24, max_seq_len=16,
            dtype="float32")


class PerGroupMatmul(nn.Cell):
    """GroupedMatmul's contract, exact, with static shapes: x (M, in), w (E, out, in), group_list (E,)."""

    def construct(self, x, w, group_list):
        m = x.shape[0]
        rows = ops.arange(m).reshape((m, 1)).astype(ms.int64)
        expert = (rows >= group_list.reshape((1, -1))).astype(ms.int32).sum(1)      # (M,)
        return ops.BatchMatMul(transpose_b=True)(x.reshape((m, 1, -1)), ops.gather(w, expert, 0)).reshape((m, -1))


@pytest.mark.parametrize("groups", [1, 2])
def test_sorted_dispatch_equals_dropless_capacity(groups):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    moe = dict(num_experts=4, top_k=2, expert_ffn_hidden_size=8)
    ref = MoE(ModelConfig(moe=MoEConfig(**moe), **BASE))
    gmm = MoE(ModelConfig(moe=MoEConfig(**moe, use_gmm=True), **BASE))
    rng = np.random.default_rng(groups)
    for (name, p), (name2, q) in zip(ref.parameters_and_names(), gmm.parameters_and_names()):
        assert name == name2
        value = ms.Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32))
        p.set_data(value)
        q.set_data(value)
    gmm.experts.matmul = PerGroupMatmul()
    ref.token_groups = gmm.token_groups = groups
    x = ms.Tensor(rng.normal(0, 1, (2, 6, BASE["hidden_size"])).astype(np.float32))
    want, got = ref(x).asnumpy(), gmm(x).asnumpy()
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_use_gmm_is_dropless_only():
    with pytest.raises(ConfigError, match="model.moe.use_gmm"):
        MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25, use_gmm=True)
