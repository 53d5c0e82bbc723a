"""The checks of the limits beyond the interval: burst, window quota, concurrency cap.

Each is a sweep over a queue's events in time order, computed in pieces like the start
order (:mod:`siq_celery.spark.pieces`), and only for the queues whose ledger rows record a
limit (ledger schema 3). What each checks, on the store's clock, against the limits the
row of each start records (those in force when it was authorized):

* **Window quota.** A start of cost c counts ``min(c, quota)`` units from its start until
  one window later: it leaves the window at ``start + window`` (half-open, as the store
  forgets a start at or before ``now - window``). The units in the window at a start,
  counting the starts before it in start order and itself, above its quota: a window
  violation. No window of that length then holds more than the quota, and each start
  that made one hold more is reported, once.
* **Concurrency cap.** A start under a cap took a lease. It is in flight from its start
  until its finish gave the lease back (``finish_us``, the same atomic step), or, when no
  finish gave it back (none came, or the lease had expired), until ``start + lease_us``:
  the store held a lease not renewed for that long, and a renewed one longer (the ledger
  does not record renewals), so the count can only be low there, never high. A row
  without a recorded ``lease_us`` and without a finish counts at its own start only. The
  starts in flight at a start (those before it in start order whose lease is still held:
  ``end > start``), with itself, above its cap: a concurrency violation.
* **Burst** (a start whose row records burst B > 0). GCRA's virtual scheduling on the
  ledger's own starts, with every start, tolerance B x interval: ``L`` (the store's
  ``last_start_us``) follows ``L_k = max(L_(k-1) + I_k, t_k) + (c_k - 1) I_k``, and start k
  breaks the burst bound when ``t_k < L_(k-1) + I_k - B I_k - tolerance``. For a constant
  interval and starts of cost 1 this is exactly "some half-open window of length W ending
  at start k holds more than ceil(W / I) + B starts" (docs/design.md, "The audit"). Rows of
  burst 0 keep the pairwise spacing check of :mod:`siq_celery.spark.pieces`.

The sweep: the starts of the limited queues with two kinds of events, a window exit at
``start + window`` (minus its units) and a lease end (minus one), sorted per piece by time,
events before starts at the same microsecond. Running sums give the units in the window
and the starts in flight, each piece's carried in from an aggregate of the unsorted
events of the earlier pieces, as :mod:`siq_celery.spark.pieces` carries its values: one
sort of the events, no join back. GCRA's recursion is a running maximum over the starts
(``L_k - P_k = max over j <= k of (t_j - I_j - P_(j-1))``, ``P`` the running sum of cost x
interval); its carry between pieces needs each earlier piece's maximum after its sort, so
the swept starts are written once (:func:`swept_starts`) and each start's verdict is made
when they are read back (:func:`verdicts`), with a small table per piece.
"""

from __future__ import annotations

from typing import Any

from siq_celery.spark.pieces import in_pieces, kept, piece_spans

#: Event kinds, in the order they are swept at one microsecond: a lease end or a window exit
#: (the half-open window: gone at that microsecond), then the starts.
LEAVES, STARTS = 0, 1


def limited_rows(df: Any, limited: Any) -> Any:
    """The auditable ledger rows of the queues in ``limited`` (one ``queue`` column), with
    what the sweep needs, clamped as the audit reads them: ``c`` the cost (1 ..
    MAX_COST), ``units`` of the window, ``leased`` (0/1) and ``end_us`` (when its lease
    stopped counting; see the module docstring)."""
    from pyspark.sql import functions as F

    from siq_celery.client.queue import MAX_COST

    quota = F.coalesce(F.col("quota"), F.lit(0))
    window = F.coalesce(F.col("window_us"), F.lit(0))
    cap = F.coalesce(F.col("concurrency"), F.lit(0))
    lease_us = F.coalesce(F.col("lease_us"), F.lit(0))
    cost = F.least(F.greatest(F.coalesce(F.col("cost"), F.lit(1)), F.lit(1)), F.lit(MAX_COST)).cast("long")
    given_back = F.col("finish_us").isNotNull() & F.coalesce(F.col("lease_returned"), F.lit(True))
    end = (
        F.when(given_back, F.col("finish_us"))
        .when(lease_us > 0, F.col("start_us") + lease_us)
        .otherwise(F.col("start_us"))
    )
    return (
        df.join(F.broadcast(limited), "queue", "left_semi")
        .select(
            "queue", "epoch", "ticket", "start_us", F.coalesce(F.col("interval_us"), F.lit(0)).alias("interval_us"),
            cost.alias("c"), F.greatest(F.coalesce(F.col("burst"), F.lit(0)), F.lit(0)).alias("burst"),
            F.when((quota > 0) & (window > 0), quota).otherwise(0).alias("quota"),
            F.when((quota > 0) & (window > 0), window).otherwise(0).alias("window_us"),
            F.greatest(cap, F.lit(0)).alias("concurrency"),
            F.greatest(end, F.col("start_us")).alias("end_us"),
        )
        .withColumn("units", F.when(F.col("quota") > 0, F.least("c", "quota")).otherwise(0))
        .withColumn("leased", (F.col("concurrency") > 0).cast("int"))
    )  # fmt: skip


def events(rows: Any) -> Any:
    """:func:`limited_rows` and their events, one row each: ``t_us`` when it happens,
    ``kind`` (:data:`LEAVES` or :data:`STARTS`), ``du`` (window units it adds) and ``dn``
    (leases it adds). A lease that ends at its own start adds none (it is counted at its
    own start only: :func:`swept_starts`)."""
    from pyspark.sql import functions as F

    held = (F.col("leased") == 1) & (F.col("end_us") > F.col("start_us"))
    starts = rows.select(
        "*", F.col("start_us").alias("t_us"), F.lit(STARTS).alias("kind"), F.col("units").alias("du"),
        held.cast("int").alias("dn"),
    )  # fmt: skip
    nothing = [F.lit(None).cast(t).alias(c) for c, t in rows.dtypes if c not in ("queue",)]
    exits = rows.filter(F.col("units") > 0).select(
        "queue", *nothing, (F.col("start_us") + F.col("window_us")).alias("t_us"), F.lit(LEAVES).alias("kind"),
        (-F.col("units")).alias("du"), F.lit(0).alias("dn"),
    )  # fmt: skip
    ends = rows.filter(held).select(
        "queue", *nothing, F.col("end_us").alias("t_us"), F.lit(LEAVES).alias("kind"), F.lit(0).alias("du"),
        F.lit(-1).alias("dn"),
    )  # fmt: skip
    return starts.unionByName(exits).unionByName(ends)


def swept_starts(df: Any, limited: Any, per_queue: Any, rows_per_piece: int, cached: list[Any] | None) -> Any:
    """The starts of the ``limited`` queues of ``df`` (auditable ledger rows), each with
    ``window_units`` (units in the window at it, itself included) and ``in_flight``
    (leases held at it, its own included), final, and the values of GCRA's recursion within
    its piece, which :func:`verdicts` completes: ``p_prev`` (cost x interval of the earlier
    starts of the piece), ``m_prev`` (their running maximum) and ``q`` (its own term).
    ``per_queue``: ``queue``, ``t0``, ``t1`` and ``rows`` of every queue (the census's)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    spans = piece_spans(per_queue.join(F.broadcast(limited), "queue", "left_semi"), rows_per_piece)
    spans = kept(spans, cached)
    # Events after a queue's last start change no answer: their piece is past the last.
    pieced = (
        in_pieces(events(limited_rows(df, limited)), spans.withColumn("last_piece", F.col("pieces") - 1), "t_us")
        .filter(F.col("piece") <= F.col("last_piece"))
        .drop("last_piece")
    )
    ci = F.when(F.col("kind") == STARTS, F.col("c") * F.col("interval_us")).otherwise(0)
    before = Window.partitionBy("queue").orderBy("piece").rowsBetween(Window.unboundedPreceding, -1)
    carried = (
        pieced.groupBy("queue", "piece")
        .agg(F.sum("du").alias("piece_du"), F.sum("dn").alias("piece_dn"), F.max("start_us").alias("piece_last"))
        .select(
            "queue", "piece", F.coalesce(F.sum("piece_du").over(before), F.lit(0)).alias("carry_du"),
            F.coalesce(F.sum("piece_dn").over(before), F.lit(0)).alias("carry_dn"),
            F.max("piece_last").over(before).alias("carry_last"),
        )
        .transform(lambda small: kept(small, cached))
    )  # fmt: skip
    order = Window.partitionBy("queue", "piece").orderBy("t_us", "kind", "ticket")
    upto = order.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    earlier = order.rowsBetween(Window.unboundedPreceding, -1)
    own = ((F.col("leased") == 1) & (F.col("end_us") <= F.col("start_us"))).cast("int")
    return (
        pieced.repartition("queue", "piece")
        .withColumn("ci", ci)
        .withColumn("run_du", F.sum("du").over(upto))
        .withColumn("run_dn", F.sum("dn").over(upto))
        .withColumn("p_upto", F.sum("ci").over(upto))
        .withColumn("q", F.when(F.col("kind") == STARTS, F.col("start_us") - F.col("interval_us")
                                - (F.col("p_upto") - F.col("ci"))))
        .withColumn("m_prev", F.max("q").over(earlier))
        .withColumn("prev_in_piece", F.max(F.when(F.col("kind") == STARTS, F.col("start_us"))).over(earlier))
        .filter(F.col("kind") == STARTS)
        .join(F.broadcast(carried), ["queue", "piece"])
        .select(
            "queue", "piece", "epoch", "ticket", "start_us", "interval_us", "c", "burst", "quota", "window_us",
            "concurrency", (F.col("carry_du") + F.col("run_du")).alias("window_units"),
            (F.col("carry_dn") + F.col("run_dn") + own).alias("in_flight"),
            F.coalesce("prev_in_piece", "carry_last").alias("prev_start_us"), "ci",
            (F.col("p_upto") - F.col("ci")).alias("p_prev"), "m_prev", "q",
        )
    )  # fmt: skip


def verdicts(swept: Any, tolerance_us: int) -> Any:
    """:func:`swept_starts` (read back) with the verdicts: ``window_violation``,
    ``concurrency_violation`` and ``burst_violation`` (0/1), and ``burst_cap_us``: the
    earliest start GCRA allowed (null for the first start of a queue)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    before = Window.partitionBy("queue").orderBy("piece").rowsBetween(Window.unboundedPreceding, -1)
    pieces = (
        swept.groupBy("queue", "piece")
        .agg(F.sum("ci").alias("span"), F.max("q").alias("piece_max"))
        .withColumn("offset", F.coalesce(F.sum("span").over(before), F.lit(0)))
        .withColumn("carry_max", F.max(F.col("piece_max") - F.col("offset")).over(before))
        .select("queue", "piece", "offset", "carry_max")
    )
    # L_(k-1) = M_(k-1) + P_(k-1), in global terms: q and P of this piece are offset by the
    # cost x interval of the earlier pieces.
    m_prev = F.greatest(F.col("carry_max"), F.col("m_prev") - F.col("offset"))
    last = m_prev + F.col("offset") + F.col("p_prev")
    gcra_cap = last + (1 - F.col("burst")) * F.col("interval_us")
    flag = F.coalesce  # a comparison with null (no earlier start) is no violation
    return (
        swept.join(F.broadcast(pieces), ["queue", "piece"])
        .withColumn("burst_cap_us", gcra_cap)
        .withColumn("burst_violation",
                    flag(((F.col("burst") > 0) & (F.col("start_us") < gcra_cap - tolerance_us)).cast("int"), F.lit(0)))
        .withColumn("window_violation",
                    ((F.col("quota") > 0) & (F.col("window_units") > F.col("quota"))).cast("int"))
        .withColumn("concurrency_violation",
                    ((F.col("concurrency") > 0) & (F.col("in_flight") > F.col("concurrency"))).cast("int"))
        .drop("offset", "carry_max", "p_prev", "m_prev", "q", "ci")
    )  # fmt: skip
