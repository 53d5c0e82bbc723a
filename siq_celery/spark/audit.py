"""``siq audit``: prove from a ledger that an interval held, with PySpark.

    siq audit LEDGER... --out DIR [--master local[*]] [--tolerance 1ms] [--rows-per-piece N]
                             [--conf KEY=VALUE]...
    spark-submit --master yarn $(python -c 'import siq_celery.spark.audit as a; print(a.__file__)') \\
        hdfs:///ledgers/2026-11-*.parquet --out hdfs:///audits/2026-11

Reads ledger files written by ``siq export`` (JSON Lines or Parquet, any path Spark can
read: local, HDFS, S3 with the cluster's connector; globs work) and writes, per queue:

* ``summary``: starts, slots (a start of cost c uses c), achieved rate in slots against
  1/interval, gap and lateness percentiles, violations (a start less than ``interval -
  tolerance`` after the one before it, on the store's clock; ``c x interval - tolerance``
  after a start of cost c), order inversions (a start whose ticket is lower than one
  started before it in the same epoch; ticket 0, a start with no place in this queue's
  line, never is), duplicate starts of one task id, tickets never started (within each
  epoch, numbers between the first and last ticket used with no start using them; a
  start of cost c uses ``ticket .. ticket + c - 1``), unfinished and failed starts,
  epochs and workers;
* ``by_day`` and ``by_hour``: the same figures per UTC day and hour;
* ``gaps``: the gap histogram (gap / interval, bins of 0.05); ``rate``: starts over time
  in about 60 buckets; ``workers``: starts per worker host and process;
* ``violations`` and ``duplicates``: the offending rows themselves.

Each is a Parquet table under DIR, in full; ``report.json`` holds all but the last two, and
``report.html`` shows them with charts, self-contained (no scripts, no network).

Work spreads within a queue (:mod:`siq_celery.spark.pieces`): the start order is computed
once, in pieces of each queue sorted in parallel, written under DIR/_ordered and read
back by the tables that need it (removed at the end); the others read only the ledger
columns they need. What is collected to the driver, for report.json and report.html, is
bounded whatever the ledger's length: per queue, the summary, at most 61 gap bins, about
60 rate buckets, its worker processes, its days, and its latest ``REPORT_HOURS`` (168: a
week) hours of ``by_hour``; and at most ``REPORT_ROWS_MAX`` (10,000) rows of any one
table (``report.json`` says what was left out, under ``left_out``). Days and worker
processes grow with the time a ledger covers; the full tables stay in Parquet.
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
from siq_celery.queue import MAX_COST
from siq_celery.spark.pieces import ROWS_PER_PIECE, in_pieces, in_start_order, kept, piece_ends, piece_spans

GAP_BIN = 0.05  # histogram bins, in intervals
GAP_BINS_MAX = 60  # gaps of 3 intervals or more share the last bin
RATE_BUCKETS = 60


def spark_session(master: str | None = None, app_name: str = "siq audit", conf: dict[str, str] | None = None) -> Any:
    """A session for the audit (``master=None``: whatever spark-submit configured);
    ``conf``: Spark settings, applied last."""
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
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
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
        T.StructField("pid", T.IntegerType()), T.StructField("cost", T.IntegerType()),
        T.StructField("v", T.ShortType()),
    ])  # fmt: skip


def read_ledger(spark: Any, paths: Sequence[str], fmt: str | None = None) -> Any:
    """One DataFrame of every ledger row in ``paths`` (Parquet and JSON Lines may be mixed);
    ValueError if a row has a newer schema version than this audit reads."""
    df, counted, _ = _read_and_check(spark, paths, fmt)
    counted.unpersist()
    return df


def _read_and_check(spark: Any, paths: Sequence[str], fmt: str | None) -> tuple[Any, Any, int]:
    """The ledger, its census (cached: :func:`census`), and how many of its rows cannot be
    audited (no queue or no start), in one pass that also refuses a newer schema."""
    from pyspark.sql import functions as F

    frames = []
    for kind in ("parquet", "json"):
        chosen = [p for p in paths if (fmt or _format_of(p)) == kind]
        if chosen:
            reader = spark.read.schema(ledger_schema())
            frames.append(reader.parquet(*chosen) if kind == "parquet" else reader.json(chosen))
    df = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    counted = census(df).cache()
    [check] = counted.agg(
        F.max("newest").alias("newest"),
        F.sum(F.when(F.col("queue").isNull() | F.col("hour_n").isNull(), F.col("n"))).alias("unplaced"),
    ).collect()
    if check["newest"] is not None and check["newest"] > SCHEMA_VERSION:
        counted.unpersist()
        raise ValueError(f"ledger schema version {check['newest']} is newer than this siq audit ({SCHEMA_VERSION})")
    return df, counted, int(check["unplaced"] or 0)


def census(df: Any) -> Any:
    """Ledger rows counted by (queue, hour, host, pid), with the first and last start and
    the newest schema version of each: one small table from one pass, which the schema
    check, the pieces, the per-hour hosts and the worker shares all read. Rows without a
    queue or a start are counted under a null ``queue`` or ``hour_n``."""
    from pyspark.sql import functions as F

    return df.groupBy("queue", _hour_of(), "host", "pid").agg(
        F.count("*").alias("n"),
        F.min("start_us").alias("t0"),
        F.max("start_us").alias("t1"),
        F.max("v").alias("newest"),
    )


def _hour_of() -> Any:
    from pyspark.sql import functions as F

    return F.floor(F.col("start_us") / 3_600_000_000).alias("hour_n")


def _format_of(path: str) -> str:
    lowered = path.lower().rstrip("/")
    return "json" if lowered.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")) else "parquet"


def auditable(df: Any) -> Any:
    """The rows an audit can place: with a queue and a start (the others are counted in
    the report as ``unaudited_rows``); a missing epoch reads as ``""``."""
    from pyspark.sql import functions as F

    return df.filter(F.col("queue").isNotNull() & F.col("start_us").isNotNull()).withColumn(
        "epoch", F.coalesce(F.col("epoch"), F.lit(""))
    )


def narrow_starts(df: Any) -> Any:
    """One narrow row per auditable start, with what the order-dependent tables need:
    lateness, the cost (1 where the ledger has none: schema version 1; held to 1 ..
    MAX_COST), 0/1 flags for unfinished and failed, and a 64-bit hash of the task id (for
    duplicates, without carrying the ids themselves through the sort)."""
    from pyspark.sql import functions as F

    cost = F.least(F.greatest(F.coalesce(F.col("cost"), F.lit(1)), F.lit(1)), F.lit(MAX_COST)).cast("int")
    return auditable(df).select(
        "queue", "epoch", "ticket", "start_us", "interval_us", cost.alias("cost"),
        (F.col("start_us") - F.col("slot_us")).alias("lateness_us"),
        F.col("finish_us").isNull().cast("byte").alias("unfinished"),
        (F.col("outcome") == "FAILURE").cast("byte").alias("failure"),
        F.when(F.col("task_id").isNotNull(), F.xxhash64("queue", "task_id")).alias("id_hash"),
    )  # fmt: skip


def ordered_starts(
    df: Any,
    tolerance_us: int = 1000,
    rows_per_piece: int = ROWS_PER_PIECE,
    cached: list[Any] | None = None,
    census_table: Any = None,
) -> Any:
    """:func:`narrow_starts` of ``df`` in start order, each with its gap and its
    violation and inversion flags (bytes), computed in parallel pieces of each queue
    (:mod:`siq_celery.spark.pieces`): the one sort of the audit, which :func:`run_audit`
    writes once. ``census_table``: :func:`census` of ``df`` (made here if not given)."""
    from pyspark.sql import functions as F

    if census_table is None:
        census_table = kept(census(df), cached)
    per_queue = (
        census_table.filter(F.col("queue").isNotNull() & F.col("hour_n").isNotNull())
        .groupBy("queue")
        .agg(F.min("t0").alias("t0"), F.max("t1").alias("t1"), F.sum("n").alias("rows"))
    )
    spans = piece_spans(per_queue, rows_per_piece).transform(lambda small: kept(small, cached))
    pieced = in_pieces(narrow_starts(df), spans)
    return (
        in_start_order(pieced, piece_ends(pieced, cached), tolerance_us)
        .drop("piece", "highest_before", "prev_start_us")
        .withColumn("violation", F.col("violation").cast("byte"))
        .withColumn("inversion", F.col("inversion").cast("byte"))
    )


def audit(
    df: Any,
    tolerance_us: int = 1000,
    ordered: Any = None,
    cached: list[Any] | None = None,
    census_table: Any = None,
) -> dict[str, Any]:
    """Every audit table of ``df`` (ledger rows), as Spark DataFrames, by name. They are
    read from ``ordered`` (:func:`ordered_starts`, made here if not given) and
    ``census_table`` (:func:`census` of ``df``, likewise).

    Per-hour figures are aggregated once and rolled up to days and queues; percentiles
    are exact, read from value histograms (a gap or a lateness in microseconds takes few
    distinct values), so they do not depend on how Spark split the work. The small
    tables it caches go on ``cached``, for the caller to unpersist when done.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if census_table is None:
        census_table = kept(census(df), cached)
    if ordered is None:
        ordered = ordered_starts(df, tolerance_us, cached=cached, census_table=census_table)

    def named(table: Any) -> Any:
        text = F.date_format(F.expr("timestamp_micros(hour_n * 3600000000)"), "yyyy-MM-dd HH:00")
        return table.withColumn("hour", text).withColumn("day", F.substring(text, 1, 10)).drop("hour_n")

    ledger = auditable(df)
    placed = census_table.filter(F.col("queue").isNotNull() & F.col("hour_n").isNotNull())
    rows = ordered.withColumn("hour_n", _hour_of())
    hosts = placed.groupBy("queue", "hour_n").agg(F.collect_set("host").alias("hosts"))
    hourly = (
        rows.groupBy("queue", "hour_n")
        .agg(
            F.count("*").alias("starts"),
            F.sum("cost").alias("slots"),
            F.max(F.struct("start_us", "ticket", "cost"))["cost"].alias("last_cost"),
            F.min("start_us").alias("first_start_us"),
            F.max("start_us").alias("last_start_us"),
            F.sum("interval_us").alias("interval_sum"),
            F.count("interval_us").alias("interval_count"),
            F.sum("violation").alias("violations"),
            F.sum("inversion").alias("inversions"),
            F.min("gap_us").alias("min_gap_us"),
            F.max("lateness_us").alias("lateness_max_us"),
            F.sum("unfinished").alias("unfinished"),
            F.sum("failure").alias("failures"),
        )
        .join(hosts, ["queue", "hour_n"], "left")
        .transform(named)
        .transform(lambda small: kept(small, cached))  # one row per queue and hour
    )
    gap_hist = (
        rows.filter(F.col("gap_us").isNotNull())
        .groupBy("queue", "hour_n", "interval_us", "gap_us")
        .agg(F.count("*").alias("n"))
        .transform(named)
        .transform(lambda small: kept(small, cached))  # one row per distinct gap (µs) per hour
    )
    late_hist = (
        rows.filter(F.col("lateness_us").isNotNull())
        .groupBy("queue", "hour_n", "lateness_us")
        .agg(F.count("*").alias("n"))
        .transform(named)
        .transform(lambda small: kept(small, cached))
    )

    def figures(*keys: str) -> Any:
        table = hourly.groupBy(*keys).agg(
            F.sum("starts").alias("starts"),
            F.sum("slots").alias("slots"),
            F.max(F.struct("last_start_us", "last_cost"))["last_cost"].alias("last_cost"),
            F.min("first_start_us").alias("first_start_us"),
            F.max("last_start_us").alias("last_start_us"),
            (F.sum("interval_sum") / F.sum("interval_count")).alias("mean_interval_us"),
            F.sum("violations").alias("violations"),
            F.sum("inversions").alias("inversions"),
            (F.min("min_gap_us") / 1000).alias("min_gap_ms"),
            (F.max("lateness_max_us") / 1000).alias("lateness_max_ms"),
            F.sum("unfinished").alias("unfinished"),
            F.sum("failures").alias("failures"),
            F.size(F.array_distinct(F.flatten(F.collect_list("hosts")))).alias("worker_hosts"),
        )
        gaps = _percentiles(gap_hist, list(keys), "gap_us", {"gap_p50_ms": 0.5, "gap_p01_ms": 0.01})
        late = _percentiles(late_hist, list(keys), "lateness_us", {"lateness_p50_ms": 0.5, "lateness_p99_ms": 0.99})
        return with_rates(table.join(gaps, list(keys), "left").join(late, list(keys), "left"))

    def with_rates(table: Any) -> Any:
        # In slots: a start of cost c takes c of them, and the last start's are not yet used up.
        span_s = (F.col("last_start_us") - F.col("first_start_us")) / 1e6
        return (
            table.withColumn("achieved_rate", F.when(span_s > 0, (F.col("slots") - F.col("last_cost")) / span_s))
            .drop("last_cost")
            .withColumn("target_rate", 1e6 / F.col("mean_interval_us"))
            .withColumn("rate_pct", F.round(100 * F.col("achieved_rate") / F.col("target_rate"), 2))
        )

    # Duplicate task ids: first by a 64-bit hash (a cheap key for a shuffle of every
    # start), then exactly, by the ids themselves, among the few whose hash repeats.
    # The hashes ride in the sorted table; the ids are read again only where a hash repeats.
    repeated = kept(
        ordered.filter(F.col("id_hash").isNotNull()).groupBy("id_hash").count().filter(F.col("count") > 1),
        cached,
    ).select("id_hash")
    ids = ledger.filter(F.col("task_id").isNotNull()).select(
        "queue", "task_id", "ticket", F.xxhash64("queue", "task_id").alias("id_hash")
    )
    duplicates = (
        ids.join(_small(repeated), "id_hash", "left_semi")
        .groupBy("queue", "task_id")
        .agg(F.count("*").alias("starts"), F.collect_list("ticket").alias("tickets"))
        .filter(F.col("starts") > 1)
        .transform(lambda few: kept(few, cached))  # only the duplicates: the summary reads them too
    )
    # Tickets never started, exactly and without a shuffle of every ticket: each group of
    # 64 consecutive numbers becomes one 64-bit mask of the numbers seen. A start of cost c
    # used tickets ticket .. ticket + c - 1 (a mask for each block they touch); ticket 0 is
    # no ticket (a start with no place in this queue's line).
    used = ordered.filter(F.col("ticket").isNotNull() & (F.col("ticket") != 0)).select(
        "queue", "epoch", F.col("ticket").alias("first"), (F.col("ticket") + F.col("cost") - 1).alias("last")
    )
    blocks = F.sequence(F.expr("(first - pmod(first, 64)) div 64"), F.expr("(last - pmod(last, 64)) div 64"))
    bits = "shiftleft(shiftleft(1L, cast(b - a + 1 as int)) - 1, cast(a as int))"  # bits a .. b set
    in_block = (
        used.withColumn("block", F.explode(blocks))
        .withColumn("a", F.greatest("first", F.col("block") * 64) - F.col("block") * 64)
        .withColumn("b", F.least("last", F.col("block") * 64 + 63) - F.col("block") * 64)
        .withColumn("mask", F.expr(f"CASE WHEN b - a = 63 THEN -1L ELSE {bits} END"))
    )
    started_tickets = (
        in_block.groupBy("queue", "epoch", "block")
        .agg(F.bit_or("mask").alias("seen"), F.min("first").alias("low"), F.max("last").alias("high"))
        .groupBy("queue", "epoch")
        .agg((F.max("high") - F.min("low") + 1 - F.sum(F.bit_count("seen"))).alias("missing_tickets"))
    )  # fmt: skip
    missing = started_tickets.groupBy("queue").agg(
        F.sum("missing_tickets").alias("missing_tickets"), F.count("*").alias("epochs")
    )
    dup_per_queue = duplicates.groupBy("queue").agg(F.sum(F.col("starts") - 1).alias("duplicate_starts"))
    summary = (
        figures("queue")
        .join(missing, "queue", "left")
        .join(dup_per_queue, "queue", "left")
        .fillna(0, ["duplicate_starts", "missing_tickets"])
    )
    gaps = (
        gap_hist.withColumn(
            "bin", F.least(F.floor(F.col("gap_us") / F.col("interval_us") / GAP_BIN), F.lit(GAP_BINS_MAX))
        )
        .groupBy("queue", "bin")
        .agg(F.sum("n").alias("count"))
        .withColumn("from_intervals", F.col("bin") * GAP_BIN)
    )
    span = hourly.groupBy("queue").agg(F.min("first_start_us").alias("t0"), F.max("last_start_us").alias("t1"))
    bucket_us = F.greatest(F.ceil((F.col("t1") - F.col("t0") + 1) / RATE_BUCKETS), F.lit(1))
    rate = (
        ordered.select("queue", "start_us", "interval_us", "cost")
        .join(F.broadcast(span), "queue")
        .withColumn("bucket_us", bucket_us)
        .withColumn("bucket", F.floor((F.col("start_us") - F.col("t0")) / F.col("bucket_us")))
        .groupBy("queue", "bucket", "bucket_us", "t0")
        .agg(F.count("*").alias("starts"), F.sum("cost").alias("slots"), F.avg("interval_us").alias("mean_interval_us"))
        .withColumn("bucket_start_us", F.col("t0") + F.col("bucket") * F.col("bucket_us"))
        .withColumn("rate", F.col("slots") / (F.col("bucket_us") / 1e6))
        .withColumn("target_rate", 1e6 / F.col("mean_interval_us"))
        .drop("t0")
    )
    workers = (
        placed.groupBy("queue", "host", "pid")
        .agg(F.sum("n").alias("starts"))
        .withColumn("share", F.col("starts") / F.sum("starts").over(Window.partitionBy("queue")))
    )
    # The offending rows with their task ids, found again in the ledger by queue, epoch,
    # ticket and start (rows that tie on all four are listed together).
    keys = ["queue", "epoch", "ticket", "start_us"]
    offending = kept(
        ordered.filter(F.col("violation") == 1).select(
            *keys,
            (F.col("start_us") - F.col("gap_us")).alias("prev_start_us"),
            "gap_us",
            "required_gap_us",
            "interval_us",
        ),
        cached,
    )
    violations = (
        _small(offending)
        .join(ledger.select(*keys, "task_id", "host", "pid"), keys)
        .select("queue", "epoch", "ticket", "task_id", "prev_start_us", "start_us", "gap_us", "required_gap_us",
                "interval_us", "host", "pid")
    )  # fmt: skip
    return {
        "summary": summary,
        "by_day": figures("queue", "day"),
        "by_hour": figures("queue", "hour"),
        "gaps": gaps,
        "rate": rate,
        "workers": workers,
        "violations": violations,
        "duplicates": duplicates,
    }


#: A cached table of at most this many rows is broadcast to a join, not shuffled with it.
BROADCAST_ROWS = 1_000_000


def _small(table: Any) -> Any:
    """``table`` (cached) marked for broadcast if it is small: the few offending rows are
    then matched in one pass over the ledger, with no shuffle of the ledger."""
    from pyspark.sql import functions as F

    return F.broadcast(table) if table.count() <= BROADCAST_ROWS else table


def _percentiles(hist: Any, keys: list[str], value: str, wanted: dict[str, float]) -> Any:
    """Exact percentiles (in ms) per ``keys`` from a histogram of ``value`` (column ``n``):
    for each fraction p, the smallest value with at least p of the rows at or below it."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    counts = hist.groupBy(*keys, value).agg(F.sum("n").alias("n"))
    upto = Window.partitionBy(*keys).orderBy(value).rowsBetween(Window.unboundedPreceding, Window.currentRow)
    counts = counts.withColumn("below", F.sum("n").over(upto)).withColumn(
        "total", F.sum("n").over(Window.partitionBy(*keys))
    )
    return counts.groupBy(*keys).agg(
        *[(F.min(F.when(F.col("below") >= p * F.col("total"), F.col(value))) / 1000).alias(name)
          for name, p in wanted.items()]
    )  # fmt: skip


#: Tables small enough for report.json and report.html (the others can be as big as the ledger).
REPORTED = ("summary", "by_day", "by_hour", "gaps", "rate", "workers")
#: The latest hours of each queue in report.json and report.html (``by_hour`` in Parquet has all).
REPORT_HOURS = 168
#: Rows of any one table collected into report.json and report.html, at most.
REPORT_ROWS_MAX = 10_000


def run_audit(
    spark: Any,
    paths: Sequence[str],
    out: str,
    tolerance_us: int = 1000,
    fmt: str | None = None,
    log: Any = print,
    rows_per_piece: int = ROWS_PER_PIECE,
) -> dict[str, Any]:
    """Audit ``paths``, write every table under ``out``, report.json and report.html; the
    report. ``log`` gets a line as each stage ends."""

    started = time.monotonic()
    out = out.rstrip("/")

    def done(stage: str) -> None:
        log(f"  {stage:<10} written ({time.monotonic() - started:.1f} s)")

    df, counted, unaudited = _read_and_check(spark, paths, fmt)
    done("(census)")
    # Every start in queue order with its gap and flags, written once (a narrow table) and
    # read back by the tables that need it: a second pass over Parquet costs less than
    # keeping it in memory, and nothing is sorted twice.
    work = f"{out}/_ordered"
    cached: list[Any] = [counted]  # the small tables kept while they are read, dropped at the end
    try:
        ordered_starts(df, tolerance_us, rows_per_piece, cached, counted).write.mode("overwrite").parquet(work)
        done("(ordered)")
        tables = audit(df, tolerance_us, spark.read.parquet(work), cached, counted)
        report: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "inputs": list(paths),
            "tolerance_us": tolerance_us,
        }
        for name, table in tables.items():
            table.write.mode("overwrite").parquet(f"{out}/{name}")
            if name in REPORTED:
                report[name], left_out = _reported(spark.read.parquet(f"{out}/{name}"), name)
                if left_out:
                    report.setdefault("left_out", {})[name] = left_out
            done(name)
    finally:
        for small in cached:
            small.unpersist()
        _remove(spark, work)
    report["rows"] = int(spark.read.parquet(f"{out}/summary").agg({"starts": "sum"}).first()[0] or 0)
    report["unaudited_rows"] = unaudited
    report["seconds"] = round(time.monotonic() - started, 1)
    report["rows_per_second"] = round(report["rows"] / max(report["seconds"], 0.1))
    _write_text(spark, f"{out}/report.json", json.dumps(report, indent=2, default=str))
    from siq_celery.spark.report_html import render

    _write_text(spark, f"{out}/report.html", render(report))
    return report


def _reported(table: Any, name: str) -> tuple[list[dict[str, Any]], int]:
    """The rows of a written table that go into report.json (``by_hour``: each queue's
    latest :data:`REPORT_HOURS`; any table: at most :data:`REPORT_ROWS_MAX`), and how many
    rows were left out."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    total = table.count()
    if name == "by_hour":
        latest = Window.partitionBy("queue").orderBy(F.col("hour").desc())
        table = table.withColumn("_n", F.row_number().over(latest)).filter(F.col("_n") <= REPORT_HOURS).drop("_n")
    rows = table.orderBy(*_order(name)).limit(REPORT_ROWS_MAX).collect()
    return [_plain(r.asDict()) for r in rows], total - len(rows)


def _order(name: str) -> tuple[str, ...]:
    return {
        "summary": ("queue",), "by_day": ("queue", "day"), "by_hour": ("queue", "hour"), "gaps": ("queue", "bin"),
        "rate": ("queue", "bucket"), "workers": ("queue", "host", "pid"),
    }[name]  # fmt: skip


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}


def _hadoop_path(spark: Any, path: str) -> tuple[Any, Any]:
    """(filesystem, path) of the Hadoop filesystem that holds ``path`` (local, HDFS, S3...)."""
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hadoop_path


def _remove(spark: Any, path: str) -> None:
    fs, hadoop_path = _hadoop_path(spark, path)
    fs.delete(hadoop_path, True)


def _write_text(spark: Any, path: str, text: str) -> None:
    """Write a small text file wherever the tables went (local path, or any Hadoop filesystem)."""
    if "://" not in path or path.startswith("file://"):
        local = Path(path.removeprefix("file://"))
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text, encoding="utf-8")
        return
    fs, hadoop_path = _hadoop_path(spark, path)
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
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting, as spark-submit's --conf (repeatable)")  # fmt: skip
    parser.add_argument("--rows-per-piece", type=int, default=ROWS_PER_PIECE, metavar="N",
                        help=f"starts of a queue sorted together in one task (default {ROWS_PER_PIECE:,})")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, default_master: str | None = None) -> int:
    args = parse_args(argv)
    try:
        tolerance_us = parse_duration(args.tolerance)
    except Exception as exc:
        print(f"siq audit: --tolerance: {exc}", file=sys.stderr)
        return 2
    if args.rows_per_piece < 1:
        print(f"siq audit: --rows-per-piece must be at least 1, not {args.rows_per_piece}", file=sys.stderr)
        return 2
    bad = [item for item in args.conf if "=" not in item]
    if bad:
        print(f"siq audit: --conf takes KEY=VALUE, not {bad[0]!r}", file=sys.stderr)
        return 2
    conf = dict(item.split("=", 1) for item in args.conf)
    spark = spark_session(args.master or default_master, conf=conf)
    spark.sparkContext.setLogLevel("WARN")
    try:
        print(f"auditing {', '.join(args.ledgers)} (tolerance {tolerance_us / 1000:g} ms)", flush=True)
        report = run_audit(spark, args.ledgers, args.out, tolerance_us, args.format, rows_per_piece=args.rows_per_piece)
    finally:
        spark.stop()
    if report["unaudited_rows"]:
        print(f"{report['unaudited_rows']:,} rows without a queue or a start were not audited")
    if report.get("left_out"):
        left_out = ", ".join(f"{n:,} rows of {name}" for name, n in report["left_out"].items())
        print(f"report.json and report.html left out {left_out} (all in the tables under {args.out.rstrip('/')})")
    for q in report["summary"]:
        print(
            f"{q['queue']}: {q['starts']:,} starts, {q['rate_pct']}% of the rate, {q['violations']} violations, "
            f"min gap {q['min_gap_ms']:.2f} ms, {q['inversions']} inversions, {q['duplicate_starts']} duplicate "
            f"starts, {q['missing_tickets']} tickets never started"
        )  # fmt: skip
    print(f"report: {args.out.rstrip('/')}/report.html ({report['rows']:,} rows in {report['seconds']} s, "
          f"{report['rows_per_second']:,} rows/s)")  # fmt: skip
    return 0


if __name__ == "__main__":  # spark-submit .../siq_celery/spark/audit.py
    sys.exit(main())
