"""ms_llm.run.loss_scale: the fp16 loss-scale policy both backends use (no framework)."""
from __future__ import annotations

import json

import pytest

from ms_llm.errors import TrainingDiverged
from ms_llm.run import LossScaler
from ms_llm.strategy.ir import PrecisionSpec


def dynamic(scale: float = 1024.0, growth_interval: int = 3) -> LossScaler:
    return LossScaler("dynamic", scale, growth_interval=growth_interval)


def test_from_precision():
    assert LossScaler.from_precision(PrecisionSpec(loss_scale="none")) is None
    s = LossScaler.from_precision(PrecisionSpec(param_dtype="float16", compute_dtype="float16",
                                                loss_scale="dynamic", initial_loss_scale=4096))
    assert (s.mode, s.scale, s.growth_interval, s.min_scale) == ("dynamic", 4096.0, 1000, 1.0)


def test_dynamic_halves_on_overflow_and_doubles_after_the_interval():
    s = dynamic()
    scales = []
    for finite in [False, False, True, True, True, True, False, True, True, True]:
        s.update(finite, step=len(scales) + 1)
        scales.append(s.scale)
    assert scales == [512, 256, 256, 256, 512, 512, 256, 256, 256, 512]
    assert s.skipped == 3 and s.good_steps == 0


def test_an_overflow_restarts_the_good_step_count():
    s = dynamic()
    for finite in [True, True, False, True, True]:
        s.update(finite, step=1)
    assert s.scale == 512 and s.good_steps == 2


def test_static_never_moves_but_counts_skips():
    s = LossScaler("static", 128.0)
    for finite in [False, True] * 1500:
        s.update(finite, step=1)
    assert s.scale == 128.0 and s.skipped == 1500


def test_overflow_at_the_minimum_scale_is_divergence_naming_the_step():
    s = dynamic(scale=4.0)
    s.update(False, step=10)
    s.update(False, step=11)
    assert s.scale == 1.0
    with pytest.raises(TrainingDiverged, match="step 12"):
        s.update(False, step=12)


def test_state_round_trips_through_json():
    s = dynamic()
    for finite in [False, True, True]:
        s.update(finite, step=1)
    resumed = dynamic(scale=65536.0)
    resumed.load_state(json.loads(json.dumps(s.state())))
    assert resumed == s


def test_load_state_keeps_the_start_without_a_record_and_a_configured_static_scale():
    fresh = dynamic()
    fresh.load_state(None)
    assert fresh == dynamic()
    static = LossScaler("static", 64.0)
    static.load_state(dynamic(scale=8.0).state() | {"skipped": 5})
    assert static.scale == 64.0 and static.skipped == 5
