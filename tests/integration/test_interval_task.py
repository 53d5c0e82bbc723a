"""IntervalTask with real workers: two nodes x -c 2 share one 50 ms interval.

At 50 ms, not 20: a body starts when the store's reply reaches its process, and on this
2-core host that delay reached 2-2.5 ms now and then (median 0.4 ms), which alone put a
gap of 20 ms bodies below 0.9 I (17.73 and 17.97 ms) in three attempts running, on
2026-11-26, at this commit and at earlier ones alike. The tolerance stays 0.9 I; the
rates at 20, 10, 5 and 2 ms are measured in bench/ (BENCHMARKS.md), not asserted here."""

from __future__ import annotations

import itertools

import pytest

from siq_celery import IntervalQueue
from tests.integration.conftest import CeleryRun, gaps_ms, inversions, overtaken_on_time, used_starts
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

# Real processes timed on the host clock of a 2-core shared machine: a rare scheduling
# spike of a few ms can delay one body past the bound. Such a test runs at most three times more
# (same tolerances; a real defect fails three times; pytest -ra lists every rerun).
pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]

TASKS, INTERVAL_MS = 80, 50


def assert_fidelity(starts: list[dict], preruns: list[dict], tasks: int = TASKS) -> None:
    assert sorted(r["n"] for r in starts) == list(range(tasks)), "each task ran exactly once"
    gaps = gaps_ms(starts)
    host_gaps_at_least(gaps, 0.9 * INTERVAL_MS)
    # Order holds for tickets that reach the gate by their slot; one the host delivers
    # after the next ticket's slot is overtaken, by design
    # (docs/design.md, "The guarantees"): such inversions are counted, any other fails.
    wrong = overtaken_on_time(starts, preruns)
    host_clock(not wrong, "overtaken at the gate:\n" + "\n".join(wrong) + "\n" + _debug_dump(starts))
    print(f"{inversions(starts)} inversion(s), each a head delivered late")
    times = sorted(r["t"] for r in starts)
    span = times[-1] - times[0]
    print(f"{len(starts)} starts, smallest gap {min(gaps):.2f} ms, span {span:.3f} s "
          f"(bound {1.05 * (tasks - 1) * INTERVAL_MS / 1000:.3f} s)")  # fmt: skip
    # The rate is the host's clock too: a stall of the loaded CI host (after 40 minutes of
    # suite, 4.207 s against 4.03-4.09 s here idle and loaded) is rerun like a gap.
    bound = 1.05 * (tasks - 1) * INTERVAL_MS / 1000
    host_clock(span <= bound, f"span of {tasks} starts {span:.3f} s > {bound:.3f} s")


@pytest.fixture
def celery_run(celery_run: CeleryRun) -> CeleryRun:
    celery_run.env["SIQ_TEST_TRACE_PRERUN"] = "1"  # when each task reached the gate
    celery_run.env["SIQ_TEST_INTERVAL"] = f"{INTERVAL_MS}ms"
    return celery_run


def test_two_prefork_nodes_share_one_interval(celery_run: CeleryRun) -> None:
    celery_run.start_workers(2, 2, "prefork")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    starts = celery_run.wait_for_count(TASKS)
    assert_fidelity(starts, celery_run.preruns())
    assert {r["node"] for r in starts} == {"node0@siq-test", "node1@siq-test"}
    assert all(r["header_ticket"] == r["ticket"] for r in starts)  # the producer's tickets, none re-claimed
    # The ledger keeps each body's report beside its authorization (schema 5), on the store's
    # clock: the bodies' starts there are an interval apart, as the authorizations are.
    ledger = used_starts(IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"]).ledger())
    assert len(ledger) == TASKS and all(r.began_us is not None and r.began_us >= r.start_us for r in ledger)
    began = sorted(r.began_us for r in ledger)
    assert min(b - a for a, b in itertools.pairwise(began)) >= INTERVAL_MS * 1000


@pytest.mark.rabbitmq
def test_rabbitmq_broker_with_state_in_redis(celery_run: CeleryRun, amqp_url: str) -> None:
    celery_run.env["SIQ_TEST_BROKER"] = amqp_url
    celery_run.start_workers(2, 2, "prefork")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    assert_fidelity(celery_run.wait_for_count(TASKS), celery_run.preruns())


def test_threads_pool(celery_run: CeleryRun) -> None:
    celery_run.start_workers(2, 2, "threads")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    assert_fidelity(celery_run.wait_for_count(TASKS), celery_run.preruns())


def _debug_dump(starts: list[dict]) -> str:
    ordered = sorted(starts, key=lambda r: r["store_start_us"])
    t0 = ordered[0]["store_start_us"]
    return "\n".join(
        f"ticket {r['ticket']:4d} n {r['n']:4d} start +{(r['store_start_us'] - t0) / 1000:9.2f} "
        f"late {(r['store_start_us'] - r['slot_us']) / 1000:7.2f} ms node {r['node']} pid {r['pid']}"
        for r in ordered[:12]
    )
