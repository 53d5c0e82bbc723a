"""The command line of ``siq audit`` (and of ``spark-submit .../siq_celery/spark/audit.py``,
whose ``main`` this is): its arguments, and what it prints of the report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from siq_celery.intervals import parse_duration
from siq_celery.spark.pieces import ROWS_PER_PIECE
from siq_celery.spark.session import spark_conf, spark_session


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
    # Imported here: siq_celery.spark.audit gives this main as its own (and runs it as a script).
    from siq_celery.spark.audit import run_audit

    args = parse_args(argv)
    try:
        tolerance_us, conf = _checked(args)
    except ValueError as exc:
        print(f"siq audit: {exc}", file=sys.stderr)
        return 2
    spark = spark_session(args.master or default_master, conf=conf)
    spark.sparkContext.setLogLevel("WARN")
    try:
        print(f"auditing {', '.join(args.ledgers)} (tolerance {tolerance_us / 1000:g} ms)", flush=True)
        report = run_audit(spark, args.ledgers, args.out, tolerance_us, args.format, rows_per_piece=args.rows_per_piece)
    finally:
        spark.stop()
    _print_report(report, args.out.rstrip("/"))
    return 0


def _checked(args: argparse.Namespace) -> tuple[int, dict[str, str]]:
    """The tolerance (µs) and the Spark settings of ``args``; ValueError saying which
    argument is wrong."""
    try:
        tolerance_us = parse_duration(args.tolerance)
    except Exception as exc:
        raise ValueError(f"--tolerance: {exc}") from exc
    if args.rows_per_piece < 1:
        raise ValueError(f"--rows-per-piece must be at least 1, not {args.rows_per_piece}")
    return tolerance_us, spark_conf(args.conf)


def _print_report(report: dict[str, Any], out: str) -> None:
    """A line per queue of ``report`` (:func:`siq_celery.spark.audit.run_audit`), after what
    it left out, and where report.html is."""
    if report["unaudited_rows"]:
        print(f"{report['unaudited_rows']:,} rows without a queue or a start were not audited")
    if report.get("left_out"):
        left_out = ", ".join(f"{n:,} rows of {name}" for name, n in report["left_out"].items())
        print(f"report.json and report.html left out {left_out} (all in the tables under {out})")
    for q in report["summary"]:
        limits = ""
        if q.get("max_window_units") is not None:
            limits += f", {q['window_violations']} window violations (at most {q['max_window_units']:,} units)"
        if q.get("max_in_flight") is not None:
            limits += f", {q['concurrency_violations']} over the concurrency cap (at most {q['max_in_flight']} at once)"
        # a queue with one start (a per-key queue's often) has no gap and no rate
        if q.get("reported_starts"):
            limits += (f", on the bodies' clock ({q['reported_starts']:,} reported) {q['body_violations']} "
                       f"violations and {q['body_limit_violations']} of the quota or cap")  # fmt: skip
        rate = "-" if q["rate_pct"] is None else f"{q['rate_pct']}%"
        gap = "-" if q["min_gap_ms"] is None else f"{q['min_gap_ms']:.2f} ms"
        print(
            f"{q['queue']}: {q['starts']:,} starts, {rate} of the rate, {q['violations']} violations, "
            f"min gap {gap}, {q['inversions']} inversions, {q['duplicate_starts']} duplicate "
            f"starts, {q['missing_tickets']} tickets never started{limits}"
        )  # fmt: skip
    print(f"report: {out}/report.html ({report['rows']:,} rows in {report['seconds']} s, "
          f"{report['rows_per_second']:,} rows/s)")  # fmt: skip
