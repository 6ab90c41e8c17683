"""The MindSpore lowering reproduces MindFormers' LLaMA shard strategies.

The expected values are MindFormers' own formulas (mindformers r1.5 / dev:
models/llama/llama_transformer.py, llama_layer.py, llama.py, core/loss/loss.py), written in
its (dp, mp, cp) terms; ours are derived from the ModelPlan's layouts. One test per case
MindFormers covers. Where MindFormers makes a different choice the test says so.
"""
import pytest

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.mindspore.lower import LayoutStrategy, lower
from ms_llm.strategy.ir import ParallelStrategy, PipelineSpec
from ms_llm.strategy.plan import plan

MODEL = ModelConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                    ffn_hidden_size=512, max_seq_len=64)


def ops_of(dp, mp, cp=1, sp=False, pp=1):
    s = ParallelStrategy(dp=dp, tp=mp, cp=cp, pp=pp, sequence_parallel=sp,
                         pipeline=PipelineSpec(micro_batches=max(pp, 1)))
    p = plan(MODEL, s, TrainConfig(global_batch_size=dp * max(pp, 1), micro_batch_size=1, seq_len=64))
    return {o.op: o for o in lower(p).ops}


def mindformers(dp, mp, cp=1, sp=False):
    """MindFormers' strategies for one LLaMA layer and the head, as (inputs, out_strategy)."""
    mf = {
        "self_attn.q_proj.matmul": (((dp * cp, 1), (mp, 1)), None),
        "self_attn.k_proj.matmul": (((dp * cp, 1), (mp, 1)), None),
        "self_attn.v_proj.matmul": (((dp * cp, 1), (mp, 1)), None),
        "self_attn.o_proj.matmul": (((dp * cp, mp), (1, mp)), ((dp * cp * mp, 1),) if sp else ((dp * cp, 1),)),
        "self_attn.transpose": (((dp, cp, mp, 1),), None),
        "mlp.gate_proj.matmul": (((dp * cp, 1), (mp, 1)), None),        # w1
        "mlp.up_proj.matmul": (((dp * cp, 1), (mp, 1)), None),          # w3
        "mlp.down_proj.matmul": (((dp * cp, mp), (1, mp)), ((dp * mp, 1),) if sp else None),   # w2
        "mlp.mul": (((dp, cp, mp), (dp, cp, mp)), None),
    }
    if cp == 1:
        bmm = (((dp, mp, 1, 1), (dp, mp, 1, 1)), None)
        mf.update({
            "self_attn.batch_matmul_q_k": bmm, "self_attn.batch_matmul": bmm,
            "self_attn.softmax": (((dp, mp, 1, 1),), None),
            "self_attn.mul": (((dp, mp, 1, 1), ()), None),
            "self_attn.tile_kv": (((dp, mp, 1, 1),), None),
            "self_attn.merge_heads": (((dp, mp, 1, 1),), None),
        })
        norm = (dp, mp, 1) if sp else (dp, 1, 1)
        for n in ("input_layernorm", "post_attention_layernorm"):
            for prim in ("square", "mean", "rsqrt"):
                mf[f"{n}.{prim}"] = ((norm,), None)
            mf[f"{n}.add"] = ((norm, ()), None)
            mf[f"{n}.mul"] = ((norm, norm), None)
            mf[f"{n}.mul2"] = ((norm, (1,)), None)
        mf["add"] = (((dp, mp, 1), (dp, mp, 1)) if sp else ((dp, cp, 1), (dp, cp, 1)), None)
    return mf


def head(dp, mp, cp=1):
    """Embedding, lm_head and loss: vocab_emb_dp when mp = 1, vocab-parallel otherwise."""
    ld = dp * cp                                          # the loss's data parallel (dp * cp)
    out = {
        "model.embed_tokens.gather": ((1, 1), (dp, cp)) if mp == 1 else ((mp * cp, 1), (dp, 1)),
        "lm_head.matmul": ((dp * cp, 1), (1, 1)) if mp == 1 else ((dp * cp, 1), (mp, 1)),
        "loss.max": ((ld, mp),), "loss.sub": ((ld, mp), (ld, 1)), "loss.exp": ((ld, mp),),
        "loss.sum": ((ld, mp),), "loss.log": ((ld, 1),), "loss.sub2": ((ld, mp), (ld, 1)),
        "loss.onehot": ((ld, mp), (), ()), "loss.mul": ((ld, mp), (ld, mp)), "loss.neg": ((ld, mp),),
        "loss.sum2": ((ld, mp),),
    }
    return out


def check_layer(ours, expected):
    for layer in range(MODEL.num_layers):
        for name, (inputs, out) in expected.items():
            op = ours[f"model.layers.{layer}.{name}"]
            assert op.inputs == inputs, (name, op.inputs, inputs)
            if out is not None:
                assert op.output == out, (name, op.output, out)
            elif op.output is not None:       # MindFormers leaves the default: the all-reduced (dp*cp, 1)
                assert op.output == ((expected[name][0][0][0], 1),), name


@pytest.mark.parametrize("dp", [8, 2])
def test_data_parallel_llama2_7b_layout(dp):            # pretrain_llama2_7b.yaml: dp8, mp1, vocab_emb_dp
    ours = ops_of(dp, 1)
    check_layer(ours, mindformers(dp, 1))
    for name, inputs in head(dp, 1).items():
        assert ours[name].inputs == inputs, name


def test_tensor_parallel_without_sequence_parallel():
    ours = ops_of(2, 4)
    check_layer(ours, mindformers(2, 4))
    for name, inputs in head(2, 4).items():
        assert ours[name].inputs == inputs, name


def test_sequence_parallel_llama2_70b_layout():         # pretrain_llama2_70b.yaml: dp2 mp4 pp8 sp
    ours = ops_of(2, 4, sp=True, pp=2)
    check_layer(ours, mindformers(2, 4, sp=True))
    for name, inputs in head(2, 4).items():
        assert ours[name].inputs == inputs, name
    # MindFormers' final norm_out stays (dp, cp, 1); ours keeps the sequence-parallel layout of the
    # residual stream through the final norm (Megatron's choice) and gathers before lm_head.
    assert ours["model.norm.square"].inputs == ((2, 4, 1),)


def test_context_parallel_matmuls_and_merge_heads_layout():
    ours = ops_of(2, 2, cp=2)
    check_layer(ours, mindformers(2, 2, cp=2))
    assert ours["lm_head.matmul"].inputs == ((4, 1), (2, 1))
    # MindFormers: Layout((dp, cp, mp), ("dp", "cp", "mp"))("dp", "mp", "cp", "None") for merge_heads.
    (lay,) = ours["model.layers.0.self_attn.merge_heads"].inputs
    assert isinstance(lay, LayoutStrategy)
    assert lay.dev_matrix == (2, 2, 2)
    assert lay.dims == ((lay.names[0],), ("tp",), ("cp",), ())
    for name, inputs in head(2, 2, cp=2).items():
        if name.startswith("loss."):
            assert ours[name].inputs == inputs, name


def test_context_parallel_layout_is_mindformers_layout_in_mindspore():
    ms_parallel = pytest.importorskip("mindspore.parallel")
    (lay,) = ops_of(2, 2, cp=2)["model.layers.0.self_attn.merge_heads"].inputs
    mf = ms_parallel.Layout((2, 2, 2), ("dp", "cp", "mp"))("dp", "mp", "cp", "None").to_dict()
    got = lay.build().to_dict()
    assert (got["device_matrix"], got["tensor_map"], got["rank_list"]) == \
           (mf["device_matrix"], mf["tensor_map"], mf["rank_list"])
