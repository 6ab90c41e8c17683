"""The torch lowering reads the plan: TP styles follow the layouts, pipeline chunks follow the
stage map, and the data becomes torch's ParallelStyles and schedules unchanged (what it refuses
and which engine it picks: tests/cli/test_support.py). No processes needed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed import pipelining
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy import layout as L
from ms_llm.strategy.ir import SCHEDULES as IR_SCHEDULES
from ms_llm.strategy.plan import plan as make_plan
from torch_backend import support
from torch_backend.lower import SCHEDULES, ContextParallelPlan, TpStyle, lower
from torch_backend.model import Transformer
from torch_backend.parallelize.ac import _op
from torch_backend.parallelize.cp import cp_positions
from torch_backend.parallelize.tp import tp_styles
from torch_backend.pipeline import cut_chunk

ROOT = Path(__file__).resolve().parents[2]
CPU = Machine("cpu")
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             max_seq_len=16, dtype="float32")


def plan_for(strategy: dict, world: int, model: dict = MODEL, **train):
    job = job_from_dict({"model": model, "strategy": strategy,
                         "train": {"global_batch_size": 8, "seq_len": 16, **train}})
    return make_plan(job.model, job.strategy, job.train, world)


def meta_model(p):
    with torch.device("meta"):
        return Transformer(p.model)


def test_tp_plan_follows_layouts_with_sequence_parallel():
    p = plan_for({"tp": 2, "sequence_parallel": True}, 2)
    low = lower(p, CPU)
    data = {s.module: s for s in low.tp}
    assert data["model.layers.1.mlp.down_proj"] == TpStyle("model.layers.1.mlp.down_proj", "rowwise", L.Shard(-1),
                                                          L.Shard(1), True)
    assert data["model.layers.0.self_attn"] == TpStyle("model.layers.0.self_attn", "prepare_input", L.Shard(1),
                                                      L.Replicate(), False)
    assert low.loss_parallel and str(data["lm_head"]) == "colwise: in S(1) out S(2), DTensor out"

    styles = tp_styles(low, meta_model(p))
    assert isinstance(styles["model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.3.mlp.up_proj"], ColwiseParallel)
    down = styles["model.layers.1.mlp.down_proj"]
    assert isinstance(down, RowwiseParallel) and down.output_layouts == (Shard(1),)   # reduce-scatter
    assert isinstance(styles["model.layers.2.input_layernorm"], SequenceParallel)
    assert isinstance(styles["model.norm"], SequenceParallel)
    attn = styles["model.layers.0.self_attn"]                                          # all-gather
    assert isinstance(attn, PrepareModuleInput)
    assert attn.input_layouts == (Shard(1), None, None) and attn.desired_input_layouts == (Replicate(), None, None)
    assert styles["model.layers.0.mlp"].input_layouts == (Shard(1),)
    embed, head = styles["model.embed_tokens"], styles["lm_head"]
    assert isinstance(embed, RowwiseParallel) and embed.output_layouts == (Shard(1),)
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(2),) and not head.use_local_output


def test_tp_plan_without_sequence_parallel():
    p = plan_for({"tp": 2}, 2)
    low = lower(p, CPU)
    assert {s.kind for s in low.tp} == {"colwise", "rowwise"}
    styles = tp_styles(low, meta_model(p))
    assert not any(isinstance(s, (SequenceParallel, PrepareModuleInput)) for s in styles.values())
    assert styles["model.layers.0.self_attn.o_proj"].output_layouts == (Replicate(),)
    assert len(styles) == 2 + 4 * 7          # embedding, head, 7 linears per layer


def test_no_tp_plan_without_tensor_parallel():
    assert lower(plan_for({"dp": 2}, 2), CPU).tp == ()


def test_tp_styles_of_a_pipeline_stage_cover_only_its_modules():
    p = plan_for({"tp": 2, "pp": 2, "sequence_parallel": True}, 4)
    low = lower(p, CPU)
    (last_chunk,) = low.stages[1]
    with torch.device("meta"):
        last = cut_chunk(p.model, last_chunk)
    styles = tp_styles(low, last)
    assert "model.embed_tokens" not in styles and "lm_head" in styles
    assert {k.split(".")[2] for k in styles if k.startswith("model.layers.")} == {"2", "3"}


def test_stages_schedule_and_micro_batches_follow_the_plan():
    p = plan_for({"pp": 2, "pipeline": {"schedule": "zbv", "virtual_stages": 2}}, 2)
    low = lower(p, CPU)
    assert [[c.index for c in chunks] for chunks in low.stages] == [[0, 3], [1, 2]]      # V: down and back up
    assert low.schedule == "ScheduleZBVZeroBubble" and low.micro_batches == p.micro_batches
    assert lower(plan_for({"dp": 2}, 2), CPU).schedule is None


def test_every_schedule_of_the_ir_is_a_torch_schedule():
    assert set(SCHEDULES) == set(IR_SCHEDULES)
    assert all(hasattr(pipelining, name) for name in SCHEDULES.values())


def test_recompute_and_selective_saves():
    low = lower(plan_for({"recompute": {"policy": "selective"}}, 1), CPU)
    assert low.recompute == ("selective",) * 4
    assert [_op(n) for n in low.selective_saves][:2] == [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    assert lower(plan_for({}, 1), CPU).selective_saves == ()


@pytest.mark.parametrize("strategy,engine,axes,reshard", [
    ({"dp": 4, "zero": {"stage": 3, "shard_size": 2, "engine": "native"}}, support.FSDP, ("dp_replicate", "dp_shard"),
     True),
    ({"dp": 4, "zero": {"stage": 2, "engine": "native"}}, support.FSDP, ("dp_shard",), False),
    ({"dp": 2, "tp": 2, "zero": {"engine": "native"}}, support.REPLICATE, ("dp",), False),
    ({"dp": 4, "zero": {"stage": 1, "engine": "shared"}}, support.SHARED, (), False),
    # cp ranks see different tokens of the same replica: gradients reduce over dp x cp
    ({"dp": 1, "cp": 2, "zero": {"engine": "native"}}, support.DDP, ("dp_cp",), False),
    ({"dp": 2, "cp": 2, "zero": {"stage": 3, "engine": "native"}}, support.FSDP, ("dp_shard_cp",), True),
    ({"dp": 4, "cp": 2, "zero": {"stage": 3, "shard_size": 2, "engine": "native"}}, support.FSDP,
     ("dp_replicate", "dp_shard_cp"), True),
])
def test_data_parallel_plan(strategy, engine, axes, reshard):
    world = strategy["dp"] * strategy.get("tp", 1) * strategy.get("cp", 1)
    dp = lower(plan_for(strategy, world), CPU).dp
    assert (dp.engine, dp.mesh_axes, dp.reshard_after_forward) == (engine, axes, reshard)


@pytest.mark.parametrize("algorithm,balanced", [("ring", True), ("ulysses", False), ("allgather", True)])
def test_context_parallel_plan(algorithm, balanced):
    low = lower(plan_for({"cp": 2, "context_parallel": {"algorithm": algorithm}}, 2), CPU)
    assert low.cp == ContextParallelPlan(2, algorithm, balanced)
    assert lower(plan_for({}, 1), CPU).cp is None
    assert lower(plan_for({"cp": 2}, 2), CPU).cp.algorithm in ("ring", "ulysses", "allgather")   # auto: priced


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_split_covers_the_sequence_with_equal_causal_work(cp):
    seq = 32
    held = [cp_positions(seq, cp, r, True) for r in range(cp)]
    assert sorted(p for h in held for p in h) == list(range(seq))
    assert len({sum(p + 1 for p in h) for h in held}) == 1               # keys each rank's queries see
    assert cp_positions(8, 2, 0, True) == [0, 1, 6, 7] and cp_positions(8, 2, 1, False) == [4, 5, 6, 7]


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_chunks_run_in_sequence_equal_the_whole_model(schedule, virtual):
    p = plan_for({"pp": 2, "pipeline": {"schedule": schedule, "virtual_stages": virtual}}, 2)
    whole = Transformer(p.model)
    whole.init_weights(3)
    tokens = torch.randint(0, p.model.vocab_size, (2, 16))
    x = tokens
    for chunk in p.chunks:                    # model order, whichever rank holds each chunk
        part = cut_chunk(p.model, chunk)
        part.load_state_dict(whole.state_dict(), strict=False)
        assert {n for n, _ in part.named_parameters()} == {n for n, q in p.params.items()
                                                            if (q.stage, q.chunk) == (chunk.stage, chunk.virtual)}
        x = part(x)
    assert torch.allclose(x, whole(tokens), atol=1e-6)


def test_dry_run_prints_the_torch_lowering_of_the_70b_job():
    code = ("import sys; from ms_llm.cli import main; rc = main(['train', 'configs/train/llama2_70b_dp2_tp4_pp8.yaml', "
            "'--backend', 'torch', '--dry-run']); print('imported torch:', 'torch' in sys.modules); "
            "raise SystemExit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mesh pp8 x dp_replicate2 x dp_shard1 x cp1 x tp4" in out
    assert "  model.layers.{0-79}.self_attn.q_proj: colwise: in R out S(-1)" in out
    assert "  model.layers.{0-79}.mlp.down_proj: rowwise: in S(-1) out S(1)" in out
    assert "  model.layers.{0-79}.input_layernorm: sequence: in S(1) out S(1)" in out
    assert "  model.layers.{0-79}.self_attn: prepare_input: in S(1) out R" in out
    assert "  lm_head: colwise: in S(1) out S(2), DTensor out" in out
    assert "  pp rank 7: chunk 7: model.layers.{70-79}, model.norm, lm_head" in out
    assert "pipeline schedule: Schedule1F1B, 128 micro-batches" in out
    assert "imported torch: False" in out           # printed without torch, on any machine


def test_a_data_parallel_worker_loads_neither_dtensor_nor_dynamo():
    """A dp2 job's worker modules, its chunk built on the meta device and materialized, leave out
    DTensor, DCP, pipelining and torch._dynamo (about 1.5 s of start-up per worker); a tp2 job's
    lowering does load DTensor, so the check can fail."""
    code = (
        "import sys, torch\n"
        "from ms_llm.job import job_from_dict\n"
        "from ms_llm.machine import Machine\n"
        "from ms_llm.strategy.plan import plan\n"
        "from torch_backend.apply import apply\n"
        "from torch_backend.lower import lower\n"
        "from torch_backend.state import TorchTrainerState\n"
        "from torch_backend.step import TrainStep\n"
        "from torch_backend.pipeline import cut_chunk\n"
        "from torch_backend.weights import materialize\n"
        f"job = job_from_dict({{'model': {MODEL!r}, 'strategy': {{'dp': 2}}, 'train': {{'global_batch_size': 8, 'seq_len': 16}}}})\n"
        "p = plan(job.model, job.strategy, job.train, 2)\n"
        "with torch.device('meta'):\n"
        "    part = cut_chunk(p.model, lower(p, Machine('cpu')).stages[0][0])\n"
        "materialize(part, p, torch.device('cpu'), 0, 0)\n"
        "if sys.argv[1] == 'tp':\n"
        "    from torch_backend.parallelize import tp\n"
        "heavy = ('torch.distributed.tensor', 'torch.distributed.checkpoint', 'torch.distributed.pipelining',\n"
        "         'torch._dynamo')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n")
    loaded = {kind: subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True, cwd=ROOT,
                                   timeout=120) for kind in ("dp", "tp")}
    assert loaded["dp"].returncode == 0, loaded["dp"].stderr
    assert loaded["dp"].stdout.strip() == ""
    assert "torch.distributed.tensor" in loaded["tp"].stdout
