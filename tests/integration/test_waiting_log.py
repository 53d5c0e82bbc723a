"""What a worker logs while its tasks wait: waiting is normal, so each deferral is a DEBUG
line, INFO gets at most a summary a minute per queue (in each worker process), and
Celery's ``Task ... ignored`` never shows for a deferral."""

from __future__ import annotations

import pytest

from siq_celery import IntervalQueue
from tests.apps.geo import REPUBLISHES
from tests.faults.conftest import wait_finished
from tests.integration.conftest import CeleryRun

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def test_a_waiting_backlog_logs_a_summary_not_a_line_per_deferral(celery_run: CeleryRun) -> None:
    # 2 s of line claimed ahead (never started: each costs a slot), then tasks sent by name:
    # each claims its ticket at the worker, behind that line, and is deferred until its slot
    # (the deferrals counted: "0@0" refuses none).
    celery_run.env.update(SIQ_TEST_INTERVAL="50ms", SIQ_TEST_REFUSE_REPUBLISHES="0@0")
    celery_run.start_workers(1, 2)
    IntervalQueue("geo", url=celery_run.env["SIQ_TEST_STORE"], interval="50ms").claim_many(40)
    for n in range(60):
        celery_run.app.send_task("geo.record", (n,))
    finishes = wait_finished(celery_run, 60, 60)
    assert sorted(finishes) == list(range(60))
    deferrals = int(celery_run.records.get(REPUBLISHES) or 0)
    lines = celery_run.workers[0].log().splitlines()
    ignored = [ln for ln in lines if "] ignored" in ln]
    per_deferral = [ln for ln in lines if "INFO" in ln and " deferred " in ln]
    summaries = [ln for ln in lines if "tasks wait for their slots" in ln or "deferrals of" in ln]
    print(f"\n{deferrals} deferrals: {len(ignored)} 'ignored' lines, {len(per_deferral)} INFO lines of a deferral, "
          f"{len(summaries)} summaries: {summaries[:2]}")  # fmt: skip
    assert deferrals >= 20, "the tasks waited, deferred"
    assert ignored == [], "Celery's 'Task ... ignored' is not shown for a deferral"
    assert per_deferral == [], "a deferral is a DEBUG line"
    assert 1 <= len(summaries) <= 2 * 2, "at most a summary a minute per queue in each process"
