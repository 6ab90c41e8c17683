"""The Ascend worker's training cell builds under semi_auto_parallel from the lowering, for
pipeline, gradient accumulation and ZeRO plans (compiling it needs Ascend)."""
import pytest

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from mindspore import nn

from ms_llm.config.job import job_from_dict
from ms_llm.mindspore.apply import set_context
from ms_llm.mindspore.auto_worker import build_train_cell, logging_rank
from ms_llm.mindspore.lower import lower
from ms_llm.strategy.plan import plan

MODEL = {"vocab_size": 96, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 128, "max_seq_len": 32}


@pytest.fixture(autouse=True)
def clean_context():
    yield
    ms.reset_auto_parallel_context()


@pytest.mark.parametrize("strategy,body", [
    ({"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True}, nn.PipelineCell),
    ({"dp": 2, "tp": 2, "recompute": {"policy": "full"}}, nn.GradAccumulationCell),
    ({"dp": 4, "zero": {"stage": 1}}, type(None)),
])
def test_train_cell_builds_under_the_lowering(strategy, body):
    job = job_from_dict({"model": MODEL, "strategy": strategy,
                         "train": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "steps": 3}})
    low = lower(plan(job.model, job.strategy, job.train))
    set_context(low)
    cell = build_train_cell(job, low)
    assert isinstance(cell, nn.TrainOneStepCell)
    if body is not type(None):
        assert isinstance(cell.network, body)
    assert ms.get_auto_parallel_context("parallel_mode") == "semi_auto_parallel"
    assert ms.get_auto_parallel_context("enable_parallel_optimizer") == (low.plan.zero.stage > 0)
    assert logging_rank(low.plan) == low.plan.world_size - low.plan.world_size // low.plan.strategy.pp
