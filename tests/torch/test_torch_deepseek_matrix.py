"""A DeepSeek-style model trains under every torch strategy to the single-process result (gloo, CPU,
fp32, configs/models/tiny_deepseek.yaml: MLA with q_lora, sigmoid group-limited routing with the
aux-loss-free expert bias, a shared expert, a dense first layer, one MTP module): dp2, tp2, ep2,
ep2 x dp2 ZeRO-1, ep2 x tp2, and pp2 without the MTP module (refused under pp, below). Losses and
MTP losses of 5 steps and the parameters after them equal the world-1 run within 1e-5; the expert
biases are equal on every rank and equal the world-1 run's, bit for bit. The lowering's MLA / MTP
styles and the refusals need no processes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ms_llm.errors import StrategyError
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy import layout as L
from ms_llm.strategy.plan import plan as make_plan
from test_torch_matrix import TOL, launcher, load, max_diff
from torch_backend import support
from torch_backend.lower import TpStyle, lower
from torch_backend.model import Transformer
from torch_backend.parallelize.tp import LatentParallel, tp_styles
from torch_backend.pipeline import cut_chunk
from torch_deepseek_worker import CASES, MODEL, NO_MTP

CPU = Machine("cpu")


def reference(case: str) -> str:
    return "ref" if CASES[case][1] is MODEL else "ref_no_mtp"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("deepseek_matrix"), "torch_deepseek_worker.py",
                    {c: w for c, (w, _, _) in CASES.items()}, 50_000)


def biases(out, case: str, world: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's expert biases, by name."""
    return [load_file(out / f"{case}-bias{r}.safetensors") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("ref")])
def test_strategy_equals_single_process(matrix, case):
    world = CASES[case][0]
    ref, ref_t = load(matrix(1), reference(case))
    got, got_t = load(matrix(world), case)
    assert set(ref_t) == set(got_t)                      # every parameter, once
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) <= TOL
    assert len(got["mtp_losses"]) == len(ref["mtp_losses"])
    assert max((abs(a - b) for a, b in zip(ref["mtp_losses"], got["mtp_losses"])), default=0.0) <= TOL
    assert max_diff(ref_t, got_t, "param/") <= TOL
    assert ref["losses"][-1] < ref["losses"][0]

    # The expert bias: replicated, updated identically on every rank, as in the single process.
    (ref_bias,) = biases(matrix(1), reference(case), 1)
    assert all(b.abs().max() > 0 for b in ref_bias.values())        # it moved over the 5 steps
    held = biases(matrix(world), case, world)
    assert set().union(*held) == set(ref_bias)                     # pp: each stage holds its layers'
    for rank_bias in held:
        for name, b in rank_bias.items():
            assert torch.equal(b, ref_bias[name]), (case, name)


def plan_for(strategy: dict, world: int, model: dict = MODEL):
    job = job_from_dict({"model": model, "strategy": strategy, "train": {"global_batch_size": 8, "seq_len": 16}})
    return make_plan(job.model, job.strategy, job.train, world)


def test_mla_and_mtp_lower_to_megatron_tensor_parallel_styles():
    """Heads split over tp by q_b_proj / kv_b_proj (column) and o_proj (row); the down-projections to
    the latents and the latent norms stay whole; the rotary key's gradient is summed over tp; the MTP
    module's eh_proj is column-parallel with its output gathered."""
    p = plan_for({"tp": 2}, 2)
    low = lower(p, CPU)
    data = {s.module: s for s in low.tp}
    for block in ("model.layers.0.self_attn.", "model.mtp.0.layer.self_attn."):
        for proj in ("q_b_proj", "kv_b_proj"):
            assert data[block + proj] == TpStyle(block + proj, "colwise", L.Replicate(), L.Shard(-1), True)
        assert data[block + "o_proj"] == TpStyle(block + "o_proj", "rowwise", L.Shard(-1), L.Replicate(), True)
        assert data[block + "kv_a_proj_with_mqa"] == TpStyle(block + "kv_a_proj_with_mqa", "latent", L.Replicate(),
                                                             L.Replicate(), True, shared=8)
        for whole in ("q_a_proj", "q_a_layernorm", "kv_a_layernorm"):
            assert block + whole not in data
    assert data["model.mtp.0.eh_proj"] == TpStyle("model.mtp.0.eh_proj", "colwise", L.Replicate(), L.Replicate(), True)

    with torch.device("meta"):
        styles = tp_styles(low, Transformer(p.model))
    assert isinstance(styles["model.layers.1.self_attn.kv_b_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.1.self_attn.o_proj"], RowwiseParallel)
    assert styles["model.mtp.0.layer.self_attn.kv_a_proj_with_mqa"].shared == 8
    assert isinstance(styles["model.mtp.0.layer.self_attn.kv_a_proj_with_mqa"], LatentParallel)


def test_pipeline_chunks_keep_mtp_beside_the_head_only():
    p = plan_for({"pp": 2, "dp": 1}, 2)
    with torch.device("meta"):
        first, last = (cut_chunk(p.model, c) for c in p.chunks)
    assert first.model.mtp is None and first.lm_head is None
    assert last.model.mtp is not None and last.model.embed_tokens is None


@pytest.mark.parametrize("strategy, model, match", [
    ({"pp": 2, "dp": 1}, MODEL, r"^model\.mtp_layers: .*strategy\.pp: 1 with MTP, or mtp_layers: 0"),
    ({"cp": 2, "dp": 1}, NO_MTP, r"^strategy\.cp: .*use cp: 1 with model\.mla"),
    ({"tp": 2, "sequence_parallel": True}, MODEL | {"moe": None}, r"^strategy\.sequence_parallel: .*model\.mla"),
])
def test_refusals_name_the_field(strategy, model, match):
    with pytest.raises(StrategyError, match=match):
        support.check(plan_for(strategy, 2, model), CPU)


def test_moe_under_tensor_parallel_alone_runs_on_the_shared_engine():
    """Experts split over tp are plain tensors: only the shared engine's expert path counts them
    whole in the clipping norm, even without data parallelism."""
    assert support.zero_engine(plan_for({"tp": 2}, 2), CPU) == support.SHARED
    assert support.zero_engine(plan_for({"tp": 2}, 2, MODEL | {"moe": None}), CPU) == support.NONE
