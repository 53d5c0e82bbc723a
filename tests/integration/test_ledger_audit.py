"""The ledger of a real multi-worker run, exported with ``celery -A app siq export`` and
audited with ``siq audit`` (PySpark local[2]): the audit's counts match the run's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, CeleryRun, inversions

pytestmark = [pytest.mark.spark, pytest.mark.processes, pytest.mark.slow]

TASKS = 150


def test_a_real_run_audits_clean_and_matches_its_records(celery_run: CeleryRun, tmp_path: Path) -> None:
    celery_run.start_workers(2, 2)
    record = celery_run.app.tasks["geo.record"]
    record.siq_queue().ensure(0.02, reset=True)
    for n in range(TASKS):
        record.delay(n)
    starts = celery_run.wait_for_count(TASKS)
    finishes = celery_run.wait_for(lambda _: len(celery_run.finishes()) >= TASKS, 30, "finishes")  # noqa: F841

    ledger = tmp_path / "geo.jsonl"
    out = celery_run.siq("export", "geo", "--out", str(ledger))
    assert f"exported {TASKS} ledger rows of 1 queue(s)" in out
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert {r["task_id"] for r in rows} == {s["task_id"] for s in starts}
    assert all(r["outcome"] == "SUCCESS" and r["finish_us"] >= r["start_us"] for r in rows)

    result = subprocess.run(
        [str(Path(sys.executable).parent / "siq"), "audit", str(ledger), "--out", str(tmp_path / "audit"),
         "--master", "local[2]"],
        capture_output=True, text=True, timeout=170, cwd=ROOT, env={**os.environ, **celery_run.env},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    [q] = json.loads((tmp_path / "audit" / "report.json").read_text())["summary"]
    print(f"\naudit of a real run: {result.stdout.strip()}")
    assert q["starts"] == len(starts) == TASKS
    assert q["violations"] == 0 and q["min_gap_ms"] >= 20.0
    assert q["inversions"] == inversions(starts)
    assert q["duplicate_starts"] == 0 and q["missing_tickets"] == 0 and q["unfinished"] == 0
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    per_node = Counter(s["node"] for s in starts)
    audited: Counter[str] = Counter()
    for w in report["workers"]:
        audited[w["host"]] += w["starts"]
    assert audited == per_node
