"""Every strategy the lowering produces is accepted by MindSpore's own APIs: Primitive.shard
(tuples and Layouts), set_auto_parallel_context and the AutoParallel wrapper's methods; every
primitive of each model family (LLaMA, Qwen, MoE, DeepSeek's MLA / routing / MTP) gets one, with
one split per dim of what the primitive is given in a forward pass."""
import dataclasses

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from mindspore import ops as P

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.job import load_section
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import StrategyError
from ms_llm.mindspore.apply import apply_lowering, auto_parallel, set_context
from ms_llm.mindspore.dry_run import dry_run_text
from ms_llm.mindspore.lower import context_args, lower, write_strategy_files
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.op_strategy import LayoutStrategy
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan

MODEL = ModelConfig(vocab_size=96, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, max_seq_len=32, dtype="float32")
FLASH = dataclasses.replace(MODEL, flash_attention=True)
QWEN = dataclasses.replace(MODEL, qkv_bias=True, qk_norm=True, head_dim=24)    # every Qwen parameter
MOE = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, top_k=2, shared_experts=1, capacity_factor=1.5,
                                               z_loss_coeff=0.01, first_dense_layers=1))   # every MoE primitive
# DeepSeek-V3 in miniature (MLA with the query's low-rank path, sigmoid group routing with the expert bias,
# the sequence-wise loss, a shared expert, one MTP module), and its other paths: q_proj, rotary pairs not
# interleaved, softmax routing without groups or bias, two MTP depths.
DEEPSEEK = dataclasses.replace(load_section("model", "tiny_deepseek"), max_seq_len=32)
DS_PLAIN = dataclasses.replace(
    DEEPSEEK, mla=dataclasses.replace(DEEPSEEK.mla, q_lora_rank=None, rope_interleave=False), mtp_layers=2,
    moe=dataclasses.replace(DEEPSEEK.moe, score_function="softmax", num_groups=1, group_top_k=1, expert_bias=False,
                            routed_scaling_factor=1.0, seq_aux_loss_coeff=0.0, aux_loss_coeff=0.01))
STRATEGIES = {
    "dp4": ({"dp": 4}, 4),
    "dp4_zero2": ({"dp": 4, "zero": {"stage": 2}}, 4),
    "dp2_tp2_sp_zero1": ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": {"stage": 1}}, 4),
    "dp2_tp2_pp2_sp_full_recompute": ({"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True,
                                       "recompute": {"policy": "full"}}, 4),
    "cp2_tp2_interleaved_selective": ({"dp": 1, "cp": 2, "tp": 2, "pp": 2,
                                       "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2},
                                       "recompute": {"policy": "selective", "num_layers": 1}}, 4),
    "hsdp_zero3": ({"dp": 4, "zero": {"stage": 3, "shard_size": 2}}, 4),
    "flash_cp2_tp2_sp": ({"dp": 1, "cp": 2, "tp": 2, "sequence_parallel": True}, 1),
    "flash_cp2_tp2_ring": ({"dp": 1, "cp": 2, "tp": 2, "context_parallel": {"algorithm": "ring"}}, 1),
    "qwen_dp2_tp2_sp_zero1": ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": {"stage": 1}}, 4),
    "moe_dp2_ep2_tp2_sp_selective": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True,
                                      "recompute": {"policy": "selective"}}, 4),
    "moe_dp2_ep2_pp2": ({"dp": 2, "ep": 2, "pp": 2}, 4),
    "ds_dp2_tp2_ep2_sp_selective": ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True,
                                     "recompute": {"policy": "selective"}}, 4),
    "ds_dp2_ep2_pp2_full": ({"dp": 2, "ep": 2, "pp": 2, "recompute": {"policy": "full"}}, 4),
    "ds_dp2_cp2_tp2_ulysses": ({"dp": 2, "cp": 2, "tp": 2, "ep": 2, "context_parallel": {"algorithm": "ulysses"}}, 4),
    "dsplain_dp2_tp2_ep2_cp2": ({"dp": 2, "tp": 2, "cp": 2, "ep": 4}, 4),
}


def _model(name) -> ModelConfig:
    return {"flash": FLASH, "qwen": QWEN, "moe": MOE, "ds": DEEPSEEK, "dsplain": DS_PLAIN}.get(name.split("_")[0], MODEL)


def _plan(name):
    strategy, batch = STRATEGIES[name]
    return plan(_model(name), from_dict(ParallelStrategy, strategy, "strategy"),
                TrainConfig(global_batch_size=batch, micro_batch_size=1, seq_len=32))


@pytest.fixture(autouse=True)
def clean_context():
    yield
    ms.reset_auto_parallel_context()


def _primitives(cell, prefix=""):
    for name, value in vars(cell).items():
        if isinstance(value, P.Primitive):
            yield prefix + name, value
    for name, child in cell.name_cells().items():
        yield from _primitives(child, f"{prefix}{name}.")


@pytest.mark.parametrize("name", STRATEGIES)
def test_mindspore_accepts_every_strategy(name, tmp_path):
    p = _plan(name)
    low = lower(p, strategy_file=str(tmp_path / "strategy.ckpt"))
    net = LossCell(Transformer(_model(name)))
    apply_lowering(net, low)
    set_context(low)
    for key, value in low.context.items():
        if key not in ("strategy_ckpt_config", "parallel_optimizer_config", "pipeline_config"):
            assert ms.get_auto_parallel_context(key) == (list(map(list, value)) if key == "dataset_strategy"
                                                         else value), key
    ms.reset_auto_parallel_context()
    auto_parallel(LossCell(Transformer(_model(name))), low, tmp_path / "param_strategy.ckpt")


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_compute_primitive_gets_a_strategy(name):
    low = lower(_plan(name))
    shards = {o.op for o in low.ops}
    net = LossCell(Transformer(_model(name)))
    prims = {n.removeprefix("net."): prim for n, prim in _primitives(net)}
    unsharded = {n for n, prim in prims.items() if n not in shards and not isinstance(prim, P.Reshape)}
    assert not unsharded
    assert shards <= set(prims)
    apply_lowering(net, low)
    for op in low.ops:
        attrs = prims[op.op].attrs
        assert attrs.get("in_strategy") is not None or attrs.get("in_layout") is not None, op.op


def test_flash_attention_falls_back_to_batch_matmul_on_cpu():
    """FlashAttentionScore has no CPU kernel: a flash config builds the primitive (its strategy is
    set and checked) but computes with BatchMatMul + softmax, the same numbers as without it."""
    assert ms.get_context("device_target") == "CPU"
    plain, flash = Transformer(MODEL), Transformer(FLASH)
    plain.init_weights(seed=3)
    flash.init_weights(seed=3)
    attn = flash.model.layers[0].self_attn
    assert attn.flash_attention.name == "FlashAttentionScore" and not attn.use_flash and not flash.use_flash
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, MODEL.vocab_size, (2, 16)), ms.int32)
    np.testing.assert_array_equal(flash(tokens).asnumpy(), plain(tokens).asnumpy())


@pytest.mark.parametrize("ring", [False, True])
def test_flash_attention_path_passes_mindspore_graph_inference(monkeypatch, ring):
    """The Ascend path, forced on CPU: the graph (FlashAttentionScore's q/k/v/mask dtypes and shapes,
    GQA k/v, the tiled uint8 mask, or no mask as ring attention) passes MindSpore's inference and
    stops only at kernel selection."""
    import ms_llm.mindspore.model as model_module

    monkeypatch.setattr(model_module, "FLASH_TARGETS", ("CPU",))
    net = Transformer(dataclasses.replace(FLASH, num_layers=1), ring_attention=ring)
    assert net.use_flash and net.model.layers[0].self_attn.use_flash
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(RuntimeError, match=r"Unsupported op \[FlashAttentionScore\] on CPU"):
            net(ms.Tensor(np.zeros((2, 16)), ms.int32))
    finally:
        ms.set_context(mode=mode)


def test_pipeline_stages_and_recompute_follow_the_plan():
    p = _plan("cp2_tp2_interleaved_selective")
    low = lower(p)
    net = apply_lowering(LossCell(Transformer(MODEL)), low)
    for i in range(MODEL.num_layers):
        layer = net.net.model.layers[i]
        assert (layer.pipeline_stage, layer.pipeline_segment) == p.layer_stage(i)
    assert net.net.lm_head.pipeline_stage == p.chunks[-1].stage
    assert net.net.model.embed_tokens.pipeline_stage == 0
    # selective recompute of the first layer of each stage: attention core and MLP activation
    first = {c.layers[0] for c in p.chunks if c.virtual == 0}
    assert low.recompute_ops and all(int(o.split(".")[2]) in first for o in low.recompute_ops)
    assert net.net.model.layers[0].self_attn.softmax.attrs.get("recompute") is True


def test_context_parallel_needs_layouts_and_mindspore_builds_them():
    low = lower(_plan("cp2_tp2_interleaved_selective"))
    layouts = [s for o in low.ops for s in o.inputs if isinstance(s, LayoutStrategy)]
    assert layouts
    for lay in layouts:
        d = lay.build().to_dict()
        assert tuple(d["device_matrix"]) == lay.dev_matrix and len(d["tensor_map"]) == len(lay.dims)


def test_zero_and_pipeline_context():
    ctx = context_args(_plan("hsdp_zero3"))
    assert ctx["enable_parallel_optimizer"]
    assert ctx["parallel_optimizer_config"] == {"optimizer_level": "level3", "optimizer_weight_shard_size": 2,
                                                "parallel_optimizer_threshold": 0}
    ctx = context_args(_plan("cp2_tp2_interleaved_selective"), mode="auto")
    assert ctx["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
    assert ctx["search_mode"] == "sharding_propagation" and ctx["parallel_mode"] == "auto_parallel"


def test_ring_attention_is_flash_attention_with_the_ring_switches():
    low = lower(_plan("flash_cp2_tp2_ring"))
    net = apply_lowering(LossCell(Transformer(FLASH, ring_attention=True)), low)
    attrs = net.net.model.layers[0].self_attn.flash_attention.attrs
    assert attrs["enable_ring_attention"] is True and attrs["enable_ra_send_recv"] is True
    assert len(attrs["in_layout"] if "in_layout" in attrs else attrs["in_strategy"]) == 3      # q, k, v: no mask
    text = dry_run_text(low)
    assert "context parallel: ring over cp (2 ranks)" in text
    assert "attrs enable_ring_attention=True, enable_ra_send_recv=True" in text
    s = from_dict(ParallelStrategy, {"dp": 1, "cp": 2, "context_parallel": {"algorithm": "ring"}}, "strategy")
    with pytest.raises(StrategyError, match="ring on MindSpore is FlashAttentionScore's ring attention"):
        lower(plan(MODEL, s, TrainConfig(global_batch_size=1, micro_batch_size=1, seq_len=32)))


def test_schedule_mindspore_lacks_is_a_clear_error():
    s = from_dict(ParallelStrategy, {"dp": 1, "pp": 2, "pipeline": {"schedule": "zero_bubble"}}, "strategy")
    p = plan(MODEL, s, TrainConfig(global_batch_size=2, micro_batch_size=1, seq_len=32))
    with pytest.raises(StrategyError, match="strategy.pipeline.schedule: MindSpore has no 'zero_bubble'"):
        lower(p)


# The ranks a strategy gives per input, against the ranks the primitive is called with. OneHot's
# strategy is over its output (one dim more than its indices).
OUTPUT_RANK = ("OneHot",)
# Primitives of the model that MindSpore cannot shard as built, each with why; the test fails when one
# is fixed, so the entry goes with the fix. (mla.py owns them.)
MODEL_GAPS: dict[str, str] = {}        # primitive suffix -> why the model gives it inputs of another rank


@pytest.mark.parametrize("name", ["moe_dp2_ep2_tp2_sp_selective", "qwen_dp2_tp2_sp_zero1", "ds_dp2_tp2_ep2_sp_selective",
                                  "dsplain_dp2_tp2_ep2_cp2"])
def test_each_strategy_has_one_split_per_dim_of_what_the_primitive_gets(name, monkeypatch):
    """A forward pass (PyNative) records the rank of every tensor each primitive is called with; the
    lowered strategy has one entry per dim of each (a wrong rank stops a compile on Ascend, not here)."""
    low = lower(_plan(name))
    net = LossCell(Transformer(_model(name)), loads=_model(name).moe is not None and _model(name).moe.expert_bias)
    net.net.init_weights(seed=0)
    prims = dict(_primitives(net))
    names = {id(prim): n.removeprefix("net.") for n, prim in prims.items()}
    calls: dict[str, set] = {}

    def recording(call):
        def record(prim, *args):
            if id(prim) in names:
                calls.setdefault(names[id(prim)], set()).add(tuple(len(a.shape) if hasattr(a, "shape") else None
                                                                   for a in args))
            return call(prim, *args)
        return record

    for kind in {type(prim) for prim in prims.values()}:      # generated primitives have their own __call__
        monkeypatch.setattr(kind, "__call__", recording(kind.__call__))
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        tokens = ms.Tensor(np.zeros((2, 16)), ms.int32)
        net(tokens, tokens)
    finally:
        ms.set_context(mode=mode)
    monkeypatch.undo()
    gaps, wrong = set(), []
    for op in low.ops:
        extra = 1 if type(prims["net." + op.op if not op.op.startswith("loss") else op.op]).__name__ in OUTPUT_RANK else 0
        for ranks in calls.get(op.op, ()):
            for strategy, rank in zip(op.inputs, ranks):
                dims = len(strategy.dims) if isinstance(strategy, LayoutStrategy) else len(strategy)
                if rank and dims and dims != rank + extra:
                    gap = next((g for g in MODEL_GAPS if op.op.endswith(g)), None)
                    (gaps.add(gap) if gap else wrong.append(f"{op.op}: strategy {strategy} for a {rank}-d input"))
    seen = sum(op.op in calls for op in low.ops)
    assert seen > 0.8 * len(low.ops) and not wrong, wrong     # the rest: primitives this config leaves unused
    expected = {g for g in MODEL_GAPS if any(o.op.endswith(g) for o in low.ops)}
    assert gaps == expected, f"fixed in the model, drop from MODEL_GAPS: {expected - gaps}"


def test_mtp_runs_with_lm_head_on_the_last_stage():
    p = _plan("ds_dp2_ep2_pp2_full")
    net = apply_lowering(LossCell(Transformer(DEEPSEEK)), lower(p))
    last = p.chunks[-1].stage
    assert last == 1 and net.net.model.mtp[0].pipeline_stage == net.net.lm_head.pipeline_stage == last
    assert net.net.model.layers[0].pipeline_stage == 0 and net.net.model.embed_tokens.pipeline_stage == 0


def test_mla_lowering_follows_the_plan():
    """Down-projections on the plan's latents (each rank's sequence chunk under sequence parallel), the
    up-projections column-parallel over the gathered latents, the expert bias whole beside token-split scores."""
    ops = {o.op: o for o in lower(_plan("ds_dp2_tp2_ep2_sp_selective")).ops}
    a = "model.layers.1.self_attn."
    assert ops[a + "q_a_proj.matmul"].inputs == ((4, 1), (1, 1))          # tokens over dp x tp, whole weight
    assert ops[a + "q_b_proj.matmul"].inputs == ((2, 1), (2, 1))          # tokens over dp, heads over tp
    assert ops[a + "o_proj.matmul"].output == ((4, 1),)                   # reduce-scattered into the sequence
    assert ops["model.layers.1.mlp.add_bias"].inputs == ((4, 1), (1,))
    assert ops["model.mtp.0.eh_proj.matmul"].inputs == ((2, 1), (2, 1))


def test_ring_attention_is_refused_for_mla():
    s = from_dict(ParallelStrategy, {"dp": 1, "cp": 2, "context_parallel": {"algorithm": "ring"}}, "strategy")
    model = dataclasses.replace(DEEPSEEK, flash_attention=True)
    with pytest.raises(StrategyError, match="multi-latent attention does not run"):
        lower(plan(model, s, TrainConfig(global_batch_size=1, micro_batch_size=1, seq_len=32)))


def test_deepseek_strategy_files_read_back_in_mindspore(tmp_path):
    """Per-rank strategy files of a DeepSeek plan over two stages, read by MindSpore's own
    build_searched_strategy: the last stage's hold the MTP modules beside lm_head, MLA's up-projections
    split by heads over tp and its down-projections whole, the experts over ep."""
    p = _plan("ds_dp2_ep2_pp2_full")
    write_strategy_files(p, tmp_path)
    first = ms.parallel.build_searched_strategy(str(tmp_path / "ckpt_strategy_rank_0.ckpt"))
    last = ms.parallel.build_searched_strategy(str(tmp_path / f"ckpt_strategy_rank_{p.world_size - 1}.ckpt"))
    assert "model.embed_tokens.weight" in first and not any(n.startswith("model.mtp.") for n in first)
    assert {n for n in p.params if n.startswith("model.mtp.")} <= set(last) and "lm_head.weight" in last
    experts = last["model.mtp.0.layer.mlp.experts.gate_proj.weight"]
    assert list(experts.dev_matrix[0].dim) == [2] and list(experts.tensor_map[0].dim) == [0, -1, -1]
    tp = _plan("ds_dp2_tp2_ep2_sp_selective")
    write_strategy_files(tp, tmp_path / "tp")
    entries = ms.parallel.build_searched_strategy(str(tmp_path / "tp" / "ckpt_strategy_rank_0.ckpt"))
    assert list(entries["model.layers.1.self_attn.q_b_proj.weight"].tensor_map[0].dim) == [0, -1]
    assert list(entries["model.layers.1.self_attn.q_a_proj.weight"].tensor_map[0].dim) == [-1, -1]
