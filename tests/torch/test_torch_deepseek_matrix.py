"""A DeepSeek-style model trains under every torch strategy to the single-process result (gloo, CPU,
fp32, configs/models/tiny_deepseek.yaml: MLA with q_lora, sigmoid group-limited routing with the
aux-loss-free expert bias, a shared expert, a dense first layer, one MTP module): dp2, tp2, ep2,
ep2 x dp2 ZeRO-1, ep2 x tp2, pp2 and pp2 x ep2 ZeRO-1 (the shipped DeepSeek-V3 job's strategy), and
its dense variant under pp2 x dp2 on the shared ZeRO-3 and FSDP2 (the routed experts under the
ZeRO stages are test_torch_moe_matrix.py's). Losses and MTP losses of 5 steps
and the parameters after them equal the world-1 run within 1e-5; the expert biases are equal on
every rank and equal the world-1 run's, bit for bit. Under pipeline parallel the MTP modules sit on
the last stage with a copy of the embedding (Megatron-core's embedding group), which stays equal to
the first stage's bit for bit, and a run resumed from a checkpoint (saved with the embedding once)
repeats the uninterrupted one bit for bit. The lowering's MLA / MTP styles, the ZeRO partition of
the copy and the refusals need no processes."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ms_llm.checkpoint import Checkpoint
from ms_llm.checkpoint.storage.format import rank_file
from ms_llm.errors import StrategyError
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy import layout as L
from ms_llm.strategy.mesh import MeshSpec
from ms_llm.strategy.plan import plan as make_plan
from ms_llm.zero import zero_plan
from ms_llm.zero.partition import EMBEDDING, embedding_groups
from test_torch_matrix import TOL, launcher, load, max_diff
from torch_backend import support
from torch_backend.lower import TpStyle, lower
from torch_backend.model import Transformer
from torch_backend.parallelize.tp import LatentParallel, tp_styles
from torch_backend.pipeline import cut_chunk
from torch_deepseek_worker import CASES, MODEL, NO_MTP

CPU = Machine("cpu")


def reference(case: str) -> str:
    return "ref" if CASES[case][1] is MODEL else "ref_dense"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("deepseek_matrix"), "torch_deepseek_worker.py",
                    {c: w for c, (w, _, _) in CASES.items()}, 50_000)


def biases(out, case: str, world: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's expert biases, by name."""
    return [load_file(out / f"{case}-bias{r}.safetensors") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("ref") and not c.endswith("_resume")])
def test_strategy_equals_single_process(matrix, case):
    world = CASES[case][0]
    ref, ref_t = load(matrix(1), reference(case))
    got, got_t = load(matrix(world), case)
    assert set(ref_t) == {k for k in got_t if k.startswith("param/")}      # every parameter, once
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) <= TOL
    assert len(got["mtp_losses"]) == len(ref["mtp_losses"]) == 5
    assert max(abs(a - b) for a, b in zip(ref["mtp_losses"], got["mtp_losses"])) <= TOL
    assert max_diff(ref_t, got_t, "param/") <= TOL
    assert ref["losses"][-1] < ref["losses"][0]
    # Pipeline parallel: the last stage's copy of the embedding stayed the first stage's.
    copies = {k for k in got_t if k.startswith("copy/")}
    assert copies == ({f"copy/{EMBEDDING}"} if "pp" in CASES[case][2] else set())
    assert all(torch.equal(got_t[k], got_t[k.replace("copy/", "param/")]) for k in copies)

    # The expert bias: replicated, updated identically on every rank, as in the single process.
    (ref_bias,) = biases(matrix(1), reference(case), 1)
    assert all(b.abs().max() > 0 for b in ref_bias.values())        # it moved over the 5 steps
    held = biases(matrix(world), case, world)
    assert set().union(*held) == set(ref_bias)                     # pp: each stage holds its layers'
    for rank_bias in held:
        for name, b in rank_bias.items():
            assert torch.equal(b, ref_bias[name]), (case, name)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("_resume")])
def test_pipeline_with_mtp_resumes_from_a_checkpoint(matrix, case):
    """Saved after 3 steps (AdamW), loaded into a fresh trainer: the next 2 steps' losses, MTP losses
    and parameters are the uninterrupted run's bit for bit. The embedding and its optimizer states
    are written by the first stage's ranks only, each element once; the last stage's copy loads them."""
    world = CASES[case][0]
    got, got_t = load(matrix(world), case)
    assert got["losses"] == got["resumed_losses"] and got["mtp_losses"] == got["resumed_mtp_losses"]
    resumed = {k for k in got_t if k.startswith("resumed/")}
    assert {k.replace("resumed/", "param/") for k in resumed} == {k for k in got_t if k.startswith("param/")}
    assert all(torch.equal(got_t[k], got_t[k.replace("resumed/", "param/")]) for k in resumed)
    assert torch.equal(got_t[f"copy/{EMBEDDING}"], got_t[f"param/{EMBEDDING}"])
    first_stage = {rank_file(r) for r in range(world // 2)}           # pp is the outermost mesh axis
    with Checkpoint.open(matrix(world) / f"{case}-ckpt") as ckpt:
        for name in (EMBEDDING, f"optim.exp_avg.{EMBEDDING}", f"optim.exp_avg_sq.{EMBEDDING}"):
            entry = ckpt.entry(name)
            assert {shard.file for shard in entry.shards} <= first_stage, name
            assert sum(shard.region.numel for shard in entry.shards) == math.prod(entry.shape), name


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
    """The last chunk holds the MTP modules and a copy of the embedding for them; it takes hidden
    states, not tokens."""
    p = plan_for({"pp": 2, "dp": 1}, 2)
    with torch.device("meta"):
        first, last = (cut_chunk(p.model, c) for c in p.chunks)
    assert first.model.mtp is None and first.lm_head is None and first.takes_tokens
    assert last.model.mtp is not None and last.model.embed_tokens is not None and not last.takes_tokens
    assert not any(c.has_embedding for c in p.chunks[1:])


def test_the_zero_partition_ties_the_embedding_copy_to_the_first_stage():
    """The shared engine's partition of pp2 x dp2 (ZeRO-1): the copy is an entry of stage 1, in the
    final unit, sharded like the original; no rank's piece of it is primary (not counted in the norm,
    not saved); the embedding groups pair the ranks at one dp position of the two stages."""
    z = zero_plan(plan_for({"pp": 2, "dp": 2, "zero": {"stage": 1}}, 4))
    original, copy = (e for e in z.entries if e.name == EMBEDDING)
    assert (original.stage, original.tied, copy.stage, copy.tied, copy.unit) == (0, False, 1, True, "final")
    assert copy.zero_dim == original.zero_dim == 0 and copy.layout == original.layout
    assert z.tied_names() == {EMBEDDING} and z.groups["embedding"] == [[0, 2], [1, 3]]
    pieces = {r: [p for p in z.owned(r) if p.name == EMBEDDING] for r in range(4)}
    assert [len(v) for v in pieces.values()] == [1, 1, 1, 1]
    assert [pieces[r][0].primary for r in range(4)] == [True, True, False, False]
    assert pieces[0][0].global_box == pieces[2][0].global_box != pieces[1][0].global_box
    assert embedding_groups(MeshSpec(("pp", "dp_shard"), (4, 2)), (0, 3)) == [[0, 6], [1, 7]]


@pytest.mark.parametrize("strategy, model, match", [
    ({"pp": 2, "dp": 1, "pipeline": {"schedule": "zbv", "virtual_stages": 2}}, MODEL | {"num_layers": 4},
     r"^strategy\.pipeline\.schedule: zbv puts the MTP modules on the first rank.*use schedule 1f1b"),
    ({"cp": 2, "dp": 1}, MODEL | {"mla": None},
     r"^strategy\.cp: the MTP modules shift .*use cp: 1 with model\.mtp_layers"),
    ({"cp": 2, "dp": 1}, NO_MTP, r"^strategy\.cp: .*use cp: 1 with model\.mla"),
    ({"tp": 2, "sequence_parallel": True}, MODEL | {"moe": None}, r"^strategy\.sequence_parallel: .*model\.mla"),
])
def test_refusals_name_the_field(strategy, model, match):
    with pytest.raises(StrategyError, match=match):
        support.check(plan_for(strategy, 2, model), CPU)


def test_moe_under_tensor_parallel_alone_runs_on_the_shared_engine():
    """Experts split over tp are plain tensors: only the shared engine (its experts' buckets) counts
    them whole in the clipping norm, even without data parallelism."""
    assert support.zero_engine(plan_for({"tp": 2}, 2), CPU) == support.SHARED
    assert support.zero_engine(plan_for({"tp": 2}, 2, MODEL | {"moe": None}), CPU) == support.NONE
