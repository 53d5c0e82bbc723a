"""IntervalTask with real workers: two nodes x -c 2 share one 20 ms interval."""

from __future__ import annotations

import pytest

from tests.integration.conftest import CeleryRun, gaps_ms, inversions
from tests.timing import HOST_CLOCK_RERUNS, host_clock, host_gaps_at_least

# Real processes timed on the host clock of a 2-core shared machine: a rare scheduling
# spike of a few ms can delay one body past the bound. Such a test runs at most twice more
# (same tolerances; a real defect fails three times; pytest -ra lists every rerun).
pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]

TASKS, INTERVAL_MS = 200, 20


def assert_fidelity(starts: list[dict], tasks: int = TASKS) -> None:
    assert sorted(r["n"] for r in starts) == list(range(tasks)), "each task ran exactly once"
    gaps = gaps_ms(starts)
    host_gaps_at_least(gaps, 18.0)
    # Order holds for tickets that reach a worker by their slot; one the host delivers more
    # than an interval late is overtaken, by design (docs/design.md, "The guarantees").
    host_clock(inversions(starts) == 0, "a head delivered late was overtaken:\n" + _debug_dump(starts))
    times = sorted(r["t"] for r in starts)
    span = times[-1] - times[0]
    print(f"{len(starts)} starts, smallest gap {min(gaps):.2f} ms, span {span:.3f} s "
          f"(bound {1.05 * (tasks - 1) * INTERVAL_MS / 1000:.3f} s)")  # fmt: skip
    assert span <= 1.05 * (tasks - 1) * INTERVAL_MS / 1000


def test_two_prefork_nodes_share_one_interval(celery_run: CeleryRun) -> None:
    celery_run.start_workers(2, 2, "prefork")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    starts = celery_run.wait_for_count(TASKS)
    assert_fidelity(starts)
    assert {r["node"] for r in starts} == {"node0@siq-test", "node1@siq-test"}
    assert all(r["header_ticket"] == r["ticket"] for r in starts)  # the producer's tickets, none re-claimed


@pytest.mark.rabbitmq
def test_rabbitmq_broker_with_state_in_redis(celery_run: CeleryRun, amqp_url: str) -> None:
    celery_run.env["SIQ_TEST_BROKER"] = amqp_url
    celery_run.start_workers(2, 2, "prefork")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    assert_fidelity(celery_run.wait_for_count(TASKS))


def test_threads_pool(celery_run: CeleryRun) -> None:
    celery_run.start_workers(2, 2, "threads")
    record = celery_run.app.tasks["geo.record"]
    for n in range(TASKS):
        record.delay(n)
    assert_fidelity(celery_run.wait_for_count(TASKS))


def _debug_dump(starts: list[dict]) -> str:
    ordered = sorted(starts, key=lambda r: r["store_start_us"])
    t0 = ordered[0]["store_start_us"]
    return "\n".join(
        f"ticket {r['ticket']:4d} n {r['n']:4d} start +{(r['store_start_us'] - t0) / 1000:9.2f} "
        f"late {(r['store_start_us'] - r['slot_us']) / 1000:7.2f} ms node {r['node']} pid {r['pid']}"
        for r in ordered[:12]
    )
