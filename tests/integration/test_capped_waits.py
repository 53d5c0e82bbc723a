"""A start held by a full concurrency cap does not busy-loop through the broker: woken when a
lease comes back, it waits in its process up to gate.FULL_HOLD_MAX_S before a re-publish (and
starts soon after the lease comes back)."""

from __future__ import annotations

import time

import pytest

from tests.apps.geo import REPUBLISHES
from tests.integration.conftest import CeleryRun

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def test_a_start_held_by_a_full_cap_is_not_re_published_every_max_sleep(celery_run: CeleryRun) -> None:
    # Re-publishes counted ("0@0": none refused); each deferral's line at DEBUG, counted too.
    celery_run.env.update(SIQ_TEST_CONCURRENCY="1", SIQ_TEST_REFUSE_REPUBLISHES="0@0", SIQ_TEST_DEBUG_SIQ="1")
    celery_run.start_workers(1, 2)
    task = celery_run.app.tasks["geo.capped"]
    task.apply_async((0,), {"work": 3.0})
    celery_run.wait_for_count(1, timeout=30)
    time.sleep(0.1)
    task.apply_async((1,))
    starts = celery_run.wait_for_count(2, timeout=30)
    republished = int(celery_run.records.get(REPUBLISHES) or 0)
    first, second = sorted(starts, key=lambda s: s["n"])
    late = second["t"] - (first["t"] + 3.0)
    print(f"\ncap 1, a 3 s body: the waiting task was re-published {republished} times, and started "
          f"{late:.2f} s after the body ended")  # fmt: skip
    # Woken by the lease given back, it holds gate.FULL_HOLD_MAX_S from its first delivery: a
    # 3 s body costs 1 re-publish (4 while it polled, doubling its hold; 20-23 before that).
    assert republished <= 2, "no busy loop through the broker"
    logged = celery_run.workers[0].log().count(" deferred ")
    assert logged == republished, "each deferral has its DEBUG line (SIQ_TEST_DEBUG_SIQ: the tests that count them)"
    assert late < 0.5, "it starts soon after the lease comes back (woken: 0.01 s measured)"
