"""Spark jobs on the same interval queues as real Celery workers (PySpark local[2])."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest

from siq_celery import IntervalQueue
from siq_celery.spark import interval_map, submit_dataframe
from tests.integration.conftest import CeleryRun, used_starts
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.spark, pytest.mark.processes, pytest.mark.slow]


def stamp(row: Any) -> tuple[int, float]:
    return int(row["n"]), time.time()


@HOST_CLOCK_RERUNS  # host-clock gaps, 2 shared cores
def test_interval_map_and_a_celery_worker_share_one_interval(celery_run: CeleryRun, spark: Any) -> None:
    celery_run.start_workers(1, 2)
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.02, reset=True)
    df = spark.createDataFrame([(n,) for n in range(60)], ["n"]).repartition(2)
    spark_results: list[tuple[int, float]] = []

    def run_spark() -> None:
        rdd = interval_map(df, stamp, queue="geo", url=celery_run.env["SIQ_TEST_STORE"], name="spark.stamp")
        spark_results.extend(rdd.collect())

    job = threading.Thread(target=run_spark)
    job.start()
    ledger_of = IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"])
    deadline = time.monotonic() + 60
    while not any(True for _ in ledger_of.ledger()):  # Spark's executors are at work
        assert time.monotonic() < deadline and job.is_alive()
        time.sleep(0.05)
    for n in range(60):  # Celery tasks keep arriving while the Spark job runs
        record.delay(1000 + n)
        time.sleep(0.03)
    job.join(120)
    starts = celery_run.wait_for_count(60)

    assert sorted(n for n, _ in spark_results) == list(range(60))  # every row once
    assert sorted(r["n"] for r in starts) == [1000 + n for n in range(60)]
    times = sorted([t for _, t in spark_results] + [r["t"] for r in starts])
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    ledger = sorted(used_starts(ledger_of.ledger()), key=lambda r: r.start_us)
    store_gaps = [(b.start_us - a.start_us) / 1000 for a, b in itertools.pairwise(ledger)]
    names = {r.task_name for r in ledger}
    print(f"\ninterval_map: 60 rows + 60 Celery tasks, smallest gap {min(gaps):.2f} ms (host), "
          f"{min(store_gaps):.2f} ms (store), ledger names {sorted(names)}")  # fmt: skip
    assert len(ledger) == 120 and names == {"spark.stamp", "geo.record"}
    assert min(store_gaps) >= 20.0
    host_gaps_at_least(gaps, 18.0)
    # interleaved, not one after the other
    by_time = [name for name in (r.task_name for r in ledger)]
    assert sum(a != b for a, b in itertools.pairwise(by_time)) > 10


def test_submit_dataframe_publishes_every_row_once_in_bulk_claims(celery_run: CeleryRun, spark: Any) -> None:
    celery_run.env["SIQ_TEST_INTERVAL"] = "2ms"
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.002, reset=True)
    rows = 3_000  # six bulk claims; every row run once is the point, not the volume
    df = spark.range(rows).withColumnRenamed("id", "n").repartition(2)
    started = time.monotonic()
    report = submit_dataframe(df, record, args=["n"], chunk_size=500)
    took = time.monotonic() - started
    print(f"\nsubmit_dataframe: {report} in {took:.1f} s ({rows / took:,.0f} rows/s)")
    assert report.published == rows and report.failed == 0
    assert report.claims == 6 and [p.claims for p in report.partitions] == [3, 3]  # 500 rows per round trip
    starts = celery_run.wait_for_count(rows, timeout=150)
    assert len(starts) == rows  # none ran twice
    assert all(r["header_ticket"] is not None for r in starts)  # each carried its bulk-claimed ticket
    ledger = used_starts(IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"]).ledger())
    assert len(ledger) == rows and len({r.task_id for r in ledger}) == rows


def test_a_two_hour_backlog_from_a_dataframe_is_parked_not_held_by_workers(celery_run: CeleryRun, spark: Any) -> None:
    """1,440 rows at 5 s: two hours of slots. With a 3 s horizon all but the first wait
    parked in the store; the workers hold none of them. Then an operator raises the rate
    (an override of 10 ms) and every row runs once, released by the workers in time."""
    celery_run.env.update(SIQ_TEST_INTERVAL="5s", SIQ_TEST_HORIZON="3", SIQ_TEST_RELEASE_EVERY="0.5")
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    queue = record.siq_queue()
    queue.ensure(5.0, reset=True)
    _, rss_before = celery_run.held_by_workers()
    rows = 1_440
    report = submit_dataframe(spark.range(rows).withColumnRenamed("id", "n").repartition(2), record, args=["n"])
    time.sleep(2.0)  # the workers have received whatever they were sent
    held, rss_after = celery_run.held_by_workers()
    parked = queue.status().parked
    print(f"\nsubmit_dataframe, 2 h of backlog: {report}; in the store {parked}, held by workers {held}, "
          f"workers' RSS {rss_before:.1f} -> {rss_after:.1f} MB")  # fmt: skip
    assert report.published == rows and report.failed == 0
    assert report.parked >= rows - 2 and parked >= rows - 3  # one slot in 3 s, and the upkeep releases it
    assert held <= 2
    assert rss_after - rss_before < 10.0
    celery_run.siq("set-interval", "geo", "10ms")
    starts = celery_run.wait_for_count(rows, timeout=150)
    assert sorted(r["n"] for r in starts) == list(range(rows))  # every row once
    ordered = sorted(starts, key=lambda r: r["store_start_us"])
    assert min(b["store_start_us"] - a["store_start_us"] for a, b in itertools.pairwise(ordered)) >= 10_000
    assert queue.status().parked == 0


def test_submit_dataframe_claims_in_each_rows_queue_with_its_cost(celery_run: CeleryRun, spark: Any) -> None:
    """A per-key task claims in each row's key queue, a weighted one with each row's cost:
    one round trip per queue of a chunk, tickets as apply_async would give them."""
    celery_run.env["SIQ_TEST_INTERVAL"] = "30ms"
    celery_run.start_workers(1, 2)
    store = celery_run.env["SIQ_TEST_STORE"]
    per_key = celery_run.app.tasks["geo.per_key"]
    shops = spark.createDataFrame([(n, "ab"[n % 2]) for n in range(40)], ["n", "shop"]).coalesce(1)
    keyed = submit_dataframe(shops, per_key, args=["n"], kwargs=["shop"])
    weighted = celery_run.app.tasks["geo.weighted"]
    costs = [3, 1, 2, 1, 1, 3, 2, 1, 1, 1]
    rows = spark.createDataFrame([(100 + n, c) for n, c in enumerate(costs)], ["n", "cost"]).coalesce(1)
    costed = submit_dataframe(rows, weighted, args=["n"], kwargs=["cost"])
    print(f"\nper-key: {keyed}; weighted: {costed}")
    assert keyed.published == 40 and keyed.claims == 2  # one chunk, two queues
    assert costed.published == 10 and costed.claims == 1
    starts = celery_run.wait_for_count(50, timeout=60)
    for shop in "ab":
        ledger = sorted(used_starts(IntervalQueue(f"shop:{shop}", url=store).ledger()), key=lambda r: r.start_us)
        assert len(ledger) == 20 and len({r.ticket for r in ledger}) == 20
        assert min(b.start_us - a.start_us for a, b in itertools.pairwise(ledger)) >= 30_000
    by_n = {r["n"]: r for r in starts if r["n"] >= 100}
    tickets = [by_n[100 + i]["header_ticket"] for i in range(len(costs))]
    assert [b - a for a, b in itertools.pairwise(tickets)] == costs[:-1]  # a cost-c row holds c tickets
    geo = sorted(IntervalQueue("geo", url=store).ledger(), key=lambda r: r.start_us)
    cost_of = {r["task_id"]: costs[r["n"] - 100] for r in by_n.values()}
    assert all(b.start_us - a.start_us >= 30_000 * cost_of[a.task_id] for a, b in itertools.pairwise(geo))
