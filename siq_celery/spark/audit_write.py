"""Writing an audit's results: its tables as Parquet under the output folder, and its report
(report.json): the :data:`REPORTED` tables read back, bounded (each queue's latest
:data:`REPORT_HOURS` of ``by_hour``, at most :data:`REPORT_ROWS_MAX` rows of any table), in a
stable order."""

from __future__ import annotations

import json
from typing import Any

from siq_celery.spark import fair
from siq_celery.spark.io import read_table, write_table, write_text

#: Tables small enough for report.json and report.html (the others can be as big as the ledger;
#: of ``unfair``, each queue's first :data:`siq_celery.spark.fair.UNFAIR_REPORTED` rows).
REPORTED = (
    "summary",
    "by_day",
    "by_hour",
    "gaps",
    "rate",
    "workers",
    "fair_keys",
    "fair_hours",
    "fair_order",
    "unfair",
)


#: The latest hours of each queue in report.json and report.html (``by_hour`` in Parquet has all).
REPORT_HOURS = 168


#: Rows of any one table collected into report.json and report.html, at most.
REPORT_ROWS_MAX = 10_000


def write_tables(spark: Any, tables: dict[str, Any], out: str, report: dict[str, Any], done: Any) -> None:
    """Each of ``tables`` as Parquet under ``out``, and the :data:`REPORTED` ones, read back,
    into ``report`` (with what was left out of them under ``left_out``)."""
    for name, table in tables.items():
        write_table(table, f"{out}/{name}")
        if name in REPORTED:
            report[name], left_out = _reported(read_table(spark, f"{out}/{name}"), name)
            if left_out:
                report.setdefault("left_out", {})[name] = left_out
        done(name)


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
    elif name == "unfair":
        table = fair.first_unfair(table)
    rows = table.orderBy(*_order(name)).limit(REPORT_ROWS_MAX).collect()
    return [_plain(r.asDict()) for r in rows], total - len(rows)


def _order(name: str) -> tuple[str, ...]:
    return {
        "summary": ("queue",), "by_day": ("queue", "day"), "by_hour": ("queue", "hour"), "gaps": ("queue", "bin"),
        "rate": ("queue", "bucket"), "workers": ("queue", "host", "pid"), "fair_keys": ("queue", "fair_key"),
        "fair_hours": ("queue", "hour", "fair_key"), "fair_order": ("queue", "hour"),
        "unfair": ("queue", "epoch", "ticket", "start_us"),
    }[name]  # fmt: skip


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}


def write_report(spark: Any, out: str, report: dict[str, Any]) -> None:
    """report.json and report.html under ``out``."""
    from siq_celery.spark.report_html import render

    write_text(spark, f"{out}/report.json", json.dumps(report, indent=2, default=str))
    write_text(spark, f"{out}/report.html", render(report))
