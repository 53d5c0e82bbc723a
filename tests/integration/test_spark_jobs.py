"""Spark jobs on the same interval queues as real Celery workers (PySpark local[2])."""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import pytest

from siq_celery import IntervalQueue
from siq_celery.spark import interval_map, submit_dataframe
from tests.integration.conftest import CeleryRun

pytestmark = [pytest.mark.spark, pytest.mark.processes, pytest.mark.slow]


def stamp(row: Any) -> tuple[int, float]:
    return int(row["n"]), time.time()


@pytest.mark.flaky(reruns=int(os.environ.get("SIQ_RERUNS", "2")))  # host-clock gaps, 2 shared cores
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
    ledger = sorted(ledger_of.ledger(), key=lambda r: r.start_us)
    store_gaps = [(b.start_us - a.start_us) / 1000 for a, b in itertools.pairwise(ledger)]
    names = {r.task_name for r in ledger}
    print(f"\ninterval_map: 60 rows + 60 Celery tasks, smallest gap {min(gaps):.2f} ms (host), "
          f"{min(store_gaps):.2f} ms (store), ledger names {sorted(names)}")  # fmt: skip
    assert len(ledger) == 120 and names == {"spark.stamp", "geo.record"}
    assert min(store_gaps) >= 20.0
    assert min(gaps) >= 18.0
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
    ledger = list(IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"]).ledger())
    assert len(ledger) == rows and len({r.task_id for r in ledger}) == rows
