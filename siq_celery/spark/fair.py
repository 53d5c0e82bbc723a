"""Fair shares in ``siq audit``: the rows of fair tasks (ledger schema 4: ``fair_key``,
``fair_tag``, ``fair_weight``), per queue.

* **Shares.** Per queue and fairness key, its starts and cost units, its weight (the
  latest recorded) and its share of the queue's fair units; and the share its weight gives
  it among the keys that started in the same hour (its weight over the sum of their
  weights). A key with work all the time gets about that share; one that had none for a
  while gets less, and the others more: start-time fair queuing gives idle time no credit.
  ``fair_hours`` has them per hour; ``fair_keys`` over the whole ledger, the weight's
  share then the mean of the hours' weighted by the queue's units in each.
* **Order.** A fair queue hands its tickets out in the order of the virtual start tags it
  served (rules.fair_next): in ticket order, within an epoch, the tags never go down while
  some key has work, and start over from 0 when none has any (a *busy period* begins at
  each row of tag 0). A start whose tag is below the largest tag before it in its busy
  period was handed its ticket out of fair order: ``unfair``. Only the tags are checked,
  not the keys of equal tags: a key that joins at the current virtual time is served
  after a larger key of the same tag that was waiting, so key order among equal tags
  depends on arrivals the ledger does not record.

The order check is the start order's computation (:mod:`siq_celery.spark.pieces`) over
tickets: each queue's fair rows are cut into pieces of tickets, sorted and windowed each
on its own, and what a piece's first busy period carries in from the earlier pieces comes
from a small table of the unsorted rows, one row per (queue, epoch, piece): the answers of
one window over each epoch, row for row.
"""

from __future__ import annotations

from typing import Any

from siq_celery.spark.audit_tables import _with_hour_names as with_hour_names
from siq_celery.spark.pieces import ROWS_PER_PIECE, in_pieces, kept, piece_spans

#: The offending rows of each queue that go into report.json (the Parquet table has all).
UNFAIR_REPORTED = 20


def fair_rows(ledger: Any) -> Any:
    """The auditable ledger rows (with ``hour_n``) of fair tasks: a key, a tag of 0 or more
    and a weight of 1 or more (rows of schema 3 and before have none), with the cost held
    to 1 .. MAX_COST as the audit reads it."""
    from pyspark.sql import functions as F

    from siq_celery.client.queue import MAX_COST

    cost = F.least(F.greatest(F.coalesce(F.col("cost"), F.lit(1)), F.lit(1)), F.lit(MAX_COST)).cast("int")
    return ledger.filter(
        (F.coalesce(F.col("fair_key"), F.lit("")) != "") & (F.col("fair_tag") >= 0) & (F.col("fair_weight") >= 1)
    ).select(
        "queue", "epoch", "ticket", "task_id", "start_us", "hour_n", cost.alias("cost"), "fair_key", "fair_tag",
        "fair_weight",
    )  # fmt: skip


def recorded(census_table: Any) -> bool:
    """Whether some row of the ledger is a fair task's (``census_table``:
    :func:`siq_celery.spark.audit.census`, with the largest ``fair_weight`` of each group)."""
    from pyspark.sql import functions as F

    return bool(census_table.agg(F.coalesce(F.max("fair_weight") > 0, F.lit(False))).first()[0])


def tables(ledger: Any, fair: bool, rows_per_piece: int = ROWS_PER_PIECE, cached: list[Any] | None = None) -> Any:
    """The fair tables of ``ledger`` (the auditable rows, with ``hour_n``) by name:
    ``fair_keys``, ``fair_hours``, ``fair_order`` (per queue and hour: fair starts, busy
    periods begun, unfair starts) and ``unfair`` (the offending rows). ``fair``: some row
    records a fair share (False: the tables are empty, and the ledger is not read again)."""
    rows = fair_rows(ledger if fair else ledger.limit(0))
    hours = per_hour(rows, cached)
    checked = in_ticket_order(rows, rows_per_piece, cached)
    return {
        "fair_keys": per_key(hours),
        "fair_hours": with_hour_names(hours),
        "fair_order": order_per_hour(checked),
        "unfair": unfair_rows(checked),
    }


def per_hour(rows: Any, cached: list[Any] | None) -> Any:
    """Per queue, hour (``hour_n``) and key: ``starts``, ``units``, ``weight`` (its latest),
    ``share`` of the queue's units that hour and ``weight_share`` among the keys that
    started in it; cached (one row per key and hour)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    hour = Window.partitionBy("queue", "hour_n")
    latest = F.max(F.struct("start_us", "ticket", "fair_weight"))["fair_weight"]
    return (
        rows.groupBy("queue", "hour_n", "fair_key")
        .agg(F.count("*").alias("starts"), F.sum("cost").alias("units"), latest.alias("weight"))
        .withColumn("share", F.col("units") / F.sum("units").over(hour))
        .withColumn("weight_share", F.col("weight") / F.sum("weight").over(hour))
        .transform(lambda small: kept(small, cached))
    )


def per_key(hours: Any) -> Any:
    """:func:`per_hour` over the whole ledger, per queue and key: ``weight_share`` the mean
    of its hours' (0 in an hour it did not start in), weighted by the queue's units in each."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    queue = Window.partitionBy("queue")
    hour = Window.partitionBy("queue", "hour_n")
    latest = F.max(F.struct("hour_n", "weight"))["weight"]
    return (
        hours.withColumn("hour_units", F.sum("units").over(hour))
        .groupBy("queue", "fair_key")
        .agg(
            F.sum("starts").alias("starts"),
            F.sum("units").alias("units"),
            latest.alias("weight"),
            F.sum(F.col("weight_share") * F.col("hour_units")).alias("_expected"),
        )
        .withColumn("share", F.col("units") / F.sum("units").over(queue))
        .withColumn("weight_share", F.col("_expected") / F.sum("units").over(queue))
        .drop("_expected")
    )


def in_ticket_order(rows: Any, rows_per_piece: int = ROWS_PER_PIECE, cached: list[Any] | None = None) -> Any:
    """:func:`fair_rows` each with ``highest_before`` (the largest tag before it in its
    busy period, in ticket order within its epoch; null: none) and ``unfair`` (0 or 1),
    computed in pieces of tickets (see the module docstring)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    per_queue = rows.groupBy("queue").agg(
        F.min("ticket").alias("t0"), F.max("ticket").alias("t1"), F.count("*").alias("rows")
    )
    spans = piece_spans(per_queue, rows_per_piece).transform(lambda small: kept(small, cached))
    pieced = in_pieces(rows, spans, time="ticket")
    carried = _carried(pieced, cached)
    # ticket order (a ticket started twice: by start)
    in_piece = (
        Window.partitionBy("queue", "epoch", "piece")
        .orderBy("ticket", "start_us")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    in_period = (
        Window.partitionBy("queue", "epoch", "piece", "period")
        .orderBy("ticket", "start_us")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    return (
        pieced.repartition("queue", "piece")
        .withColumn("period", F.sum((F.col("fair_tag") == 0).cast("int")).over(in_piece))  # busy periods begun
        .withColumn("highest_in_piece", F.max("fair_tag").over(in_period))
        .join(F.broadcast(carried), ["queue", "epoch", "piece"], "left")
        .withColumn(
            "highest_before",  # before the piece's first busy period begins: the earlier pieces' too
            F.when(F.col("period") == 0, F.greatest("highest_in_piece", "carry")).otherwise(F.col("highest_in_piece")),
        )
        .withColumn("unfair", F.coalesce((F.col("fair_tag") < F.col("highest_before")).cast("int"), F.lit(0)))
        .drop("highest_in_piece", "carry", "period")
    )


def _carried(pieced: Any, cached: list[Any] | None) -> Any:
    """Per (queue, epoch, piece) of :func:`in_pieces` rows: ``carry``, the largest tag of its
    epoch's busy period under way where the piece begins, in the earlier pieces (null:
    none); cached. From two aggregates of the unsorted rows: each piece's last row of tag 0
    (where its last busy period begins), then its largest tag from there on (all of its
    rows' if it has none)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    keys = ["queue", "epoch", "piece"]
    at = F.struct("ticket", "start_us")
    starts = kept(
        pieced.groupBy(*keys).agg(
            F.max(F.when(F.col("fair_tag") == 0, at)).alias("last_zero"),
            F.sum((F.col("fair_tag") == 0).cast("long")).alias("zeros"),
        ),
        cached,
    )
    tails = (
        pieced.join(F.broadcast(starts), keys)
        .filter(F.col("last_zero").isNull() | (at >= F.col("last_zero")))
        .groupBy(*keys)
        .agg(F.max("fair_tag").alias("tail"))
    )
    # A piece's last busy period is the epoch's number `begun` (the zeros up to its end);
    # the one a piece begins in is its predecessor's: the largest tail among the pieces
    # before it that end in that same period.
    epoch = Window.partitionBy("queue", "epoch").orderBy("piece")
    upto = epoch.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    same_period = (
        Window.partitionBy("queue", "epoch", "begun")
        .orderBy("piece")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return kept(
        starts.join(tails, keys)
        .withColumn("begun", F.sum("zeros").over(upto))
        .withColumn("period_highest", F.max("tail").over(same_period))
        .withColumn("carry", F.lag("period_highest").over(epoch))
        .select(*keys, "carry"),
        cached,
    )


def order_per_hour(checked: Any) -> Any:
    """Per queue and hour: ``fair_starts``, ``busy_periods`` (begun: rows of tag 0) and
    ``unfair`` starts."""
    from pyspark.sql import functions as F

    return with_hour_names(
        checked.groupBy("queue", "hour_n").agg(
            F.count("*").alias("fair_starts"),
            F.sum((F.col("fair_tag") == 0).cast("long")).alias("busy_periods"),
            F.sum("unfair").cast("long").alias("unfair"),
        )
    )


def unfair_rows(checked: Any) -> Any:
    """The starts handed their tickets out of fair order, with the largest tag before each."""
    from pyspark.sql import functions as F

    return checked.filter(F.col("unfair") == 1).select(
        "queue", "epoch", "ticket", "task_id", "start_us", "fair_key", "fair_tag", "highest_before", "fair_weight"
    )


def first_unfair(table: Any, count: int = UNFAIR_REPORTED) -> Any:
    """The first ``count`` rows of :func:`unfair_rows` of each queue, by epoch and ticket."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    first = Window.partitionBy("queue").orderBy("epoch", "ticket", "start_us")
    return table.withColumn("_n", F.row_number().over(first)).filter(F.col("_n") <= count).drop("_n")
