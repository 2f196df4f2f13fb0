"""Leases on a service's per-sequence state (specdecode.serving.leases), on a clock the test
moves."""

from __future__ import annotations

import pytest

from specdecode.serving.leases import Leases


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_ends_only_when_nobody_touched_it_for_its_time():
    clock = Clock()
    leases = Leases(10.0, clock=clock)
    leases.touch([1, 2, 3])
    clock.now += 6
    leases.touch([2])  # renewed
    assert leases.expired() == []
    clock.now += 4.5  # 10.5 s after 1 and 3, 4.5 s after 2
    assert leases.expired() == [1, 3]
    assert len(leases) == 1
    clock.now += 6
    assert leases.expired() == [2]
    assert leases.expired() == [] and len(leases) == 0


def test_released_sequences_have_no_lease():
    clock = Clock()
    leases = Leases(1.0, clock=clock)
    leases.touch([1, 2])
    leases.forget([1, 7])  # unknown ids are ignored
    clock.now += 2
    assert leases.expired() == [2]


def test_beyond_the_cap_the_least_recent_lease_ends_early():
    leases = Leases(60.0, max_leases=3, clock=Clock())
    leases.touch([1, 2, 3, 4, 5])
    leases.touch([1])
    assert leases.expired() == [2, 3]  # 4, 5, 1 remain: the most recently touched
    assert len(leases) == 3


def test_the_check_interval_bounds_the_overrun():
    assert Leases(2.0).check_interval == 0.5
    assert Leases(300.0).check_interval == 5.0


def test_a_lease_needs_a_positive_time():
    with pytest.raises(ValueError, match="--sequence-lease-seconds"):
        Leases(0.0)
