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
from siq_celery.spark.synthetic import write_synthetic_ledger

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_a_million_rows_with_injected_faults_are_counted_exactly(spark: Any, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.parquet"
    injected = write_synthetic_ledger(str(ledger), 1_000_000, violations=37, inversions=23, duplicates=11, missing=19)
    report = run_audit(spark, [str(ledger)], str(tmp_path / "audit"), tolerance_us=1000, log=lambda _: None)
    summary = report["summary"]
    total = {k: sum(q[k] for q in summary) for k in ("starts", "violations", "inversions", "duplicate_starts",
                                                      "missing_tickets")}  # fmt: skip
    assert total == {"starts": injected.rows, "violations": 37, "inversions": 23, "duplicate_starts": 11,
                     "missing_tickets": 19}  # fmt: skip
    assert {q["queue"]: q["violations"] for q in summary} == {"synthetic:fast": 19, "synthetic:slow": 18}
    violations = spark.read.parquet(str(tmp_path / "audit" / "violations"))
    assert violations.count() == 37 and violations.filter("gap_us * 2 > interval_us + 200").count() == 0
    assert spark.read.parquet(str(tmp_path / "audit" / "duplicates")).count() == 11
    workers = report["workers"]
    assert len(workers) == 2 * 8 and abs(sum(w["share"] for w in workers) - 2.0) < 1e-9
    html = (tmp_path / "audit" / "report.html").read_text()
    assert html.startswith("<!doctype html>") and html.count("<svg") == 6 and "synthetic:fast" in html
    on_disk = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert on_disk["rows"] == injected.rows and on_disk["schema_version"] == 1


def ledger_rows(count: int, interval_us: int = 20_000, t0: int = 1_790_000_000_000_000) -> list[LedgerRow]:
    return [
        LedgerRow("api", "e1", n, f"t{n}", "call", t0 + n * interval_us, t0 + n * interval_us + 100, interval_us,
                  t0 + n * interval_us + 5000, "SUCCESS", 0, f"node{n % 2}", 100 + n % 4)
        for n in range(1, count + 1)
    ]  # fmt: skip


def test_spark_submit_reads_json_lines_and_parquet_together(tmp_path: Path) -> None:
    """The audit as a spark-submit application, on a ledger split over two formats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from siq_celery.ledger import COLUMNS, arrow_schema

    rows = ledger_rows(200)
    rows[150].start_us = rows[149].start_us + 5_000  # one violation, in the Parquet half
    with open(tmp_path / "part1.jsonl", "w") as f:
        for row in rows[:100]:
            f.write(json.dumps(row.as_dict()) + "\n")
    table = pa.table({c: [getattr(r, c) for r in rows[100:]] for c in COLUMNS}, schema=arrow_schema())
    pq.write_table(table, tmp_path / "part2.parquet")
    spark_submit = Path(sys.executable).parent / "spark-submit"
    result = subprocess.run(
        [str(spark_submit), "--master", "local[2]", str(ROOT / "siq_celery" / "spark" / "audit.py"),
         str(tmp_path / "part1.jsonl"), str(tmp_path / "part2.parquet"), "--out", str(tmp_path / "audit")],
        capture_output=True, text=True, timeout=170, env={"PYSPARK_PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
                                                         "SPARK_LOCAL_IP": "127.0.0.1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "api: 200 starts" in result.stdout and "1 violations" in result.stdout
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    [q] = report["summary"]
    assert (q["starts"], q["violations"], q["inversions"], q["missing_tickets"]) == (200, 1, 0, 0)
    assert q["min_gap_ms"] == 5.0


def test_a_newer_schema_is_refused(spark: Any, tmp_path: Path) -> None:
    row = ledger_rows(1)[0].as_dict() | {"v": 2}
    (tmp_path / "future.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="schema version 2 is newer"):
        run_audit(spark, [str(tmp_path / "future.jsonl")], str(tmp_path / "audit"), log=lambda _: None)
