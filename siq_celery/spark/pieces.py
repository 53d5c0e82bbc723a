"""A queue's ledger in start order, computed in pieces that run in parallel.

The audit needs, for each start, the start just before it in its queue (for the gap) and
the highest ticket started before it in its epoch (for order inversions). A window over
the whole queue would sort every start of a queue in one Spark task: one busy queue, the
usual fleet, would get one core on any cluster. Instead each queue's rows are cut by
start time into *pieces* of about ``rows_per_piece`` rows, each piece is sorted and
windowed on its own (in parallel), and only the first row of a piece needs what came
before it. That comes from a small table with one row per (queue, epoch, piece): the last
start of the nearest earlier piece, and the highest ticket of every earlier piece of the
epoch. The answers are those of one window over the whole queue, row for row.
"""

from __future__ import annotations

from typing import Any

#: About this many rows of one queue are sorted together in one Spark task.
ROWS_PER_PIECE = 400_000


def in_start_order(
    df: Any, tolerance_us: int, rows_per_piece: int = ROWS_PER_PIECE, cached: list[Any] | None = None
) -> Any:
    """``df`` (ledger rows with a queue, a start and an epoch: none of them null) with
    ``prev_start_us``, ``gap_us``, ``violation`` (a gap below ``interval_us -
    tolerance_us``), ``highest_before`` and ``inversion`` (0 or 1), in the order
    (start_us, ticket) of each queue, and the ``piece`` each row was computed in. The
    small tables it caches go on ``cached``, for the caller to unpersist when done."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be at least 1, not {rows_per_piece}")
    # The small tables are computed once (cached) and broadcast: each is one row per
    # queue, or per (queue, epoch, piece).
    spans = (
        df.groupBy("queue")
        .agg(
            F.min("start_us").alias("t0"),
            F.max("start_us").alias("t1"),
            F.greatest(F.lit(1), F.ceil(F.count("*") / F.lit(rows_per_piece))).cast("long").alias("pieces"),
        )
        .transform(lambda small: kept(small, cached))
    )
    # Equal stretches of time: a piece is a range of start_us, so equal starts share one,
    # and every row of an earlier piece started no later than any row of a later one.
    # (In doubles: a hostile start_us must not overflow; division and product are monotone.)
    from_t0 = F.col("start_us").cast("double") - F.col("t0").cast("double")
    width = F.col("t1").cast("double") - F.col("t0").cast("double") + 1.0
    pieced = (
        df.join(F.broadcast(spans), "queue")
        .withColumn("piece", F.floor(from_t0 / width * F.col("pieces")).cast("long"))
        .drop("t0", "t1", "pieces")
    )
    ends = (
        pieced.groupBy("queue", "epoch", "piece")
        .agg(F.max("start_us").alias("piece_last_us"), F.max("ticket").alias("piece_highest"))
        .transform(lambda small: kept(small, cached))
    )
    by_queue = Window.partitionBy("queue").orderBy("piece")
    carried = (
        ends.groupBy("queue", "piece")
        .agg(F.max("piece_last_us").alias("piece_last_us"))
        .withColumn("carry_start_us", F.lag("piece_last_us").over(by_queue))
        .select("queue", "piece", "carry_start_us")
    )
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
    return (
        pieced.repartition("queue", "piece")
        .withColumn("prev_in_piece", F.lag("start_us").over(in_piece))
        .withColumn("highest_in_piece", F.max("ticket").over(in_piece_epoch))
        .join(F.broadcast(carried), ["queue", "piece"])
        .join(F.broadcast(highest), ["queue", "epoch", "piece"])
        .withColumn("prev_start_us", F.coalesce("prev_in_piece", "carry_start_us"))
        .withColumn("highest_before", F.greatest("highest_in_piece", "carry_highest"))
        .drop("prev_in_piece", "carry_start_us", "highest_in_piece", "carry_highest")
        .withColumn("gap_us", F.col("start_us") - F.col("prev_start_us"))
        .withColumn(
            "violation", F.coalesce((F.col("gap_us") < F.col("interval_us") - tolerance_us).cast("int"), F.lit(0))
        )
        .withColumn("inversion", F.coalesce((F.col("ticket") < F.col("highest_before")).cast("int"), F.lit(0)))
    )


def kept(df: Any, cached: list[Any] | None) -> Any:
    """``df`` cached, and listed on ``cached`` (if given) so that it can be unpersisted."""
    df = df.cache()
    if cached is not None:
        cached.append(df)
    return df
