"""The tables of ``siq audit``, each from the starts in order
(:func:`siq_celery.spark.audit.ordered_starts`), the placed rows of the census
(:func:`siq_celery.spark.audit.census`) or the auditable ledger rows.

Per-hour figures are aggregated once (:func:`per_hour`) and rolled up to days and queues
(:func:`figures`); percentiles are exact, read from value histograms (a gap or a lateness
in microseconds takes few distinct values), so they do not depend on how Spark split the
work. The small tables cached here go on ``cached``, for the caller to unpersist when done.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from siq_celery.spark.pieces import kept

GAP_BIN = 0.05  # histogram bins, in intervals
GAP_BINS_MAX = 60  # gaps of 3 intervals or more share the last bin
RATE_BUCKETS = 60
#: A cached table of at most this many rows is broadcast to a join, not shuffled with it.
BROADCAST_ROWS = 1_000_000


class PerHour(NamedTuple):
    """What :func:`figures` rolls up, one row per queue and hour (``hour`` and ``day``
    named), cached: the figures that add up, and the counts of each distinct gap and
    lateness (for exact percentiles)."""

    hourly: Any
    gaps: Any
    lateness: Any


def per_hour(rows: Any, placed: Any, cached: list[Any] | None, limits: Any = None) -> PerHour:
    """:class:`PerHour` of ``rows`` (the starts in order, with ``hour_n``); ``placed``: the
    census rows with a queue and an hour, for the worker hosts of each hour; ``limits``:
    :func:`limit_hours` (None: no row records a limit beyond the interval)."""
    from pyspark.sql import functions as F

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
        .transform(lambda table: _with_limits(table, limits))
        .transform(_with_hour_names)
        .transform(lambda small: kept(small, cached))  # one row per queue and hour
    )
    # One row per distinct gap (with its interval) or lateness, in µs, per hour.
    return PerHour(hourly, _counts(rows, cached, "interval_us", "gap_us"), _counts(rows, cached, "lateness_us"))


def _with_limits(hourly: Any, limits: Any) -> Any:
    """The hourly figures with those of :func:`limit_hours` (None: 0 violations, no peaks);
    a burst's starts beyond its allowance count among the spacing violations."""
    from pyspark.sql import functions as F

    if limits is None:
        return hourly.select(
            "*", *(F.lit(0).cast("long").alias(c) for c in ("window_violations", "concurrency_violations")),
            *(F.lit(None).cast("long").alias(c) for c in ("max_window_units", "max_in_flight")),
        )  # fmt: skip
    return (
        hourly.join(limits, ["queue", "hour_n"], "left")
        .fillna(0, ["burst_violations", "window_violations", "concurrency_violations"])
        .withColumn("violations", F.col("violations") + F.col("burst_violations"))
        .drop("burst_violations")
    )


def _counts(rows: Any, cached: list[Any] | None, *values: str) -> Any:
    """How many of ``rows`` have each distinct ``values`` per queue and hour (a null last
    value is no value), cached."""
    from pyspark.sql import functions as F

    return (
        rows.filter(F.col(values[-1]).isNotNull())
        .groupBy("queue", "hour_n", *values)
        .agg(F.count("*").alias("n"))
        .transform(_with_hour_names)
        .transform(lambda small: kept(small, cached))
    )


def _with_hour_names(table: Any) -> Any:
    """``table`` with its ``hour_n`` as text: ``hour`` (``yyyy-MM-dd HH:00``) and ``day``."""
    from pyspark.sql import functions as F

    text = F.date_format(F.expr("timestamp_micros(hour_n * 3600000000)"), "yyyy-MM-dd HH:00")
    return table.withColumn("hour", text).withColumn("day", F.substring(text, 1, 10)).drop("hour_n")


def figures(hours: PerHour, *keys: str) -> Any:
    """The summary figures per ``keys`` (``queue``; ``queue, day``; ``queue, hour``), from
    :func:`per_hour`."""
    from pyspark.sql import functions as F

    table = hours.hourly.groupBy(*keys).agg(
        F.sum("starts").alias("starts"),
        F.sum("slots").alias("slots"),
        F.max(F.struct("last_start_us", "last_cost"))["last_cost"].alias("last_cost"),
        F.min("first_start_us").alias("first_start_us"),
        F.max("last_start_us").alias("last_start_us"),
        (F.sum("interval_sum") / F.sum("interval_count")).alias("mean_interval_us"),
        F.sum("violations").alias("violations"),
        F.sum("window_violations").alias("window_violations"),
        F.sum("concurrency_violations").alias("concurrency_violations"),
        F.max("max_window_units").alias("max_window_units"),
        F.max("max_in_flight").alias("max_in_flight"),
        F.sum("inversions").alias("inversions"),
        (F.min("min_gap_us") / 1000).alias("min_gap_ms"),
        (F.max("lateness_max_us") / 1000).alias("lateness_max_ms"),
        F.sum("unfinished").alias("unfinished"),
        F.sum("failures").alias("failures"),
        F.size(F.array_distinct(F.flatten(F.collect_list("hosts")))).alias("worker_hosts"),
    )
    gaps = _percentiles(hours.gaps, list(keys), "gap_us", {"gap_p50_ms": 0.5, "gap_p01_ms": 0.01})
    late = _percentiles(hours.lateness, list(keys), "lateness_us", {"lateness_p50_ms": 0.5, "lateness_p99_ms": 0.99})
    return _with_rates(table.join(gaps, list(keys), "left").join(late, list(keys), "left"))


def _with_rates(table: Any) -> Any:
    """``table`` with its achieved and target rate, in slots: a start of cost c takes c of
    them, and the last start's are not yet used up."""
    from pyspark.sql import functions as F

    span_s = (F.col("last_start_us") - F.col("first_start_us")) / 1e6
    return (
        table.withColumn("achieved_rate", F.when(span_s > 0, (F.col("slots") - F.col("last_cost")) / span_s))
        .drop("last_cost")
        .withColumn("target_rate", 1e6 / F.col("mean_interval_us"))
        .withColumn("rate_pct", F.round(100 * F.col("achieved_rate") / F.col("target_rate"), 2))
    )


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


def summary(by_queue: Any, missing: Any, duplicated: Any) -> Any:
    """One row per queue: :func:`figures` by queue, with :func:`missing_tickets` and the
    starts beyond the first of each task id in ``duplicated`` (:func:`duplicates`)."""
    from pyspark.sql import functions as F

    dup_per_queue = duplicated.groupBy("queue").agg(F.sum(F.col("starts") - 1).alias("duplicate_starts"))
    return (
        by_queue.join(missing, "queue", "left")
        .join(dup_per_queue, "queue", "left")
        .fillna(0, ["duplicate_starts", "missing_tickets"])
    )


def duplicates(ordered: Any, ledger: Any, cached: list[Any] | None) -> Any:
    """The task ids started more than once in a queue, with their starts and tickets (cached:
    the summary reads them too)."""
    from pyspark.sql import functions as F

    # First by a 64-bit hash (a cheap key for a shuffle of every start), then exactly, by
    # the ids themselves, among the few whose hash repeats. The hashes ride in the sorted
    # table; the ids are read again only where a hash repeats.
    repeated = kept(
        ordered.filter(F.col("id_hash").isNotNull()).groupBy("id_hash").count().filter(F.col("count") > 1),
        cached,
    ).select("id_hash")
    ids = ledger.filter(F.col("task_id").isNotNull()).select(
        "queue", "task_id", "ticket", F.xxhash64("queue", "task_id").alias("id_hash")
    )
    return (
        ids.join(_small(repeated), "id_hash", "left_semi")
        .groupBy("queue", "task_id")
        .agg(F.count("*").alias("starts"), F.collect_list("ticket").alias("tickets"))
        .filter(F.col("starts") > 1)
        .transform(lambda few: kept(few, cached))
    )


def missing_tickets(ordered: Any) -> Any:
    """Per queue, the tickets never started (``missing_tickets``) and the ``epochs``."""
    from pyspark.sql import functions as F

    # Exactly and without a shuffle of every ticket: each group of 64 consecutive numbers
    # becomes one 64-bit mask of the numbers seen. A start of cost c used tickets ticket ..
    # ticket + c - 1 (a mask for each block they touch); ticket 0 is no ticket (a start with
    # no place in this queue's line).
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
    return started_tickets.groupBy("queue").agg(
        F.sum("missing_tickets").alias("missing_tickets"), F.count("*").alias("epochs")
    )


def gap_histogram(gap_counts: Any) -> Any:
    """Starts per queue by gap / interval, in bins of :data:`GAP_BIN` (the last one open)."""
    from pyspark.sql import functions as F

    return (
        gap_counts.withColumn(
            "bin", F.least(F.floor(F.col("gap_us") / F.col("interval_us") / GAP_BIN), F.lit(GAP_BINS_MAX))
        )
        .groupBy("queue", "bin")
        .agg(F.sum("n").alias("count"))
        .withColumn("from_intervals", F.col("bin") * GAP_BIN)
    )


def rate(ordered: Any, hourly: Any) -> Any:
    """Starts, slots and the rate against the target in about :data:`RATE_BUCKETS` equal
    stretches of each queue's time (``hourly``: :attr:`PerHour.hourly`)."""
    from pyspark.sql import functions as F

    span = hourly.groupBy("queue").agg(F.min("first_start_us").alias("t0"), F.max("last_start_us").alias("t1"))
    bucket_us = F.greatest(F.ceil((F.col("t1") - F.col("t0") + 1) / RATE_BUCKETS), F.lit(1))
    return (
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


def workers(placed: Any) -> Any:
    """Starts per queue, worker host and process, with each one's share of its queue's."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    return (
        placed.groupBy("queue", "host", "pid")
        .agg(F.sum("n").alias("starts"))
        .withColumn("share", F.col("starts") / F.sum("starts").over(Window.partitionBy("queue")))
    )


def violations(ordered: Any, ledger: Any, cached: list[Any] | None, flagged: Any = None) -> Any:
    """The starts too soon after the one before them, with their task ids, found again in
    the ledger by queue, epoch, ticket and start (rows that tie on all four are listed
    together). ``flagged``: :func:`flagged` (the starts beyond a burst's allowance are
    among them: ``required_gap_us`` is then the distance from the start before to the
    earliest start GCRA allowed)."""
    from pyspark.sql import functions as F

    keys = ["queue", "epoch", "ticket", "start_us"]
    offending = ordered.filter(F.col("violation") == 1).select(
        *keys,
        (F.col("start_us") - F.col("gap_us")).alias("prev_start_us"),
        "gap_us",
        "required_gap_us",
        "interval_us",
    )
    if flagged is not None:
        offending = offending.unionByName(
            flagged.filter(F.col("kind") == "burst").select(
                *keys, "prev_start_us", (F.col("start_us") - F.col("prev_start_us")).alias("gap_us"),
                (F.col("limit_us") - F.col("prev_start_us")).alias("required_gap_us"), "interval_us",
            )
        )  # fmt: skip
    return (
        _small(kept(offending, cached))
        .join(ledger.select(*keys, "task_id", "host", "pid"), keys)
        .select("queue", "epoch", "ticket", "task_id", "prev_start_us", "start_us", "gap_us", "required_gap_us",
                "interval_us", "host", "pid")
    )  # fmt: skip


def limit_hours(checked: Any, cached: list[Any] | None) -> Any:
    """Per queue and hour (``hour_n``) of ``checked`` (:func:`siq_celery.spark.limits.verdicts`
    with ``hour_n``): the starts beyond a burst's allowance, window and concurrency
    violations, and the most units in a window and leases in flight at a start (null
    without a quota, a cap), cached."""
    from pyspark.sql import functions as F

    return kept(
        checked.groupBy("queue", "hour_n").agg(
            F.sum("burst_violation").cast("long").alias("burst_violations"),
            F.sum("window_violation").cast("long").alias("window_violations"),
            F.sum("concurrency_violation").cast("long").alias("concurrency_violations"),
            F.max(F.when(F.col("quota") > 0, F.col("window_units"))).cast("long").alias("max_window_units"),
            F.max(F.when(F.col("concurrency") > 0, F.col("in_flight"))).cast("long").alias("max_in_flight"),
        ),
        cached,
    )


def flagged(checked: Any, cached: list[Any] | None) -> Any:
    """The starts of ``checked`` (:func:`siq_celery.spark.limits.verdicts`) that broke a
    limit, one row per limit broken: ``kind`` (``burst``, ``window``, ``concurrency``),
    ``value`` (units in the window, leases in flight; for a burst, the start itself),
    ``limit`` (the quota, the cap; the burst) and ``limit_us`` (a burst's earliest allowed
    start), cached (a few rows)."""
    from pyspark.sql import functions as F

    kinds = [
        ("burst", "burst_violation", F.col("start_us"), F.col("burst")),
        ("window", "window_violation", F.col("window_units"), F.col("quota")),
        ("concurrency", "concurrency_violation", F.col("in_flight"), F.col("concurrency")),
    ]
    parts = [
        checked.filter(F.col(flag) == 1).select(
            "queue", "epoch", "ticket", "start_us", "prev_start_us", "interval_us", "window_us",
            F.lit(kind).alias("kind"), value.cast("long").alias("value"), limit.cast("long").alias("limit"),
            F.col("burst_cap_us").alias("limit_us"),
        )
        for kind, flag, value, limit in kinds
    ]  # fmt: skip
    return kept(parts[0].unionByName(parts[1]).unionByName(parts[2]), cached)


def limit_violations(flagged: Any, ledger: Any) -> Any:
    """The starts that broke a window quota or a concurrency cap, with their task ids (found
    again in the ledger as :func:`violations` finds its rows): ``kind``, ``value`` (units in
    the window at the start, itself included; leases in flight, its own included) and
    ``limit`` (the quota, the cap)."""
    from pyspark.sql import functions as F

    columns = ("queue", "epoch", "ticket", "task_id", "start_us", "kind", "value", "limit", "window_us", "host", "pid")
    if flagged is None:
        return ledger.sparkSession.createDataFrame(
            [], "queue string, epoch string, ticket long, task_id string, start_us long, kind string, value long, "
            "limit long, window_us long, host string, pid int",
        )  # fmt: skip
    keys = ["queue", "epoch", "ticket", "start_us"]
    return (
        _small(flagged.filter(F.col("kind") != "burst").drop("interval_us", "prev_start_us", "limit_us"))
        .join(ledger.select(*keys, "task_id", "host", "pid"), keys)
        .select(*columns)
    )


def _small(table: Any) -> Any:
    """``table`` (cached) marked for broadcast if it is small: the few offending rows are
    then matched in one pass over the ledger, with no shuffle of the ledger."""
    from pyspark.sql import functions as F

    return F.broadcast(table) if table.count() <= BROADCAST_ROWS else table
