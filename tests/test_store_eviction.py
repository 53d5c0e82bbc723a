"""A Redis state store that may evict keys: an evicted queue key forgets that queue's starts
(a window key gone, quota 3/1s: a 4th start in the second was authorized), so a worker
says at start, in one WARNING line, what to set (``maxmemory-policy noeviction``). A user
who may not read the server's configuration (an ACL without CONFIG) is told so once.

Private redis-servers started with each policy; the worker's start hook (``worker_init``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from celery import Celery, signals

from siq_celery import IntervalTask
from siq_celery.backends import backend_from_url
from siq_celery.embedded import EmbeddedRedis
from siq_celery.testing import EmbeddedRedisCluster

pytestmark = [pytest.mark.processes]


class Worker:
    """What siq_celery's worker signals read of Celery's WorkController."""

    def __init__(self, app: Celery) -> None:
        self.app, self.hostname = app, "w1@host"


def start_lines(url: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The WARNING lines of a worker's start (worker_init) with its store at ``url``."""
    app = Celery("eviction", broker="memory://", set_as_current=False)
    app.conf.siq_url = url

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="eviction")
    def job() -> None: ...

    app.finalize()  # as a worker does before worker_init
    worker = Worker(app)
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO, "siq_celery"):
            signals.worker_init.send(sender=worker)
    finally:
        signals.worker_shutdown.send(sender=worker)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    print("\n".join(lines))
    return lines


@pytest.fixture(params=["allkeys-lru", "volatile-ttl", "noeviction"])
def policy_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    policy = request.param
    with EmbeddedRedis(extra_args=("--maxmemory-policy", policy, "--maxmemory", "64mb")) as server:
        yield policy, server.url


def test_a_store_that_evicts_is_named_at_worker_start(
    policy_server: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    policy, url = policy_server
    lines = [line for line in start_lines(url, caplog) if "maxmemory-policy" in line]
    if policy == "noeviction":
        assert lines == []
        return
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"maxmemory-policy {policy}" in lines[0] and "set maxmemory-policy noeviction" in lines[0]
    assert "127.0.0.1" in lines[0]


def test_a_user_who_may_not_read_the_configuration_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    with EmbeddedRedis(extra_args=("--maxmemory-policy", "allkeys-lru")) as server:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser("siq", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all", "-config"])  # fmt: skip
        url = server.url.replace("redis://", "redis://siq:pw@")
        lines = [line for line in start_lines(url, caplog) if "maxmemory-policy" in line]
        admin.close()
    assert len(lines) == 1 and "could not read" in lines[0] and "noeviction" in lines[0], lines
    assert "pw@" not in lines[0]


def test_on_a_cluster_every_primary_is_read(redis_cluster: EmbeddedRedisCluster) -> None:
    backend = backend_from_url(redis_cluster.url)
    last = redis.Redis(port=redis_cluster.nodes[-1].port)
    try:
        assert backend.eviction_policy() == "noeviction"  # type: ignore[attr-defined]
        last.config_set("maxmemory-policy", "volatile-lru")
        assert backend.eviction_policy() == "volatile-lru"  # type: ignore[attr-defined]
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        last.close()
        backend.close()
