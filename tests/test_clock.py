"""A worker's clock measured against the store's, and ETAs read on the store's clock."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

import pytest

from siq_celery.clock import ClockWatch, StoreClockRequest
from siq_celery.tasks.task import IntervalTask

ETA = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
STORE_NOW_US = 1_800_000_000_000_000


@pytest.mark.parametrize(("skew", "shift"), [(0.0, 0.0), (0.9, 0.0), (-0.9, 0.0), (180.0, 180.0), (-180.0, -180.0)])
def test_an_eta_is_moved_by_the_skew_only_beyond_a_second(skew: float, shift: float) -> None:
    watch = ClockWatch()
    assert watch.observe(STORE_NOW_US, local_now=STORE_NOW_US / 1e6 + skew) == pytest.approx(skew)
    assert watch.local_eta(ETA) == ETA + timedelta(seconds=shift)
    assert watch.local_eta(None) is None


def test_a_skewed_clock_is_reported_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    watch = ClockWatch()
    with caplog.at_level(logging.WARNING, logger="siq_celery"):
        for _ in range(5):
            watch.observe(STORE_NOW_US, local_now=STORE_NOW_US / 1e6 - 120)
    assert caplog.text.count("120.0 s behind the state store's") == 1


def test_interval_tasks_read_their_eta_through_the_store_clock_request() -> None:
    assert IntervalTask.Request == "siq_celery.clock:StoreClockRequest"
    assert isinstance(StoreClockRequest.eta, property)


@pytest.mark.parametrize("skew", [0.0, 0.9, -180.0, 180.0])
def test_store_time_is_the_host_clock_corrected_beyond_a_second(monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    watch = ClockWatch()
    monkeypatch.setattr(time, "time", lambda: STORE_NOW_US / 1e6 + skew)
    watch.observe(STORE_NOW_US)
    assert watch.store_time() == pytest.approx(STORE_NOW_US / 1e6 + (skew if abs(skew) <= 1.0 else 0.0))


@pytest.mark.parametrize("step", [180.0, -180.0])
def test_a_step_of_the_host_clock_is_followed_at_once_not_at_the_next_reading(
    monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    """The skew read against the store, then the wall clock steps (the monotonic clock does
    not): the correction follows the step before the store is read again."""
    watch = ClockWatch()
    real = time.time
    watch.observe(int(real() * 1e6))  # host and store agree
    assert watch.current_skew() == 0.0 and watch.local_eta(ETA) == ETA
    monkeypatch.setattr(time, "time", lambda: real() + step)
    assert watch.current_skew() == pytest.approx(step, abs=0.05)
    assert watch.store_time() == pytest.approx(real(), abs=0.05)
    eta = watch.local_eta(ETA)
    assert eta is not None and (eta - ETA).total_seconds() == pytest.approx(step, abs=0.05)
    watch.observe(int(real() * 1e6))  # the next reading measures the same skew: no double count
    assert watch.current_skew() == pytest.approx(step, abs=0.05)
