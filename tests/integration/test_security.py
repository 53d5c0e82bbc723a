"""A whole worker fleet on a Redis ACL user limited to exactly what docs/stores.md documents,
with JSON as the only accepted content; and what watches it (``siq exporter``, ``siq
top``, a worker's metrics port) on the same user."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from siq_celery.backends import backend_from_url
from siq_celery.backends.redis import ACL_RULES
from siq_celery.client.queue import IntervalQueue
from siq_celery.embedded import EmbeddedRedis, free_port
from tests.integration.conftest import ROOT, CeleryRun, busy_queue, gaps_ms
from tests.integration.test_exporter import SIQ, sample, scrape
from tests.integration.test_top import Rows, watch_top
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, HOST_CLOCK_RERUNS]


@pytest.fixture
def acl_store(redis_server: EmbeddedRedis, celery_run: CeleryRun) -> Iterator[str]:
    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "siqworker", "reset", "on", ">s3cret", *ACL_RULES)
    url = f"redis://siqworker:s3cret@127.0.0.1:{redis_server.port}/2"
    celery_run.env["SIQ_TEST_STORE"] = url
    yield url
    admin.execute_command("ACL", "DELUSER", "siqworker")


def test_workers_producer_and_cli_need_nothing_beyond_the_documented_acl(
    celery_run: CeleryRun, acl_store: str, tmp_path: Path
) -> None:
    # Parking (horizon 1 s: a 4 s backlog parks most tasks), releases, deferrals while
    # paused, the ledger and its export: every script and command siq_celery uses.
    metrics_port = free_port()  # the first node serves the metrics (siq_metrics_port); the second cannot bind it
    celery_run.env.update(SIQ_TEST_INTERVAL="100ms", SIQ_TEST_HORIZON="1", SIQ_TEST_RELEASE_EVERY="0.5",
                          SIQ_TEST_METRICS_PORT=str(metrics_port))  # fmt: skip
    celery_run.start_workers(2, 2)
    task = celery_run.app.tasks["geo.record"]
    assert celery_run.app.conf.accept_content == ["json"] and celery_run.app.conf.task_serializer == "json"
    task.apply_many([(n,) for n in range(40)])
    celery_run.wait_for(lambda s: len(s) >= 10, 30, "10 starts")
    celery_run.siq("pause", "geo")
    time.sleep(1.5)
    celery_run.siq("resume", "geo")
    starts = celery_run.wait_for_count(40, timeout=60)
    time.sleep(0.3)  # the last start's count is written before its body runs
    served = scrape(metrics_port)
    out = tmp_path / "ledger.jsonl"
    celery_run.siq("export", "geo", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    status = celery_run.siq("status", "geo")
    logs = "".join(w.log() for w in celery_run.workers)
    print(f"\nACL user: {len(starts)} starts, {len(rows)} ledger rows, smallest gap {min(gaps_ms(starts)):.2f} ms")
    assert sorted(s["n"] for s in starts) == list(range(40))
    assert len(rows) == 40 and "geo" in status
    assert "NOPERM" not in logs and "may not run" not in logs and "released" in logs
    assert sample(served, "siq_up") == 1 and sample(served, "siq_starts_total", queue="geo") == 40
    assert "siq exporter:" not in logs  # no scrape of the worker's metrics failed
    host_gaps_at_least(gaps_ms(starts), 90.0)


def test_the_exporter_and_top_need_nothing_beyond_the_documented_acl(acl_store: str) -> None:
    admin_url = acl_store.replace("siqworker:s3cret@", "")
    IntervalQueue("api", backend=backend_from_url(admin_url)).ensure(0.05, reset=True)
    with busy_queue(acl_store, "api", 2):
        once = subprocess.run([SIQ, "--url", acl_store, "exporter", "--once"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)  # fmt: skip
        assert once.returncode == 0 and once.stderr == "", once.stderr
        assert "siq_up 1.0" in once.stdout and 'siq_queue_interval_seconds{queue="api"} 0.05' in once.stdout

        def started(rows: Rows) -> bool:
            return "api" in rows and rows["api"][1] not in ("-", "0.00")

        with watch_top(acl_store, started) as rows:
            assert rows["api"][2] == "20.00" and rows["api"][9] == "running"
