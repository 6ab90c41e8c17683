"""lr_at's warmup both ways, against the rates measured with each peer's own scheduler (warmup 4,
peak 1.0): torchtitan 0.3's LambdaLR runs update k at k/4; Megatron-LM's OptimizerParamScheduler and
MindFormers' CosineWithWarmUpLR / LinearWithWarmUpLR at (k-1)/4. From update 5 on all three agree."""
import pytest

from ms_llm.config.train import TrainConfig
from ms_llm.job import job_from_dict
from ms_llm.run import lr_at

MEASURED = {False: [0.25, 0.5, 0.75, 1.0, 1.0], True: [0.0, 0.25, 0.5, 0.75, 1.0]}


def train(warmup_from_zero: bool, decay: str = "constant") -> TrainConfig:
    return job_from_dict({"name": "lr", "model": "tiny",
                          "train": {"steps": 12, "optimizer": {"lr": 1.0},
                                    "schedule": {"warmup_steps": 4, "decay": decay, "min_lr_ratio": 0.1,
                                                 "warmup_from_zero": warmup_from_zero}}}).train


@pytest.mark.parametrize("from_zero", [False, True])
def test_warmup_rates_equal_the_measured_table(from_zero):
    t = train(from_zero)
    assert [lr_at(update - 1, t) for update in range(1, 6)] == MEASURED[from_zero]


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_the_flag_changes_warmup_only(decay):
    late, zero = train(False, decay), train(True, decay)
    assert [lr_at(s, late) for s in range(4, 12)] == [lr_at(s, zero) for s in range(4, 12)]
    assert lr_at(4, zero) == 1.0 and lr_at(11, zero) < 1.0
