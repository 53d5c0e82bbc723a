"""What a real ``celery worker`` of interval tasks checks at its start, before it takes a
task: a Redis store that may evict keys is named in one WARNING line with what to set
(tests/test_store_eviction.py has the details), and a kombu that lacks what siq_celery
patches stops the start in one line naming the kombu version and the attribute
(tests/test_kombu_targets.py)."""

from __future__ import annotations

import kombu
import pytest

from siq_celery.embedded import EmbeddedRedis
from siq_celery.workers import WorkerStartError
from tests.integration.conftest import CeleryRun

pytestmark = [pytest.mark.processes]


def test_a_worker_names_a_store_that_may_evict_keys(celery_run: CeleryRun) -> None:
    with EmbeddedRedis(extra_args=("--maxmemory-policy", "allkeys-lru")) as store:
        worker = celery_run.start_worker("evicting", 1, "solo", env={"SIQ_TEST_STORE": store.url}).wait_ready()
        lines = [line for line in worker.log().splitlines() if "maxmemory-policy" in line]
        print("\n".join(lines))
        worker.stop(timeout=10)
    assert len(lines) == 1, lines
    assert "has maxmemory-policy allkeys-lru" in lines[0] and "set maxmemory-policy noeviction" in lines[0]


def test_a_worker_on_a_kombu_without_a_patch_target_does_not_start(celery_run: CeleryRun) -> None:
    worker = celery_run.start_worker("old-kombu", 1, "solo", env={"SIQ_TEST_KOMBU_LACKS": "QoS.append"})
    with pytest.raises(WorkerStartError) as refused:
        worker.wait_ready(timeout=60)
    lines = [line for line in worker.log().splitlines() if "kombu.transport.redis.QoS.append" in line]
    print("\n".join(lines))
    assert "exited with 1" in str(refused.value)
    assert len(lines) == 1 and f"kombu {kombu.__version__} has no kombu.transport.redis.QoS.append" in lines[0]
    assert "ready" not in worker.log()
