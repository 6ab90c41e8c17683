"""The torch lowering reads the plan: TP styles follow the layouts, pipeline chunks follow the
stage map (what it refuses and which engine it picks: tests/test_support.py). No processes needed."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from ms_llm.config.job import job_from_dict
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.model import Transformer
from torch_backend.parallelize.tp import tp_styles
from torch_backend.pipeline import cut_chunk

MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             max_seq_len=16, dtype="float32")


def plan_for(strategy: dict, world: int, model: dict = MODEL, **train):
    job = job_from_dict({"model": model, "strategy": strategy,
                         "train": {"global_batch_size": 8, "seq_len": 16, **train}})
    return make_plan(job.model, job.strategy, job.train, world)


def meta_model(p):
    with torch.device("meta"):
        return Transformer(p.model)


def test_tp_styles_follow_layouts_with_sequence_parallel():
    p = plan_for({"tp": 2, "sequence_parallel": True}, 2)
    styles = tp_styles(p, meta_model(p))
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


def test_tp_styles_without_sequence_parallel():
    p = plan_for({"tp": 2}, 2)
    styles = tp_styles(p, meta_model(p))
    assert not any(isinstance(s, (SequenceParallel, PrepareModuleInput)) for s in styles.values())
    assert styles["model.layers.0.self_attn.o_proj"].output_layouts == (Replicate(),)
    assert len(styles) == 2 + 4 * 7          # embedding, head, 7 linears per layer


def test_tp_styles_of_a_pipeline_stage_cover_only_its_modules():
    p = plan_for({"tp": 2, "pp": 2, "sequence_parallel": True}, 4)
    with torch.device("meta"):
        last = cut_chunk(p.model, p.chunks[1])
    styles = tp_styles(p, last)
    assert "model.embed_tokens" not in styles and "lm_head" in styles
    assert {k.split(".")[2] for k in styles if k.startswith("model.layers.")} == {"2", "3"}


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
