"""Declarations without workers (tasks/declarations.py): what an app declares, bad declarations
named at definition, ``siq sync``, per-key queues declared on use, producers that only
say so, and the log line a changed declaration writes."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, signals

from siq_celery import ConfigurationError, IntervalTask
from siq_celery.backends import backend_from_url
from siq_celery.backends.sqlite import SqliteBackend
from siq_celery.client.queue import IntervalQueue
from siq_celery.errors import StoreUnavailableError
from siq_celery.tasks import worker_hooks
from siq_celery.tasks.app_state import siq_state
from siq_celery.tasks.declarations import NodeDeclarations, PerKeyDeclarations, app_declarations, describe, sync_app
from siq_celery.tasks.upkeep import WorkerUpkeep
from siq_celery.testing import PinnedClock
from siq_celery.types import Declared, Limits


def make_app(tmp_path: Any, **conf: Any) -> Celery:
    app = Celery("decl", broker="memory://", set_as_current=False)
    app.conf.update(siq_url=f"sqlite:///{tmp_path}/s.db", **conf)
    return app


def test_a_bad_interval_fails_when_the_task_is_defined_naming_it(tmp_path: Any) -> None:
    app = make_app(tmp_path)
    app.finalize()  # a finalized app creates the task class at once (a worker's at its start)
    with pytest.raises(ConfigurationError, match=r"task pkg\.geocode: interval 'fast'"):

        @app.task(base=IntervalTask, shared=False, name="pkg.geocode", interval="fast")
        def geocode() -> None: ...

    with pytest.raises(ConfigurationError, match=r"task pkg\.two: interval '0ms'"):

        @app.task(base=IntervalTask, shared=False, name="pkg.two", interval_queue={"a": "1s", "b": "0ms"})
        def two() -> None: ...


def test_the_app_declares_each_fixed_queue_once_and_the_slower_of_two_tasks_wins(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path)

    @app.task(base=IntervalTask, shared=False, name="a", interval="100ms", interval_queue="api")
    def a() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="b", interval="300ms", interval_queue="api")
    def b() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="c", interval_queue={"{g}s": "1s", "{g}d": "2.4h"})
    def c() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="d", interval="1s", interval_queue=lambda a, k: f"k:{a[0]}")
    def d(key: str) -> None: ...

    with caplog.at_level(logging.WARNING, "siq_celery"):
        declared = {q.name: q.interval_us for q in app_declarations(app)}
    assert declared == {"api": 300_000, "{g}s": 1_000_000, "{g}d": 8_640_000_000}  # per-key: on use
    assert "tasks a and b declare queue 'api' at 100ms and 300ms; the slower holds" in caplog.text


def test_siq_sync_makes_the_code_the_declaration_and_reports_the_change(tmp_path: Any) -> None:
    app = make_app(tmp_path)

    @app.task(base=IntervalTask, shared=False, name="a", interval="100ms", interval_queue="api")
    def a() -> None: ...

    backend = siq_state(app).backend
    IntervalQueue("api", backend=backend, interval="5ms").declare(origin="old code")
    ((name, done),) = sync_app(app)
    assert name == "api" and (done.old_declared_us, done.interval_us) == (5_000, 100_000)
    line = describe(name, done, "siq sync")
    assert line == "queue 'api': declared interval 5ms -> 100ms by siq sync; effective 5ms -> 100ms"
    assert backend.status("api").sources.nodes == ()  # type: ignore[union-attr]


def test_a_node_announces_renews_and_withdraws(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(tmp_path, siq_declaration_ttl=30)

    @app.task(base=IntervalTask, shared=False, name="a", interval="100ms", interval_queue="api")
    def a() -> None: ...

    backend = siq_state(app).backend
    IntervalQueue("api", backend=backend, interval="5ms").declare(origin="old code")
    node = NodeDeclarations(app, "w1@host")
    with caplog.at_level(logging.INFO, "siq_celery"):
        node.announce()
    assert "queue 'api': declared interval 5ms -> 100ms by w1@host (" in caplog.text
    status = backend.status("api")
    assert status is not None and [n.node for n in status.sources.nodes] == ["w1@host"]
    node.withdraw()
    status = backend.status("api")
    assert status is not None and status.sources.nodes == () and status.state.interval_us == 100_000
    node.renew_if_due()  # after the withdrawal (shutdown) nothing is declared again
    assert backend.status("api").sources.nodes == ()  # type: ignore[union-attr]


def test_per_key_queues_are_declared_on_first_use_and_renewed_only_when_due(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = siq_state(make_app(tmp_path)).backend
    calls: list[tuple[str, bool]] = []
    real = backend.declare

    def counting(queue: str, *args: Any, **kwargs: Any) -> Declared:
        calls.append((queue, kwargs["announce"]))
        return real(queue, *args, **kwargs)

    monkeypatch.setattr(backend, "declare", counting)
    now = [1000.0]
    monkeypatch.setattr("siq_celery.tasks.declarations.time.monotonic", lambda: now[0])
    per_key = PerKeyDeclarations(ttl=30.0)
    shop = IntervalQueue("shop:1", backend=backend, interval="500ms")
    for _ in range(3):
        per_key.on_use(shop, "w1@host")
    now[0] += 9.9
    per_key.on_use(shop, "w1@host")
    assert calls == [("shop:1", True)]  # the first use announces; uses within TTL/3 cost nothing
    now[0] += 0.2
    per_key.on_use(shop, "w1@host")
    assert calls == [("shop:1", True), ("shop:1", False)]  # then a renewal, never a new announcement
    status = backend.status("shop:1")
    assert status is not None and status.state.interval_us == 500_000


def test_a_producer_with_another_declaration_says_so_once_and_writes_nothing(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = siq_state(make_app(tmp_path)).backend
    IntervalQueue("api", backend=backend, interval="100ms").declare(node="w1@host", ttl=30)
    producer = IntervalQueue("api", backend=backend, interval="5ms")
    with caplog.at_level(logging.INFO, "siq_celery"):
        producer.claim()
        producer.claim_many(3)
        producer.claim_later().ticket()
    assert caplog.text.count("queue 'api' runs at 100ms") == 1 and "this process declares 5ms" in caplog.text
    status = backend.status("api")
    assert status is not None and status.state.interval_us == 100_000 and status.sources.declared_us == 100_000


def test_release_every_must_be_well_below_a_third_of_the_declaration_ttl(tmp_path: Any) -> None:
    """Renewals run on the upkeep rounds: with release_every=60 and the default TTL of 30 s,
    live declarations would lapse between renewals and the effective interval flip."""
    with pytest.raises(
        ConfigurationError,
        match=r"siq_release_every = 60 is not well below siq_declaration_ttl / 3 "
        r"\(10s\).* at most 5 \(siq_declaration_ttl / 6\), or siq_declaration_ttl to at least 360",
    ):
        siq_state(make_app(tmp_path, siq_release_every=60)).settings  # noqa: B018
    assert siq_state(make_app(tmp_path, siq_release_every=5)).settings.release_every == 5
    assert siq_state(make_app(tmp_path, siq_release_every=0.5, siq_declaration_ttl=3)).settings.release_every == 0.5


def api_app(tmp_path: Any, *queues: str, **conf: Any) -> Celery:
    app = make_app(tmp_path, **conf)
    for name in queues or ("api",):

        @app.task(base=IntervalTask, shared=False, name=f"t.{name}", interval="100ms", interval_queue=name)
        def task() -> None: ...

    return app


def test_an_announcement_the_store_refused_is_made_promptly_once_it_is_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = api_app(tmp_path)
    backend = siq_state(app).backend
    IntervalQueue("api", backend=backend, interval="5ms").declare(origin="old code")
    down, real = [True], backend.declare

    def flaky(*args: Any, **kwargs: Any) -> Declared:
        if down[0]:
            raise StoreUnavailableError("queue 'api': cannot reach the state store (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "declare", flaky)
    node = NodeDeclarations(app, "w1@host")
    node.announce()  # worker_init, the store unreachable
    time.sleep(0.5)
    down[0] = False
    back, deadline = time.monotonic(), time.monotonic() + 3.0
    while backend.status("api").state.interval_us != 100_000 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    took = time.monotonic() - back
    node.withdraw()
    print(f"announced {took:.3f}s after the store came back")
    assert took < 1.0, f"the announcement waited {took:.1f}s after the store came back"


def test_interval_tasks_wait_for_a_delayed_announcement(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    app = api_app(tmp_path)
    backend = siq_state(app).backend
    down, real = [True], backend.declare

    def flaky(*args: Any, **kwargs: Any) -> Declared:
        if down[0]:
            raise StoreUnavailableError("cannot reach the state store (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "declare", flaky)
    node = NodeDeclarations(app, "w1@host")
    assert node.announce() is False and not node.announced
    waiter = threading.Thread(target=node.wait_announced)  # what the gate does before a start
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    down[0] = False
    waiter.join(2.0)
    assert not waiter.is_alive() and node.announced
    node.withdraw()
    fresh = NodeDeclarations(app, "w2@host")
    assert fresh.announce() is True and fresh.announced  # a reachable store: nothing waits
    fresh.withdraw()


def test_withdrawing_stops_at_the_first_timeout_of_an_unreachable_store(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = api_app(tmp_path, "a1", "a2", "a3")
    node = NodeDeclarations(app, "w1@host")
    node.announce()
    calls: list[str] = []

    def frozen(queue: str, *args: Any, **kwargs: Any) -> Declared:
        calls.append(queue)
        raise StoreUnavailableError(f"queue {queue!r}: cannot reach the Redis state store: Timeout reading")

    monkeypatch.setattr(siq_state(app).backend, "declare", frozen)
    node.withdraw()  # worker_shutdown: a frozen store costs one timeout, not one per queue
    assert calls == ["a1"]


def test_the_upkeep_logs_an_outage_once_and_its_end_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = api_app(tmp_path, "down")
    state = siq_state(app)
    backend = state.backend
    assert isinstance(backend, SqliteBackend)
    down, real = [True], backend._connection

    def connection() -> sqlite3.Connection:
        if down[0]:
            raise sqlite3.OperationalError("unable to open database file")
        return real()

    monkeypatch.setattr(backend, "_connection", connection)
    state.node_declarations = NodeDeclarations(app, "w1@host")
    upkeep = WorkerUpkeep(app, 0.05)
    with caplog.at_level(logging.INFO, "siq_celery"):
        upkeep.start()
        time.sleep(0.6)  # about 12 rounds with nothing parked
        outage = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        down[0] = False
        time.sleep(0.3)
        upkeep.stop()
        upkeep.join(2)
    after = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING][len(outage) :]
    print("\n".join(["during:", *outage, "after:", *after]))
    assert len(outage) == 1 and "the state store is unreachable" in outage[0] and "unable to open" in outage[0]
    assert "''s" not in caplog.text
    assert sum("the state store is reachable again after" in line for line in after) == 1


def test_a_per_key_declaration_that_fails_is_a_warning_at_most_once_a_minute(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend = siq_state(make_app(tmp_path)).backend

    def down(queue: str, *args: Any, **kwargs: Any) -> Declared:
        raise StoreUnavailableError(f"queue {queue!r}: cannot reach the state store")

    monkeypatch.setattr(backend, "declare", down)
    per_key = PerKeyDeclarations(ttl=30.0)
    with caplog.at_level(logging.DEBUG, "siq_celery"):
        for n in range(3):
            per_key.on_use(IntervalQueue(f"shop:{n}", backend=backend, interval="1s"), "w1@host")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not declare the interval of per-key queue 'shop:0'" in warnings[0]


def test_a_deploy_that_changes_a_per_key_interval_logs_once_not_once_per_key(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = siq_state(make_app(tmp_path)).backend
    for n in range(3):
        IntervalQueue(f"shop:{n}", backend=backend, interval="500ms").declare(origin="old code")
    per_key = PerKeyDeclarations(ttl=30.0)
    with caplog.at_level(logging.INFO, "siq_celery"):
        for n in range(3):
            per_key.on_use(IntervalQueue(f"shop:{n}", backend=backend, interval="1s"), "w1@host")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    print("\n".join(warnings))
    assert len(warnings) == 1 and "queue 'shop:0': declared interval 500ms -> 1s by w1@host" in warnings[0]
    assert all(backend.status(f"shop:{n}").state.interval_us == 1_000_000 for n in range(3))  # type: ignore[union-attr]


class Worker:
    """What siq_celery's worker signals read of Celery's WorkController."""

    def __init__(self, app: Celery, hostname: str) -> None:
        self.app, self.hostname = app, hostname


def test_a_pool_process_that_stops_withdraws_its_per_key_declarations(tmp_path: Any) -> None:
    app = api_app(tmp_path)
    worker = Worker(app, "w1@host")
    app.finalize()  # as a worker does before worker_init: its interval tasks bind, connecting siq_celery's signals
    signals.worker_init.send(sender=worker)  # announces; the pool processes fork after it
    state = siq_state(app)
    try:
        assert state.per_key_declarations is not None
        for n in range(2):
            state.per_key_declarations.on_use(
                IntervalQueue(f"shop:{n}", backend=state.backend, interval="1s"), "w1@host"
            )
        assert [n.node for n in state.backend.status("shop:0").sources.nodes] == ["w1@host"]  # type: ignore[union-attr]
        signals.worker_process_shutdown.send(sender="w1@host", pid=os.getpid(), exitcode=0)
        assert state.backend.status("shop:0").sources.nodes == ()  # type: ignore[union-attr]
        assert state.backend.status("shop:1").sources.nodes == ()  # type: ignore[union-attr]
    finally:
        signals.worker_shutdown.send(sender=worker)
        worker_hooks.WORKER.per_key_declarations.clear()


def test_a_renewal_says_when_the_effective_interval_followed_an_expiry(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def followed_the_expiry(state: Any) -> None:  # a read after the TTL follows it already
        assert state.backend.status("api").state.interval_us == 100_000  # type: ignore[union-attr]

    renew_after_an_old_node_expired(tmp_path, monkeypatch, caplog, {"interval": "300ms"}, after=followed_the_expiry)
    assert "queue 'api': effective 300ms -> 100ms (a worker's declaration expired" in caplog.text


def renew_after_an_old_node_expired(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, old: dict[str, Any],
    before: Callable[[Any], None] = lambda state: None, after: Callable[[Any], None] = lambda state: None,
) -> None:  # fmt: skip
    """'api' declared by a node killed at once (``old``: its declaration, TTL 30 s), then
    by a live node of the code at 100 ms, no limits, which renews after the TTL, logging
    into ``caplog`` what the expiry changed; ``before`` and ``after`` check the app's
    siq state on either side of the expiry."""
    app = api_app(tmp_path)
    clock = PinnedClock()
    state = siq_state(app)
    state._backend = backend_from_url(f"sqlite:///{tmp_path}/s.db", clock=clock)
    IntervalQueue("api", backend=state.backend, **old).declare(node="old@host", ttl=30)  # then killed
    now = [1000.0]
    monkeypatch.setattr("siq_celery.tasks.declarations.time.monotonic", lambda: now[0])
    node = NodeDeclarations(app, "w1@host")
    node.announce()
    before(state)
    clock.advance(30.0)
    after(state)
    now[0] += 10.0
    with caplog.at_level(logging.WARNING, "siq_celery"):
        node.renew_if_due()
    node.withdraw()


def test_tasks_sharing_a_queue_with_different_limits_declare_the_strictest_with_a_warning(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path)

    @app.task(base=IntervalTask, shared=False, name="a", interval="100ms", interval_queue="api", burst=4,
              quota="100/1m", concurrency=5)  # fmt: skip
    def a() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="b", interval="300ms", interval_queue="api", burst=1,
              quota="10/1s")  # fmt: skip
    def b() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="c", interval="1s", interval_queue="same", concurrency=2)
    def c() -> None: ...

    @app.task(base=IntervalTask, shared=False, name="d", interval="1s", interval_queue="same", concurrency=2)
    def d() -> None: ...

    with caplog.at_level(logging.WARNING, "siq_celery"):
        declared = {q.name: (q.interval_us, q.limits) for q in app_declarations(app)}
    assert declared == {"api": (300_000, Limits(1, 10, 60_000_000, 5)), "same": (1_000_000, Limits(0, 0, 0, 2))}
    assert (
        "tasks a and b declare queue 'api' with burst 4, quota 100/1m, concurrency 5 and burst 1, quota 10/1s; "
        "the strictest holds: burst 1, quota 10/1m, concurrency 5"
    ) in caplog.text
    assert "queue 'same'" not in caplog.text  # the same limits: nothing to say
    # each task's own queue object keeps what its task declared
    assert app.tasks["a"].siq_queue().limits == Limits(4, 100, 60_000_000, 5)
    ((_, done),) = [r for r in sync_app(app) if r[0] == "api"]
    assert done.limits == Limits(1, 10, 60_000_000, 5)


def test_a_deploy_that_changes_the_limits_logs_what_changed_and_the_override_it_replaced(tmp_path: Any) -> None:
    app = make_app(tmp_path)

    @app.task(base=IntervalTask, shared=False, name="a", interval="100ms", interval_queue="api", concurrency=3)
    def a() -> None: ...

    backend = siq_state(app).backend
    old = IntervalQueue("api", backend=backend, interval="100ms", quota="5/1s", concurrency=5)
    old.declare(origin="old code")
    old.set_limits(concurrency=8, origin="alice@ops")
    ((name, done),) = sync_app(app)
    assert describe(name, done, "siq sync") == (
        "queue 'api': declared limits quota 5/1s, concurrency 5 -> concurrency 3; replaces the limits override "
        "concurrency 8 set by alice@ops; effective limits quota 5/1s, concurrency 8 -> concurrency 3"
    )
    created = describe("new", IntervalQueue("new", backend=backend, interval="1s", burst=2).declare(), "w1")
    assert created == "queue 'new' created with interval 1s and limits burst 2, declared by w1"


def test_a_renewal_says_when_the_effective_limits_followed_an_expiry(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def old_cap_holds(state: Any) -> None:
        assert state.backend.status("api").state.concurrency == 1  # type: ignore[union-attr]  # the old node's cap holds

    renew_after_an_old_node_expired(tmp_path, monkeypatch, caplog, {"interval": "100ms", "concurrency": 1},
                                    before=old_cap_holds)  # fmt: skip
    assert "queue 'api': effective limits concurrency 1 -> none (a worker's declaration expired" in caplog.text


def test_a_deploy_that_changes_per_key_limits_logs_each_change_once_not_once_per_key(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = siq_state(make_app(tmp_path)).backend
    for n, cap in enumerate((5, 5, 4, 4)):  # keys declared by two earlier deploys
        IntervalQueue(f"shop:{n}", backend=backend, interval="1s", concurrency=cap).declare(origin="old code")
    per_key = PerKeyDeclarations(ttl=30.0)
    with caplog.at_level(logging.WARNING, "siq_celery"):
        for n in range(4):
            per_key.on_use(IntervalQueue(f"shop:{n}", backend=backend, interval="1s", concurrency=3), "w1@host")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "queue 'shop:0': declared limits concurrency 5 -> concurrency 3" in warnings[0]
    assert "queue 'shop:2': declared limits concurrency 4 -> concurrency 3" in warnings[1]


def test_the_first_declaration_of_a_queue_paused_before_any_worker_says_so() -> None:
    from siq_celery.backends import backend_from_url

    backend = backend_from_url(f"memory://paused-first-{uuid.uuid4().hex}")
    IntervalQueue("api", backend=backend).pause()
    done = IntervalQueue("api", backend=backend, interval="100ms", concurrency=2).declare()
    assert describe("api", done, "w1") == (
        "queue 'api': interval 100ms and limits concurrency 2 declared by w1; paused before any worker, it stays "
        "paused until resume"
    )
