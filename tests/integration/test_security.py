"""A whole worker fleet on a Redis ACL user limited to exactly what the README documents,
with JSON as the only accepted content."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from siq_celery.backends.redis import ACL_RULES
from siq_celery.embedded import EmbeddedRedis
from tests.integration.conftest import CeleryRun, gaps_ms
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
    celery_run.env.update(SIQ_TEST_INTERVAL="100ms", SIQ_TEST_HORIZON="1", SIQ_TEST_RELEASE_EVERY="0.5")
    celery_run.start_workers(2, 2)
    task = celery_run.app.tasks["geo.record"]
    assert celery_run.app.conf.accept_content == ["json"] and celery_run.app.conf.task_serializer == "json"
    task.apply_many([(n,) for n in range(40)])
    celery_run.wait_for(lambda s: len(s) >= 10, 30, "10 starts")
    celery_run.siq("pause", "geo")
    time.sleep(1.5)
    celery_run.siq("resume", "geo")
    starts = celery_run.wait_for_count(40, timeout=60)
    out = tmp_path / "ledger.jsonl"
    celery_run.siq("export", "geo", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    status = celery_run.siq("status", "geo")
    logs = "".join(w.log() for w in celery_run.workers)
    print(f"\nACL user: {len(starts)} starts, {len(rows)} ledger rows, smallest gap {min(gaps_ms(starts)):.2f} ms")
    assert sorted(s["n"] for s in starts) == list(range(40))
    assert len(rows) == 40 and "geo" in status
    assert "NOPERM" not in logs and "may not run" not in logs and "released" in logs
    host_gaps_at_least(gaps_ms(starts), 90.0)
