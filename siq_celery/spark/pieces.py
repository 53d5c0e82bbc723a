"""A queue's ledger in start order, computed in pieces that run in parallel.

The audit needs, for each start, the start just before it in its queue (for the gap, and
the gap it required: a start of cost c holds the next one c intervals away) and the
highest ticket started before it in its epoch (for order inversions; ticket 0, a start
with no place in this queue's line, takes no part). A window over
the whole queue would sort every start of a queue in one Spark task: one busy queue, the
usual fleet, would get one core on any cluster. Instead each queue's rows are cut by
start time into *pieces* of about ``rows_per_piece`` rows, each piece is sorted and
windowed on its own (in parallel), and only the first row of a piece needs what came
before it. That comes from a small table with one row per (queue, epoch, piece),
:func:`piece_ends`: the last start (and its last slot) of the nearest earlier piece, and
the highest ticket of every earlier piece of the epoch. It is an aggregate of the unsorted rows, made
before the sort, so the sort's own pass gives every row its final answers. Those are
the answers of one window over the whole queue, row for row.
"""

from __future__ import annotations

from typing import Any

#: About this many rows of one queue are sorted together in one Spark task.
ROWS_PER_PIECE = 400_000


def piece_spans(per_queue: Any, rows_per_piece: int = ROWS_PER_PIECE) -> Any:
    """One row per queue (``queue``, ``t0``, ``t1``, ``pieces``) from ``per_queue``
    (``queue``, ``t0``: first start, ``t1``: last start, ``rows``)."""
    from pyspark.sql import functions as F

    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be at least 1, not {rows_per_piece}")
    pieces = F.greatest(F.lit(1), F.ceil(F.col("rows") / F.lit(rows_per_piece))).cast("long")
    return per_queue.select("queue", "t0", "t1", pieces.alias("pieces"))


def in_pieces(df: Any, spans: Any, time: str = "start_us") -> Any:
    """``df`` (rows with a queue and a start) with the ``piece`` of each row. ``spans``:
    :func:`piece_spans` of the same rows. ``time``: the column that places a row (the
    limits' sweep places its events by when they happen)."""
    from pyspark.sql import functions as F

    # Equal stretches of time: a piece is a range of start_us, so equal starts share one,
    # and every row of an earlier piece started no later than any row of a later one.
    # (In doubles: a hostile start_us must not overflow; division and product are monotone.)
    from_t0 = F.col(time).cast("double") - F.col("t0").cast("double")
    width = F.col("t1").cast("double") - F.col("t0").cast("double") + 1.0
    return (
        df.join(F.broadcast(spans), "queue")
        .withColumn("piece", F.floor(from_t0 / width * F.col("pieces")).cast("long"))
        .drop("t0", "t1", "pieces")
    )


def last_slot_us() -> Any:
    """When a start's last slot falls: a start of ``cost`` c is recorded as if its last slot
    were used (c - 1) intervals after it (rules.commit_start); a missing cost is 1."""
    from pyspark.sql import functions as F

    extra = F.greatest(F.coalesce(F.col("cost"), F.lit(1)) - 1, F.lit(0))
    return F.col("start_us") + extra * F.coalesce(F.col("interval_us"), F.lit(0))


def burst_allowed(columns: list[str]) -> Any:
    """Whether the row's start came under a burst (B > 0: the pairwise spacing check does
    not apply; :mod:`siq_celery.spark.limits` checks GCRA's bound). Rows of a table without
    a ``burst`` column (``columns``), or with a null one (schema 1 and 2), have none."""
    from pyspark.sql import functions as F

    return F.coalesce(F.col("burst") > 0, F.lit(False)) if "burst" in columns else F.lit(False)


def in_line() -> Any:
    """The ticket, or null for ticket 0 (a start with no place in the queue's line: a
    combined limit's queues other than the one holding its ticket)."""
    from pyspark.sql import functions as F

    return F.when(F.col("ticket") != 0, F.col("ticket"))


def piece_ends(pieced: Any, cached: list[Any] | None = None) -> Any:
    """The small table of :func:`in_pieces` rows (one row per queue, epoch and piece: the
    last start, as ``piece_last`` (start_us, ticket, end_us: its last slot), and the
    highest ticket), cached and listed on ``cached``. An aggregate of the unsorted rows: it
    needs no sort, so it is made before the sort, not from it."""
    from pyspark.sql import functions as F

    last = F.struct(F.col("start_us"), F.col("ticket"), last_slot_us().alias("end_us"))
    return (
        pieced.groupBy("queue", "epoch", "piece")
        .agg(F.max(last).alias("piece_last"), F.max(in_line()).alias("piece_highest"))
        .transform(lambda small: kept(small, cached))
    )


def in_start_order(pieced: Any, ends: Any, tolerance_us: int) -> Any:
    """:func:`in_pieces` rows, each piece sorted and windowed on its own, with
    ``prev_start_us``, ``gap_us``, ``required_gap_us`` (the interval, plus (c - 1) intervals
    of the previous start's if its cost c was more than 1), ``violation`` (a gap below
    ``required_gap_us - tolerance_us``), ``highest_before`` and ``inversion`` (0 or 1; never
    for ticket 0), as one window over each whole queue gives them. ``ends``:
    :func:`piece_ends` of the same rows."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by_queue = Window.partitionBy("queue").orderBy("piece")
    carried = (
        ends.groupBy("queue", "piece")
        .agg(F.max("piece_last").alias("piece_last"))
        .withColumn("carry", F.lag("piece_last").over(by_queue))
        .select("queue", "piece", F.col("carry.start_us").alias("carry_start_us"),
                F.col("carry.end_us").alias("carry_end_us"))
    )  # fmt: skip
    earlier_in_epoch = Window.partitionBy("queue", "epoch").orderBy("piece").rowsBetween(Window.unboundedPreceding, -1)
    highest = ends.withColumn("carry_highest", F.max("piece_highest").over(earlier_in_epoch)).select(
        "queue", "epoch", "piece", "carry_highest"
    )
    in_piece = Window.partitionBy("queue", "piece").orderBy("start_us", "ticket")
    in_piece_epoch = (
        Window.partitionBy("queue", "piece", "epoch")
        .orderBy("start_us", "ticket")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    first_in_piece = F.lag("start_us").over(in_piece).isNull()
    pairwise = ~burst_allowed(pieced.columns)
    return (
        pieced.repartition("queue", "piece")
        .withColumn("prev_in_piece", F.lag("start_us").over(in_piece))
        .withColumn("prev_end_in_piece", F.lag(last_slot_us()).over(in_piece))
        .withColumn("highest_in_piece", F.max(in_line()).over(in_piece_epoch))
        .join(F.broadcast(carried), ["queue", "piece"])
        .join(F.broadcast(highest), ["queue", "epoch", "piece"])
        .withColumn("prev_start_us", F.when(first_in_piece, F.col("carry_start_us")).otherwise(F.col("prev_in_piece")))
        .withColumn("prev_end_us", F.when(first_in_piece, F.col("carry_end_us")).otherwise(F.col("prev_end_in_piece")))
        .withColumn("highest_before", F.greatest("highest_in_piece", "carry_highest"))
        .drop("prev_in_piece", "prev_end_in_piece", "carry_start_us", "carry_end_us", "highest_in_piece",
              "carry_highest")
        .withColumn("gap_us", F.col("start_us") - F.col("prev_start_us"))
        .withColumn("required_gap_us", F.col("prev_end_us") - F.col("prev_start_us") + F.col("interval_us"))
        .drop("prev_end_us")
        .withColumn(
            "violation",  # a start the burst allowed is checked by GCRA instead (limits.py)
            F.coalesce(
                ((F.col("gap_us") < F.col("required_gap_us") - tolerance_us) & pairwise).cast("int"), F.lit(0)
            ),
        )
        .withColumn(
            "inversion", F.coalesce((in_line() < F.col("highest_before")).cast("int"), F.lit(0))
        )
    )  # fmt: skip


def queue_in_start_order(
    df: Any, tolerance_us: int, rows_per_piece: int = ROWS_PER_PIECE, cached: list[Any] | None = None
) -> Any:
    """:func:`in_start_order` of ``df`` (ledger rows with a queue, a start and an epoch:
    none of them null), its pieces cut here; the small tables it caches go on ``cached``."""
    from pyspark.sql import functions as F

    per_queue = df.groupBy("queue").agg(
        F.min("start_us").alias("t0"), F.max("start_us").alias("t1"), F.count("*").alias("rows")
    )
    spans = piece_spans(per_queue, rows_per_piece).transform(lambda small: kept(small, cached))
    pieced = in_pieces(df, spans)
    return in_start_order(pieced, piece_ends(pieced, cached), tolerance_us)


def kept(df: Any, cached: list[Any] | None) -> Any:
    """``df`` cached, and listed on ``cached`` (if given) so that it can be unpersisted."""
    df = df.cache()
    if cached is not None:
        cached.append(df)
    return df
