"""Declarations without workers (declarations.py): what an app declares, bad declarations
named at definition, ``siq sync``, per-key queues declared on use, producers that only
say so, and the log line a changed declaration writes."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery

from siq_celery import ConfigurationError, IntervalTask
from siq_celery.config import siq_state
from siq_celery.declarations import NodeDeclarations, PerKeyDeclarations, app_declarations, describe, sync_app
from siq_celery.queue import IntervalQueue
from siq_celery.types import Declared


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

    @app.task(base=IntervalTask, shared=False, name="c", interval_queue={"{g}s": "1s", "{g}d": "10/d"})
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
    monkeypatch.setattr("siq_celery.declarations.time.monotonic", lambda: now[0])
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
