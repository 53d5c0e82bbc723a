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
* ``violations`` and ``duplicates``: the offending rows themselves;
* on the bodies' clock (ledger schema 5: ``began_us``, when each body's report reached the
  store), the same checks with each start placed by its report: in ``summary``,
  ``reported_starts`` (the rest had no report recorded), ``body_violations`` (a body less
  than the interval after the one before it, or beyond a burst's allowance) and
  ``body_limit_violations`` (a window quota or a concurrency cap broken between the bodies'
  reports and their finishes); ``body_violations`` and ``body_limit_violations``, those rows;
* of the fair tasks' rows (ledger schema 4; :mod:`siq_celery.spark.fair`): ``fair_keys`` and
  ``fair_hours``, each key's starts, units, weight, share of its queue's units and the
  share its weight gives it, over the ledger and per hour; ``fair_order``, per queue and
  hour the fair starts and those handed their tickets out of fair order, ``unfair``, those
  rows themselves.

Each is a Parquet table under DIR, in full; ``report.json`` holds all but ``violations``,
``limit_violations``, ``body_violations``, ``body_limit_violations`` and ``duplicates`` (and
of ``unfair`` each queue's first rows), and ``report.html`` shows them with charts,
self-contained (no scripts, no network).

The audit runs in stages: the census (:func:`census`, one pass that also checks the
schema), the start order (:func:`ordered_starts`), the tables (:func:`audit`, each made in
:mod:`siq_celery.spark.audit_tables`) and the report (:func:`run_audit`). The session is
:mod:`siq_celery.spark.session`'s, files are read and written by :mod:`siq_celery.spark.io`
and the command line is :mod:`siq_celery.spark.audit_cli`'s.

Work spreads within a queue (:mod:`siq_celery.spark.pieces`): the start order is computed
once, in pieces of each queue sorted in parallel, written under DIR/_ordered and read
back by the tables that need it (removed at the end); the others read only the ledger
columns they need. What is collected to the driver, for report.json and report.html, is
bounded whatever the ledger's length: per queue, the summary, at most 61 gap bins, about
60 rate buckets, its worker processes, its days, its latest ``REPORT_HOURS`` (168: a
week) hours of ``by_hour``, its fairness keys (per hour in ``fair_hours``) and its first
20 ``unfair`` rows; and at most ``REPORT_ROWS_MAX`` (10,000) rows of any one table
(``report.json`` says what was left out, under ``left_out``). Days, worker processes and
keys grow with the time a ledger covers; the full tables stay in Parquet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from siq_celery.client.queue import MAX_COST
from siq_celery.ledger import SCHEMA_VERSION
from siq_celery.spark import audit_tables, fair, limits

# ``name as name``: kept importable from here (main: ``siq audit`` and this file run as a
# script; spark_session: the tests and the benchmark).
from siq_celery.spark.audit_cli import main as main
from siq_celery.spark.audit_cli import parse_args as parse_args
from siq_celery.spark.audit_write import write_report, write_tables
from siq_celery.spark.io import ledger_schema as ledger_schema
from siq_celery.spark.io import read_ledger_files, read_table, remove, write_table
from siq_celery.spark.pieces import ROWS_PER_PIECE, in_pieces, in_start_order, kept, piece_ends, piece_spans
from siq_celery.spark.session import spark_session as spark_session


def read_ledger(spark: Any, paths: Sequence[str], fmt: str | None = None) -> Any:
    """One DataFrame of every ledger row in ``paths`` (Parquet and JSON Lines may be mixed);
    ValueError if a row has a newer schema version than this audit reads."""
    df, counted, _, _, _ = _read_and_check(spark, paths, fmt)
    counted.unpersist()
    return df


def _read_and_check(spark: Any, paths: Sequence[str], fmt: str | None) -> tuple[Any, Any, int, bool, bool]:
    """The ledger, its census (cached: :func:`census`), how many of its rows cannot be
    audited (no queue or no start), whether any row records a limit beyond the interval
    and whether any records its body's report, in one pass that also refuses a newer
    schema."""
    from pyspark.sql import functions as F

    df = read_ledger_files(spark, paths, fmt)
    counted = census(df).cache()
    [check] = counted.agg(
        F.max("newest").alias("newest"),
        F.sum(F.when(F.col("queue").isNull() | F.col("hour_n").isNull(), F.col("n"))).alias("unplaced"),
        _limited().alias("limits"),
        F.sum("reported").alias("reported"),
    ).collect()
    if check["newest"] is not None and check["newest"] > SCHEMA_VERSION:
        counted.unpersist()
        raise ValueError(f"ledger schema version {check['newest']} is newer than this siq audit ({SCHEMA_VERSION})")
    return df, counted, int(check["unplaced"] or 0), bool(check["limits"]), bool(check["reported"])


def _limited() -> Any:
    """An aggregate of :func:`census` rows: whether any records a limit beyond the interval."""
    from pyspark.sql import functions as F

    return F.coalesce(F.greatest(*(F.max(c) for c in LIMITS)) > 0, F.lit(False))


#: The ledger columns that record a limit beyond the interval (0 or null: none).
LIMITS = ("burst", "quota", "concurrency")


def census(df: Any) -> Any:
    """Ledger rows counted by (queue, hour, host, pid), with the first and last start, the
    newest schema version and the largest burst, quota and cap of each (a limit beyond the
    interval: :data:`LIMITS`): one small table from one pass, which the schema check, the
    pieces, the per-hour hosts and the worker shares all read. Rows without a queue or a
    start are counted under a null ``queue`` or ``hour_n``."""
    from pyspark.sql import functions as F

    return df.groupBy("queue", _hour_of(), "host", "pid").agg(
        F.count("*").alias("n"),
        F.min("start_us").alias("t0"),
        F.max("start_us").alias("t1"),
        F.max("v").alias("newest"),
        *(F.max(c).alias(c) for c in LIMITS),
        F.max("fair_weight").alias("fair_weight"),  # > 0: some row is a fair task's
        F.count("began_us").alias("reported"),  # rows whose body's report is recorded (schema 5)
    )


def _placed(census_table: Any) -> Any:
    """The rows of :func:`census` with a queue and an hour: those of auditable starts."""
    from pyspark.sql import functions as F

    return census_table.filter(F.col("queue").isNotNull() & F.col("hour_n").isNotNull())


def _per_queue(census_table: Any) -> Any:
    """Per queue of :func:`census` (placed rows): ``t0`` its first start, ``t1`` its last,
    ``rows``."""
    from pyspark.sql import functions as F

    return (
        _placed(census_table)
        .groupBy("queue")
        .agg(F.min("t0").alias("t0"), F.max("t1").alias("t1"), F.sum("n").alias("rows"))
    )


def limited_queues(census_table: Any) -> Any:
    """The queues (one ``queue`` column) whose ledger rows record a limit beyond the
    interval: those :mod:`siq_celery.spark.limits` checks."""

    return _placed(census_table).groupBy("queue").agg(_limited().alias("limited")).filter("limited").select("queue")


def _hour_of() -> Any:
    from pyspark.sql import functions as F

    return F.floor(F.col("start_us") / 3_600_000_000).alias("hour_n")


def auditable(df: Any) -> Any:
    """The rows an audit can place: with a queue and a start (the others are counted in
    the report as ``unaudited_rows``); a missing epoch reads as ``""``."""
    from pyspark.sql import functions as F

    return df.filter(F.col("queue").isNotNull() & F.col("start_us").isNotNull()).withColumn(
        "epoch", F.coalesce(F.col("epoch"), F.lit(""))
    )


def narrow_starts(df: Any, bursts: bool = True) -> Any:
    """One narrow row per auditable start, with what the order-dependent tables need:
    lateness, the cost (1 where the ledger has none: schema version 1; held to 1 ..
    MAX_COST), with ``bursts`` the burst (a start under one is checked by
    :mod:`siq_celery.spark.limits`, not pairwise), 0/1 flags for unfinished and failed, and
    a 64-bit hash of the task id (for duplicates, without carrying the ids themselves
    through the sort)."""
    from pyspark.sql import functions as F

    cost = F.least(F.greatest(F.coalesce(F.col("cost"), F.lit(1)), F.lit(1)), F.lit(MAX_COST)).cast("int")
    return auditable(df).select(
        "queue", "epoch", "ticket", "start_us", "interval_us", cost.alias("cost"), *(["burst"] if bursts else []),
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
    bursts: bool = True,
) -> Any:
    """:func:`narrow_starts` of ``df`` in start order, each with its gap and its
    violation and inversion flags (bytes), computed in parallel pieces of each queue
    (:mod:`siq_celery.spark.pieces`): the one sort of the audit, which :func:`run_audit`
    writes once. ``census_table``: :func:`census` of ``df`` (made here if not given).
    ``bursts``: some row may record a burst (False: none does, and the sort carries no
    burst column)."""
    from pyspark.sql import functions as F

    if census_table is None:
        census_table = kept(census(df), cached)
    spans = piece_spans(_per_queue(census_table), rows_per_piece).transform(lambda small: kept(small, cached))
    pieced = in_pieces(narrow_starts(df, bursts), spans)
    return (
        in_start_order(pieced, piece_ends(pieced, cached), tolerance_us)
        .drop("piece", "highest_before", "prev_start_us", "burst")
        .withColumn("violation", F.col("violation").cast("byte"))
        .withColumn("inversion", F.col("inversion").cast("byte"))
    )


def swept_starts(
    df: Any, rows_per_piece: int = ROWS_PER_PIECE, cached: list[Any] | None = None, census_table: Any = None
) -> Any:
    """The starts of the queues of ``df`` that record a limit beyond the interval, swept
    in pieces (:func:`siq_celery.spark.limits.swept_starts`): the second sort of the audit,
    of those queues only, which :func:`run_audit` writes once."""
    if census_table is None:
        census_table = kept(census(df), cached)
    limited = kept(limited_queues(census_table), cached)
    return limits.swept_starts(auditable(df), limited, _per_queue(census_table), rows_per_piece, cached)


def body_starts(df: Any) -> Any:
    """The auditable rows of ``df`` whose body's report is recorded, each placed by it:
    ``began_us`` as its ``start_us`` (what later starts counted from, on the store's
    clock), so that every check of the authorizations runs on the bodies' clock as is."""
    from pyspark.sql import functions as F

    return auditable(df).filter(F.col("began_us").isNotNull()).withColumn("start_us", F.col("began_us"))


def body_work(
    df: Any, tolerance_us: int, rows_per_piece: int, cached: list[Any] | None, limited: bool
) -> tuple[Any, Any]:
    """(:func:`ordered_starts`, :func:`swept_starts` or None when not ``limited``) of
    :func:`body_starts`: the bodies' own sorts, which :func:`run_audit` writes once."""
    rows = body_starts(df)
    body_census = kept(census(rows), cached)
    ordered = ordered_starts(rows, tolerance_us, rows_per_piece, cached, body_census, limited)
    return ordered, swept_starts(rows, rows_per_piece, cached, body_census) if limited else None


def body_tables(
    df: Any, tolerance_us: int, ordered: Any, swept: Any, census_table: Any, cached: list[Any] | None
) -> dict[str, Any]:
    """The checks on the bodies' clock, from :func:`body_work`'s ``ordered`` and ``swept``:
    ``body_violations`` (bodies too soon after the body before them, or beyond a burst's
    allowance: :func:`siq_celery.spark.audit_tables.violations` with ``began_us`` and
    ``prev_began_us``), ``body_limit_violations`` (bodies that broke a window quota or a
    concurrency cap, counted from their reports to their finishes) and ``bodies``, per queue
    the starts whose report is recorded and the counts of both (for the summary)."""
    from pyspark.sql import functions as F

    rows = body_starts(df)
    flagged = audit_tables.flagged(limits.verdicts(swept, tolerance_us), cached) if swept is not None else None
    spacing = audit_tables.violations(ordered, rows, cached, flagged)
    over = audit_tables.limit_violations(flagged, rows)
    per_queue = _placed(census_table).groupBy("queue").agg(F.sum("reported").cast("long").alias("reported_starts"))
    bodies = (
        per_queue.join(spacing.groupBy("queue").agg(F.count("*").alias("body_violations")), "queue", "left")
        .join(over.groupBy("queue").agg(F.count("*").alias("body_limit_violations")), "queue", "left")
        .fillna(0, ["body_violations", "body_limit_violations"])
    )
    return {
        "body_violations": spacing.withColumnRenamed("start_us", "began_us").withColumnRenamed(
            "prev_start_us", "prev_began_us"
        ),
        "body_limit_violations": over.withColumnRenamed("start_us", "began_us"),
        "bodies": bodies,
    }


def audit(
    df: Any,
    tolerance_us: int = 1000,
    ordered: Any = None,
    cached: list[Any] | None = None,
    census_table: Any = None,
    swept: Any = None,
    limited: bool | None = None,
    rows_per_piece: int = ROWS_PER_PIECE,
    bodies: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Every audit table of ``df`` (ledger rows), as Spark DataFrames, by name. They are
    read from ``ordered`` (:func:`ordered_starts`, made here if not given), ``swept``
    (:func:`swept_starts`, likewise, when ``limited``: some row records a limit beyond the
    interval; None: found out here), ``bodies`` (:func:`body_work`, likewise) and
    ``census_table`` (:func:`census` of ``df``, likewise); how each is made:
    :mod:`siq_celery.spark.audit_tables`, :func:`body_tables` and the fair shares'
    :mod:`siq_celery.spark.fair` (in pieces of ``rows_per_piece``). The small tables it
    caches go on ``cached``, for the caller to unpersist when done.
    """
    if census_table is None:
        census_table = kept(census(df), cached)
    if limited is None:
        limited = bool(census_table.agg(_limited()).first()[0])
    if ordered is None:
        ordered = ordered_starts(df, tolerance_us, cached=cached, census_table=census_table, bursts=limited)
    if limited and swept is None:
        swept = swept_starts(df, cached=cached, census_table=census_table)
    if bodies is None:
        bodies = body_work(df, tolerance_us, rows_per_piece, cached, limited)
    body = body_tables(df, tolerance_us, *bodies, census_table, cached)
    ledger = auditable(df)
    placed = _placed(census_table)
    checked = limits.verdicts(swept, tolerance_us).withColumn("hour_n", _hour_of()) if limited else None
    limit_hours = audit_tables.limit_hours(checked, cached) if checked is not None else None
    flagged = audit_tables.flagged(checked, cached) if checked is not None else None
    hours = audit_tables.per_hour(ordered.withColumn("hour_n", _hour_of()), placed, cached, limit_hours)
    duplicates = audit_tables.duplicates(ordered, ledger, cached)
    missing = audit_tables.missing_tickets(ordered)
    summary = audit_tables.summary(audit_tables.figures(hours, "queue"), missing, duplicates)
    return {
        "summary": summary.join(body.pop("bodies"), "queue", "left"),
        "by_day": audit_tables.figures(hours, "queue", "day"),
        "by_hour": audit_tables.figures(hours, "queue", "hour"),
        "gaps": audit_tables.gap_histogram(hours.gaps),
        "rate": audit_tables.rate(ordered, hours.hourly),
        "workers": audit_tables.workers(placed),
        "violations": audit_tables.violations(ordered, ledger, cached, flagged),
        "limit_violations": audit_tables.limit_violations(flagged, ledger),
        **body,
        "duplicates": duplicates,
        **fair.tables(ledger.withColumn("hour_n", _hour_of()), fair.recorded(census_table), rows_per_piece, cached),
    }


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

    df, counted, unaudited, limited, reported = _read_and_check(spark, paths, fmt)
    done("(census)")
    # Every start in queue order with its gap and flags, written once (a narrow table) and
    # read back by the tables that need it: a second pass over Parquet costs less than
    # keeping it in memory, and nothing is sorted twice. The queues with limits beyond the
    # interval are swept once more (their events), written and read back the same way; and
    # the starts whose body reported, placed by their reports, are sorted and swept again.
    work, sweep = f"{out}/_ordered", f"{out}/_limits"
    body_work_dir, body_sweep = f"{out}/_bodies", f"{out}/_body_limits"
    cached: list[Any] = [counted]  # the small tables kept while they are read, dropped at the end
    try:
        write_table(ordered_starts(df, tolerance_us, rows_per_piece, cached, counted, limited), work)
        done("(ordered)")
        swept = None
        if limited:
            write_table(swept_starts(df, rows_per_piece, cached, counted), sweep)
            swept = read_table(spark, sweep)
            done("(limits)")
        bodies = _body_work_written(spark, df, tolerance_us, rows_per_piece, cached, limited, reported,
                                    body_work_dir, body_sweep, done)  # fmt: skip
        tables = audit(
            df, tolerance_us, read_table(spark, work), cached, counted, swept, limited, rows_per_piece, bodies
        )
        report: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "inputs": list(paths),
            "tolerance_us": tolerance_us,
        }
        write_tables(spark, tables, out, report, done)
    finally:
        for small in cached:
            small.unpersist()
        for path in (work, sweep, body_work_dir, body_sweep):
            remove(spark, path)
    report["rows"] = int(read_table(spark, f"{out}/summary").agg({"starts": "sum"}).first()[0] or 0)
    report["unaudited_rows"] = unaudited
    report["seconds"] = round(time.monotonic() - started, 1)
    report["rows_per_second"] = round(report["rows"] / max(report["seconds"], 0.1))
    write_report(spark, out, report)
    return report


def _body_work_written(
    spark: Any, df: Any, tolerance_us: int, rows_per_piece: int, cached: list[Any], limited: bool, reported: bool,
    work: str, sweep: str, done: Any,
) -> tuple[Any, Any] | None:  # fmt: skip
    """:func:`body_work`, written under ``work`` and ``sweep`` and read back when some row
    records its body's report (None: none does, and :func:`audit` finds nothing to sort)."""
    if not reported:
        return None
    ordered, swept = body_work(df, tolerance_us, rows_per_piece, cached, limited)
    write_table(ordered, work)
    if swept is not None:
        write_table(swept, sweep)
    done("(bodies)")
    return read_table(spark, work), read_table(spark, sweep) if swept is not None else None


if __name__ == "__main__":  # spark-submit .../siq_celery/spark/audit.py
    sys.exit(main())
