"""The solo pool, and interval tasks inside Celery's canvas (chain, group, chord), with
real workers: every start still takes its turn in the queue's one interval."""

from __future__ import annotations

import itertools

import pytest
from celery import chain, chord, group

from tests.integration.conftest import CeleryRun, gaps_ms
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]

INTERVAL_MS = 20


def assert_spaced(starts: list[dict]) -> None:
    """The guarantee exactly, on the store's clock (authorized starts at least one interval
    apart); what the bodies saw on this host's clock within 0.9 of it (a rerunnable check)."""
    store = sorted(s["store_start_us"] for s in starts)
    store_gaps = [(b - a) / 1000 for a, b in itertools.pairwise(store)]
    assert not store_gaps or min(store_gaps) >= INTERVAL_MS, f"smallest authorized gap {min(store_gaps):.3f} ms"
    if len(starts) > 1:
        host_gaps_at_least(gaps_ms(starts), 0.9 * INTERVAL_MS)


def test_two_solo_nodes_share_one_interval(celery_run: CeleryRun) -> None:
    celery_run.start_workers(2, 1, "solo")
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(INTERVAL_MS / 1000, reset=True)
    for n in range(60):
        record.delay(n)
    starts = celery_run.wait_for_count(60)
    assert sorted(s["n"] for s in starts) == list(range(60)), "each task ran exactly once"
    assert {s["node"] for s in starts} == {"node0@siq-test", "node1@siq-test"}
    assert_spaced(starts)


def test_chain_group_and_chord_of_interval_tasks(celery_run: CeleryRun, redis_url: str) -> None:
    celery_run.env["SIQ_TEST_RESULTS"] = redis_url.rsplit("/", 1)[0] + "/4"  # a chord needs results
    celery_run.start_workers(2, 2)
    app = celery_run.app
    record, total = app.tasks["geo.record"], app.tasks["geo.total"]
    record.siq_queue().ensure(INTERVAL_MS / 1000, reset=True)

    # a chain: each link starts after the one before finished, each in its own slot
    assert chain(record.si(1), record.si(2), record.si(3)).apply_async().get(timeout=30) == 3
    # a group: ten starts spaced by the interval whichever process takes them
    assert sorted(group(record.si(n) for n in range(10, 20)).apply_async().get(timeout=30)) == list(range(10, 20))
    # a chord: the header's starts, then the callback (an interval task too) with their results
    assert chord(record.si(n) for n in range(100, 105))(total.s()).get(timeout=30) == sum(range(100, 105))

    starts = celery_run.starts()
    by_n = {s["n"]: s for s in starts}
    assert sorted(by_n) == [1, 2, 3, *range(10, 20), *range(100, 105), 510]
    assert len(starts) == len(by_n), "nothing ran twice"
    assert by_n[1]["t"] < by_n[2]["t"] < by_n[3]["t"]  # the chain's order
    assert by_n[510]["t"] > max(by_n[n]["t"] for n in range(100, 105))  # the callback after its header
    assert all(s["ticket"] is not None for s in starts)  # every start was authorized by the store
    assert_spaced(starts)
