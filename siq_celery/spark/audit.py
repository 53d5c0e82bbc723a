"""``siq audit``: prove from a ledger that an interval held, with PySpark.

    siq audit LEDGER... --out DIR [--master local[*]] [--tolerance 1ms]
    spark-submit --master yarn $(python -c 'import siq_celery.spark.audit as a; print(a.__file__)') \\
        hdfs:///ledgers/2026-11-*.parquet --out hdfs:///audits/2026-11

Reads ledger files written by ``siq export`` (JSON Lines or Parquet, any path Spark can
read: local, HDFS, S3 with the cluster's connector; globs work) and writes, per queue:

* ``summary``: starts, achieved rate against 1/interval, gap and lateness percentiles,
  violations (a start less than ``interval - tolerance`` after the one before it, on the
  store's clock), order inversions (a start whose ticket is lower than one started
  before it in the same epoch), duplicate starts of one task id, tickets never started
  (within each epoch, numbers between the first and last started ticket with no start),
  unfinished and failed starts, epochs and workers;
* ``by_day`` and ``by_hour``: the same figures per UTC day and hour;
* ``gaps``: the gap histogram (gap / interval, bins of 0.05); ``rate``: starts over time
  in about 60 buckets; ``workers``: starts per worker host and process;
* ``violations`` and ``duplicates``: the offending rows themselves.

Each is a Parquet table under DIR; ``report.json`` holds all but the last two, and
``report.html`` shows them with charts, self-contained (no scripts, no network).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from siq_celery.intervals import parse_duration
from siq_celery.ledger import SCHEMA_VERSION

GAP_BIN = 0.05  # histogram bins, in intervals
GAP_BINS_MAX = 60  # gaps of 3 intervals or more share the last bin
RATE_BUCKETS = 60


def spark_session(master: str | None = None, app_name: str = "siq audit") -> Any:
    """A session for the audit (``master=None``: whatever spark-submit configured)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")  # siq audit prints its own progress
    )
    if master and master.startswith("local"):
        # One machine: executors run this Python (with siq_celery and Celery installed), and
        # a few shuffle partitions do, not the cluster default of 200.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = (
            builder.master(master)
            .config("spark.ui.enabled", "false")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.shuffle.partitions", "8")
        )
    elif master:
        builder = builder.master(master)
    return builder.getOrCreate()


def ledger_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType([
        T.StructField("queue", T.StringType()), T.StructField("epoch", T.StringType()),
        T.StructField("ticket", T.LongType()), T.StructField("task_id", T.StringType()),
        T.StructField("task_name", T.StringType()), T.StructField("slot_us", T.LongType()),
        T.StructField("start_us", T.LongType()), T.StructField("interval_us", T.LongType()),
        T.StructField("finish_us", T.LongType()), T.StructField("outcome", T.StringType()),
        T.StructField("deferrals", T.IntegerType()), T.StructField("host", T.StringType()),
        T.StructField("pid", T.IntegerType()), T.StructField("v", T.ShortType()),
    ])  # fmt: skip


def read_ledger(spark: Any, paths: Sequence[str], fmt: str | None = None) -> Any:
    """One DataFrame of every ledger row in ``paths`` (Parquet and JSON Lines may be mixed)."""
    from pyspark.sql import functions as F

    frames = []
    for kind in ("parquet", "json"):
        chosen = [p for p in paths if (fmt or _format_of(p)) == kind]
        if chosen:
            reader = spark.read.schema(ledger_schema())
            frames.append(reader.parquet(*chosen) if kind == "parquet" else reader.json(chosen))
    df = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    newer = df.filter(F.col("v") > SCHEMA_VERSION).limit(1).collect()
    if newer:
        raise ValueError(f"ledger schema version {newer[0]['v']} is newer than this siq audit ({SCHEMA_VERSION})")
    return df


def _format_of(path: str) -> str:
    lowered = path.lower().rstrip("/")
    return "json" if lowered.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")) else "parquet"


def audit(df: Any, tolerance_us: int = 1000) -> dict[str, Any]:
    """Every audit table of ``df`` (ledger rows), as Spark DataFrames, by name."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    in_time = Window.partitionBy("queue").orderBy("start_us", "ticket")
    in_epoch = Window.partitionBy("queue", "epoch").orderBy("start_us", "ticket")
    rows = (
        df.withColumn("prev_start_us", F.lag("start_us").over(in_time))
        .withColumn("gap_us", F.col("start_us") - F.col("prev_start_us"))
        .withColumn("violation", (F.col("gap_us") < F.col("interval_us") - tolerance_us).cast("int"))
        .withColumn("highest_before", F.max("ticket").over(in_epoch.rowsBetween(Window.unboundedPreceding, -1)))
        .withColumn("inversion", F.coalesce((F.col("ticket") < F.col("highest_before")).cast("int"), F.lit(0)))
        .withColumn("lateness_us", F.col("start_us") - F.col("slot_us"))
        .withColumn("day", F.date_format(F.expr("timestamp_micros(start_us)"), "yyyy-MM-dd"))
        .withColumn("hour", F.date_format(F.expr("timestamp_micros(start_us)"), "yyyy-MM-dd HH:00"))
        .cache()
    )

    duplicates = (
        rows.filter(F.col("task_id").isNotNull())
        .groupBy("queue", "task_id")
        .agg(F.count("*").alias("starts"), F.collect_list("ticket").alias("tickets"))
        .filter(F.col("starts") > 1)
    )
    missing = (
        rows.groupBy("queue", "epoch")
        .agg((F.max("ticket") - F.min("ticket") + 1 - F.countDistinct("ticket")).alias("missing_tickets"))
        .groupBy("queue")
        .agg(F.sum("missing_tickets").alias("missing_tickets"), F.count("*").alias("epochs"))
    )
    dup_per_queue = duplicates.groupBy("queue").agg(F.sum(F.col("starts") - 1).alias("duplicate_starts"))

    def figures(*keys: str) -> Any:
        return rows.groupBy(*keys).agg(
            F.count("*").alias("starts"),
            F.min("start_us").alias("first_start_us"),
            F.max("start_us").alias("last_start_us"),
            F.avg("interval_us").alias("mean_interval_us"),
            F.sum("violation").alias("violations"),
            F.sum("inversion").alias("inversions"),
            (F.min("gap_us") / 1000).alias("min_gap_ms"),
            (F.percentile_approx("gap_us", 0.5, 10_000) / 1000).alias("gap_p50_ms"),
            (F.percentile_approx("gap_us", 0.01, 10_000) / 1000).alias("gap_p01_ms"),
            (F.percentile_approx("lateness_us", 0.5, 10_000) / 1000).alias("lateness_p50_ms"),
            (F.percentile_approx("lateness_us", 0.99, 10_000) / 1000).alias("lateness_p99_ms"),
            (F.max("lateness_us") / 1000).alias("lateness_max_ms"),
            F.sum(F.col("finish_us").isNull().cast("int")).alias("unfinished"),
            F.sum((F.col("outcome") == "FAILURE").cast("int")).alias("failures"),
            F.countDistinct("host").alias("worker_hosts"),
        )

    def with_rates(table: Any) -> Any:
        span_s = (F.col("last_start_us") - F.col("first_start_us")) / 1e6
        return (
            table.withColumn("achieved_rate", F.when(span_s > 0, (F.col("starts") - 1) / span_s))
            .withColumn("target_rate", 1e6 / F.col("mean_interval_us"))
            .withColumn("rate_pct", F.round(100 * F.col("achieved_rate") / F.col("target_rate"), 2))
        )

    summary = (
        with_rates(figures("queue"))
        .join(missing, "queue", "left")
        .join(dup_per_queue, "queue", "left")
        .fillna(0, ["duplicate_starts", "missing_tickets"])
    )
    gaps = (
        rows.filter(F.col("gap_us").isNotNull())
        .withColumn("bin", F.least(F.floor(F.col("gap_us") / F.col("interval_us") / GAP_BIN), F.lit(GAP_BINS_MAX)))
        .groupBy("queue", "bin")
        .count()
        .withColumn("from_intervals", F.col("bin") * GAP_BIN)
    )
    span = rows.groupBy("queue").agg(F.min("start_us").alias("t0"), F.max("start_us").alias("t1"))
    bucket_us = F.greatest(F.ceil((F.col("t1") - F.col("t0") + 1) / RATE_BUCKETS), F.lit(1))
    rate = (
        rows.join(span, "queue")
        .withColumn("bucket_us", bucket_us)
        .withColumn("bucket", F.floor((F.col("start_us") - F.col("t0")) / F.col("bucket_us")))
        .groupBy("queue", "bucket", "bucket_us", "t0")
        .agg(F.count("*").alias("starts"), F.avg("interval_us").alias("mean_interval_us"))
        .withColumn("bucket_start_us", F.col("t0") + F.col("bucket") * F.col("bucket_us"))
        .withColumn("rate", F.col("starts") / (F.col("bucket_us") / 1e6))
        .withColumn("target_rate", 1e6 / F.col("mean_interval_us"))
        .drop("t0")
    )
    totals = rows.groupBy("queue").agg(F.count("*").alias("total"))
    workers = (
        rows.groupBy("queue", "host", "pid")
        .agg(F.count("*").alias("starts"))
        .join(totals, "queue")
        .withColumn("share", F.col("starts") / F.col("total"))
        .drop("total")
    )
    violations = rows.filter(F.col("violation") == 1).select(
        "queue", "epoch", "ticket", "task_id", "prev_start_us", "start_us", "gap_us", "interval_us", "host", "pid"
    )
    return {
        "summary": summary,
        "by_day": with_rates(figures("queue", "day")),
        "by_hour": with_rates(figures("queue", "hour")),
        "gaps": gaps,
        "rate": rate,
        "workers": workers,
        "violations": violations,
        "duplicates": duplicates,
    }


#: Tables small enough for report.json and report.html (the others can be as big as the ledger).
REPORTED = ("summary", "by_day", "by_hour", "gaps", "rate", "workers")


def run_audit(
    spark: Any, paths: Sequence[str], out: str, tolerance_us: int = 1000, fmt: str | None = None, log: Any = print
) -> dict[str, Any]:
    """Audit ``paths``, write every table under ``out``, report.json and report.html; the report."""
    started = time.monotonic()
    df = read_ledger(spark, paths, fmt)
    tables = audit(df, tolerance_us)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "inputs": list(paths),
        "tolerance_us": tolerance_us,
    }
    for name, table in tables.items():
        table.write.mode("overwrite").parquet(f"{out.rstrip('/')}/{name}")
        if name in REPORTED:
            report[name] = [_plain(r.asDict()) for r in table.orderBy(*_order(name)).collect()]
        log(f"  {name:<10} written ({time.monotonic() - started:.1f} s)")
    report["rows"] = sum(q["starts"] for q in report["summary"])
    report["seconds"] = round(time.monotonic() - started, 1)
    _write_text(spark, f"{out.rstrip('/')}/report.json", json.dumps(report, indent=2, default=str))
    from siq_celery.spark.report_html import render

    _write_text(spark, f"{out.rstrip('/')}/report.html", render(report))
    return report


def _order(name: str) -> tuple[str, ...]:
    return {
        "summary": ("queue",), "by_day": ("queue", "day"), "by_hour": ("queue", "hour"), "gaps": ("queue", "bin"),
        "rate": ("queue", "bucket"), "workers": ("queue", "host", "pid"),
    }[name]  # fmt: skip


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}


def _write_text(spark: Any, path: str, text: str) -> None:
    """Write a small text file wherever the tables went (local path, or any Hadoop filesystem)."""
    if "://" not in path or path.startswith("file://"):
        local = Path(path.removeprefix("file://"))
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text, encoding="utf-8")
        return
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    fs = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(hadoop_path, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="siq audit", description="Audit siq_celery ledgers with Spark.")
    parser.add_argument("ledgers", nargs="+", help="ledger files or folders (.parquet, .jsonl), globs allowed")
    parser.add_argument("--out", required=True, help="folder for the tables, report.json and report.html")
    parser.add_argument("--master", help="Spark master (siq audit: local[*]; spark-submit: its own --master)")
    parser.add_argument("--tolerance", default="1ms", help="a gap below interval - tolerance is a violation")
    parser.add_argument("--format", choices=("parquet", "json"), help="input format (default: by file extension)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, default_master: str | None = None) -> int:
    args = parse_args(argv)
    try:
        tolerance_us = parse_duration(args.tolerance)
    except Exception as exc:
        print(f"siq audit: --tolerance: {exc}", file=sys.stderr)
        return 2
    spark = spark_session(args.master or default_master)
    spark.sparkContext.setLogLevel("WARN")
    try:
        print(f"auditing {', '.join(args.ledgers)} (tolerance {tolerance_us / 1000:g} ms)", flush=True)
        report = run_audit(spark, args.ledgers, args.out, tolerance_us, args.format)
    finally:
        spark.stop()
    for q in report["summary"]:
        print(
            f"{q['queue']}: {q['starts']:,} starts, {q['rate_pct']}% of the rate, {q['violations']} violations, "
            f"min gap {q['min_gap_ms']:.2f} ms, {q['inversions']} inversions, {q['duplicate_starts']} duplicate "
            f"starts, {q['missing_tickets']} tickets never started"
        )  # fmt: skip
    print(f"report: {args.out.rstrip('/')}/report.html ({report['seconds']} s)")
    return 0


if __name__ == "__main__":  # spark-submit .../siq_celery/spark/audit.py
    sys.exit(main())
