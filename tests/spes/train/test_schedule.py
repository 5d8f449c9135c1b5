"""The inner learning-rate schedule (spes/train/schedule.py): exact values of the cosine and wsd schedules."""
import pytest

from spes.config.schema import OptimConfig
from spes.train.schedule import lr_at, stable_end


def test_lr_schedule():
    c = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, c, 110) == pytest.approx(0.1) and lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.55) and lr_at(110, c, 110) == pytest.approx(0.1)


def test_the_wsd_schedule_warms_up_holds_then_decays_linearly():
    o = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=2, schedule="wsd", decay_fraction=0.25)
    assert stable_end(o, 100) == 75
    assert [lr_at(s, o, 100) for s in (0, 1, 2, 74)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_at(75, o, 100) == 1.0 and lr_at(100, o, 100) == pytest.approx(0.1)
    assert lr_at(80, o, 100) == pytest.approx(1.0 - 0.9 * 5 / 25)
    assert lr_at(80, o, 200) == 1.0  # a longer run: still stable at that step
