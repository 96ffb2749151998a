import itertools
import math

import pytest

from kiln.config import SchedulerConfig
from kiln.train.schedule import lr_factor


def test_warmup_is_linear_to_peak():
    cfg = SchedulerConfig(name="cosine", warmup_steps=10)
    assert [lr_factor(cfg, s, 100) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]


@pytest.mark.parametrize("name", ["cosine", "linear", "rex", "wsd"])
def test_decays_from_peak_to_floor(name):
    cfg = SchedulerConfig(name=name, warmup_steps=10, min_lr_ratio=0.1, decay_ratio=0.2)
    factors = [lr_factor(cfg, s, 100) for s in range(10, 101)]
    assert factors[0] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(factors))


def test_cosine_midpoint():
    cfg = SchedulerConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(cfg, 50, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_wsd_is_flat_until_the_decay_phase():
    cfg = SchedulerConfig(name="wsd", warmup_steps=10, decay_ratio=0.2, min_lr_ratio=0.0)
    assert lr_factor(cfg, 80, 100) == 1.0
    assert lr_factor(cfg, 90, 100) == pytest.approx(0.5)


def test_constant_and_none():
    assert lr_factor(SchedulerConfig(name="constant", warmup_steps=4), 2, 10) == 0.5
    assert lr_factor(SchedulerConfig(name="constant", warmup_steps=4), 9, 10) == 1.0
    assert lr_factor(SchedulerConfig(name="none", warmup_steps=0), 1, 10) == 1.0
