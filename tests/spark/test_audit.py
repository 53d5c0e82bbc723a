"""siq audit on ledgers whose faults are known exactly (PySpark local[2])."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from siq_celery.ledger import LedgerRow
from siq_celery.spark.audit import run_audit

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def ledger_rows(count: int, interval_us: int = 20_000, t0: int = 1_790_000_000_000_000) -> list[LedgerRow]:
    return [
        LedgerRow("api", "e1", n, f"t{n}", "call", t0 + n * interval_us, t0 + n * interval_us + 100, interval_us,
                  t0 + n * interval_us + 5000, "SUCCESS", 0, f"node{n % 2}", 100 + n % 4)
        for n in range(1, count + 1)
    ]  # fmt: skip


def test_spark_submit_reads_json_lines_and_parquet_together(tmp_path: Path) -> None:
    """The audit as a spark-submit application, on a ledger split over two formats (and two
    schema versions)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from siq_celery.ledger import COLUMNS, arrow_schema

    rows = ledger_rows(200)
    rows[150].start_us = rows[149].start_us + 5_000  # one violation, in the Parquet half
    with open(tmp_path / "part1.jsonl", "w") as f:  # written by an older siq export: schema 1, no cost
        for row in rows[:100]:
            f.write(json.dumps({k: v for k, v in row.as_dict().items() if k != "cost"} | {"v": 1}) + "\n")
    table = pa.table({c: [getattr(r, c) for r in rows[100:]] for c in COLUMNS}, schema=arrow_schema())
    pq.write_table(table, tmp_path / "part2.parquet")
    spark_submit = Path(sys.executable).parent / "spark-submit"
    # spark-submit leaves Spark's 200 shuffle partitions (siq audit --master local[...] sets
    # 8): a 200-row ledger's stages then run 200 tasks each, 70 s here against 38 s with 8
    result = subprocess.run(
        [str(spark_submit), "--master", "local[2]", "--conf", "spark.sql.shuffle.partitions=8",
         str(ROOT / "siq_celery" / "spark" / "audit.py"),
         str(tmp_path / "part1.jsonl"), str(tmp_path / "part2.parquet"), "--out", str(tmp_path / "audit")],
        capture_output=True, text=True, timeout=170, env={"PYSPARK_PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
                                                         "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "api: 200 starts" in result.stdout and "1 violations" in result.stdout
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    [q] = report["summary"]
    assert (q["starts"], q["violations"], q["inversions"], q["missing_tickets"]) == (200, 1, 0, 0)
    assert q["min_gap_ms"] == 5.0


def test_a_newer_schema_is_refused(spark: Any, tmp_path: Path) -> None:
    row = ledger_rows(1)[0].as_dict() | {"v": 6}
    (tmp_path / "future.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="schema version 6 is newer"):
        run_audit(spark, [str(tmp_path / "future.jsonl")], str(tmp_path / "audit"), log=lambda _: None)


def weighted_and_combined_rows(t0: int = 1_790_000_000_000_000) -> list[dict[str, Any]]:
    """Ledger rows (as ``siq export`` writes them) of a weighted queue and of a queue shared
    by a combined limit, every start on time: nothing to report but one real inversion."""
    rows: list[dict[str, Any]] = []

    def row(queue: str, ticket: int, start_us: int, interval_us: int, cost: int = 1) -> None:
        n = len(rows)
        rows.append({
            "queue": queue, "epoch": "e1", "ticket": ticket, "task_id": f"t{n}", "task_name": "call",
            "slot_us": start_us - 100, "start_us": start_us, "interval_us": interval_us, "finish_us": start_us + 50,
            "outcome": "SUCCESS", "deferrals": 0, "host": "node1", "pid": 100, "cost": cost, "v": 2,
        })  # fmt: skip

    # "points": 10 ms a point, calls of cost 1, 3 and 10 (tickets t .. t + c - 1 each), every
    # start exactly its predecessor's cost x interval after it.
    ticket, start = 1, t0
    for k in range(60):
        cost = (1, 3, 10)[k % 3]
        row("points", ticket, start, 10_000, cost)
        ticket, start = ticket + cost, start + cost * 10_000
    # "points-bad": a start 30 ms after one of cost 10 at 10 ms: 60 ms too early.
    row("points-bad", 1, t0, 10_000, 10)
    row("points-bad", 11, t0 + 30_000, 10_000, 10)
    # "{geo}per-second" at 100 ms: tasks of its own (tickets) between the starts of a combined
    # limit in which it is not the binding queue (ticket 0: no place in its line); tickets
    # 7 and 8 start the wrong way round (one real inversion).
    tickets = iter([1, 2, 3, 4, 5, 6, 8, 7, 9, 10])
    for k in range(20):
        row("{geo}per-second", 0 if k % 2 else next(tickets), t0 + k * 100_000, 100_000)
    return rows


def test_weighted_and_combined_starts_are_counted_by_the_tickets_and_slots_they_use(spark: Any, tmp_path: Path) -> None:
    with open(tmp_path / "ledger.jsonl", "w") as f:
        for r in weighted_and_combined_rows():
            f.write(json.dumps(r) + "\n")
    report = run_audit(spark, [str(tmp_path / "ledger.jsonl")], str(tmp_path / "audit"), log=lambda _: None)
    got = {
        q["queue"]: {
            k: q[k] for k in ("starts", "rate_pct", "violations", "inversions", "missing_tickets", "min_gap_ms")
        }
        for q in report["summary"]
    }
    print(got)
    assert got == {
        "points": {"starts": 60, "rate_pct": 100.0, "violations": 0, "inversions": 0, "missing_tickets": 0,
                   "min_gap_ms": 10.0},
        "points-bad": {"starts": 2, "rate_pct": 333.33, "violations": 1, "inversions": 0, "missing_tickets": 0,
                       "min_gap_ms": 30.0},
        "{geo}per-second": {"starts": 20, "rate_pct": 100.0, "violations": 0, "inversions": 1, "missing_tickets": 0,
                            "min_gap_ms": 100.0},
    }  # fmt: skip
    [hour] = [h for h in report["by_hour"] if h["queue"] == "points"]
    assert (hour["rate_pct"], hour["violations"], hour["slots"]) == (100.0, 0, 20 * (1 + 3 + 10))
    [bad] = spark.read.parquet(str(tmp_path / "audit" / "violations")).collect()
    assert (bad["queue"], bad["gap_us"], bad["required_gap_us"]) == ("points-bad", 30_000, 100_000)


def test_what_the_report_collects_stays_bounded_however_many_hours_the_ledger_covers(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """by_hour grows with the hours a ledger covers: report.json keeps each queue's latest
    REPORT_HOURS, and any table at most REPORT_ROWS_MAX rows; the Parquet tables keep all."""
    from siq_celery.spark import audit_write

    monkeypatch.setattr(audit_write, "REPORT_HOURS", 3)
    monkeypatch.setattr(audit_write, "REPORT_ROWS_MAX", 4)
    hour = 3_600_000_000
    rows = [r for n in range(5) for r in ledger_rows(2, t0=1_790_000_000 * 1_000_000 + n * hour)]
    for n, r in enumerate(rows):
        r.queue = ("a", "b", "c", "d", "e")[n // 2] if n % 2 else "api"  # 6 queues in all
    write_jsonl(rows, tmp_path / "ledger.jsonl")
    report = run_audit(spark, [str(tmp_path / "ledger.jsonl")], str(tmp_path / "audit"), log=lambda _: None)
    hours = [h["hour"] for h in report["by_hour"] if h["queue"] == "api"]
    print(report.get("left_out"), hours)
    assert len(hours) == 3 and hours == sorted(hours) and hours[-1].endswith(":00")
    assert spark.read.parquet(str(tmp_path / "audit" / "by_hour")).filter("queue = 'api'").count() == 5
    assert len(report["summary"]) == 4 and report["left_out"]["summary"] == 2 and report["rows"] == 10


def write_jsonl(rows: list[LedgerRow], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row.as_dict()) + "\n")


def test_a_queue_with_one_start_is_summed_up_without_a_gap_or_a_rate(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A queue with a single start (a per-key queue's is common) has no gap and no rate: the
    printed summary says '-' for them instead of failing after the tables are written."""
    from siq_celery.spark.audit_cli import _print_report

    rows = ledger_rows(3)
    rows[2].queue = "api:one"
    write_jsonl(rows, tmp_path / "ledger.jsonl")
    report = run_audit(spark, [str(tmp_path / "ledger.jsonl")], str(tmp_path / "audit"), log=lambda _: None)
    _print_report(report, str(tmp_path / "audit"))
    out = capsys.readouterr().out
    print(out)
    [line] = [line for line in out.splitlines() if line.startswith("api:one:")]
    assert line.startswith("api:one: 1 starts, - of the rate, 0 violations, min gap -, 0 inversions")
    assert "api: 2 starts, 100.0% of the rate" in out and "report: " in out
    assert "<td>-</td>" in (tmp_path / "audit" / "report.html").read_text()
