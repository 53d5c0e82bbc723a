"""IntervalTask without workers: settings, errors at publish, eager mode, headers. Tests of
an app with a store of its own take Celery's ``celery_app`` and siq_celery's ``siq_store``."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from siq_celery import ConfigurationError, IntervalQueue, IntervalTask, InvalidQueueNameError
from siq_celery.messages import ticket_from_headers, ticket_headers
from siq_celery.pytest_plugin import SiqStore
from siq_celery.tasks.app_state import siq_state
from siq_celery.tasks.settings import SiqSettings
from siq_celery.tasks.task import install
from siq_celery.testing import PinnedClock
from siq_celery.types import Ticket


def make_app(**conf: Any) -> Celery:
    app = Celery("unit", broker=conf.pop("broker", "memory://"), set_as_current=False)
    app.conf.update(conf)
    return app


def test_siq_url_defaults_to_a_redis_broker() -> None:
    assert SiqSettings.from_app(make_app(broker="redis://h:6379/3")).url == "redis://h:6379/3"


def test_another_broker_without_siq_url_says_what_to_set() -> None:
    with pytest.raises(ConfigurationError, match="siq_url"):
        SiqSettings.from_app(make_app(broker="amqp://guest@localhost//"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("siq_max_sleep", "soon"),
        ("siq_paused_poll", 0),
        ("siq_countdown_margin", -1),
        ("siq_backoff_default", -1),
        ("siq_backoff_default", 86_401),  # a back-off holds at most a day
    ],
)
def test_bad_settings_are_named(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=key):
        SiqSettings.from_app(make_app(siq_url="memory://", **{key: value}))


def test_a_queue_with_no_interval_anywhere_fails_at_the_first_publish(celery_app: Celery, siq_store: SiqStore) -> None:
    @celery_app.task(base=IntervalTask, shared=False)
    def untimed() -> None: ...

    with pytest.raises(ConfigurationError, match="no interval"):
        untimed.delay()


@pytest.mark.celery(siq_default_interval="250ms")
def test_interval_falls_back_to_siq_default_interval_and_queue_to_the_task_name(
    celery_app: Celery, siq_store: SiqStore
) -> None:
    @celery_app.task(base=IntervalTask, shared=False, name="pkg.lookup")
    def lookup() -> None: ...

    q = lookup.siq_queue()
    assert (q.name, q.interval_us) == ("pkg.lookup", 250_000)
    assert q is lookup.siq_queue()  # cached on the app
    assert siq_state(celery_app) is siq_state(celery_app)


@pytest.mark.celery(task_always_eager=True)
def test_eager_mode_waits_in_process_and_records_the_finish(
    celery_app: Celery, siq_store: SiqStore, siq_clock: PinnedClock
) -> None:
    @celery_app.task(base=IntervalTask, shared=False, interval="10s", interval_queue="eager")
    def work(n: int) -> int:
        return n

    began = siq_clock.now_us
    assert [work.delay(n).get() for n in range(3)] == [0, 1, 2]  # each waited 10 s on the store's clock
    assert [(row.ticket, row.start_us - began, row.outcome) for row in siq_store.starts("eager")] == [
        (1, 10_000_000, "SUCCESS"), (2, 20_000_000, "SUCCESS"), (3, 30_000_000, "SUCCESS"),
    ]  # fmt: skip
    status = siq_store.status("eager")
    assert (status.state.current, status.finished) == (3, 3)


def test_headers_round_trip() -> None:
    ticket = Ticket("geo", 42, "abc123", 0, 0)
    assert ticket_from_headers(ticket_headers(ticket), "geo") == (Ticket("geo", 42, "abc123", 0, 0), None)
    assert ticket_from_headers({}, "geo") == (None, None)
    assert ticket_from_headers(None, "geo") == (None, None)


@given(
    queue=st.one_of(st.none(), st.text(max_size=5), st.integers()),
    number=st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5), st.booleans()),
    epoch=st.one_of(st.none(), st.text(max_size=70), st.integers()),
)
def test_tampered_headers_never_yield_a_foreign_or_malformed_ticket(queue: Any, number: Any, epoch: Any) -> None:
    ticket, reason = ticket_from_headers({"siq_queue": queue, "siq_ticket": number, "siq_epoch": epoch}, "geo")
    if ticket is not None:
        assert queue == "geo" and isinstance(number, int) and not isinstance(number, bool) and number >= 1
        assert reason is None


def test_the_published_message_carries_the_ticket_and_an_eta_on_the_store_clock(redis_url: str) -> None:
    from celery import signals

    app = make_app(broker=redis_url.replace("/0", "/5"), siq_url=redis_url)
    sent: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    install()  # siq_celery's own receivers first (connected when an interval task first binds)
    signals.before_task_publish.connect(capture, weak=False)  # so this one runs after them
    try:

        @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="published")
        def job(n: int) -> None: ...

        for n in range(3):
            job.delay(n)
        job.apply_async((9,), countdown=30, headers={"siq_ticket": 999, "mine": "kept"})
    finally:
        signals.before_task_publish.disconnect(capture)
    assert [h["siq_ticket"] for h in sent] == [1, 2, 3, 4]
    assert {h["siq_queue"] for h in sent} == {"published"} and len({h["siq_epoch"] for h in sent}) == 1
    assert sent[0]["eta"] is not None  # a new queue's first slot is one interval away
    status = job.siq_queue().status()
    first_eta = datetime.fromisoformat(sent[0]["eta"]).timestamp()
    assert abs(first_eta - (status.state.anchor_us + 1_000_000 - 20_000) / 1e6) < 0.001  # slot - margin
    assert sent[3]["mine"] == "kept"  # the caller's headers and countdown stand
    assert job.siq_queue().backend.client.connection_pool._in_use_connections == set()  # nothing left unread


@pytest.mark.parametrize(("interval", "setting", "by_eta"), [("5ms", None, False), ("19ms", None, False),
                                                           ("20ms", None, True), ("5ms", 0, True),
                                                           ("30ms", 0.05, False)])  # fmt: skip
def test_a_short_interval_waits_in_the_broker_queue_not_by_eta(
    redis_url: str, interval: str, setting: float | None, by_eta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``siq_broker_wait_below`` no task carries an ETA, on every publish path, so
    no worker node takes one before it has a free process for it. Each ticket's own
    estimated delay is read as it is published: a slow host publishes the backlog more
    slowly than the line moves, and a ticket whose slot has come has no ETA either way."""
    from celery import signals

    from siq_celery.tasks import publish

    conf = {} if setting is None else {"siq_broker_wait_below": setting}
    app = make_app(broker=redis_url.replace("/0", "/5"), siq_url=redis_url, **conf)
    sent: list[dict[str, Any]] = []
    delays: dict[int, float] = {}
    eta_for = publish.eta_for

    def spy(ticket: Ticket, margin: float, broker_wait_below: float = 0.0) -> datetime | None:
        delays[ticket.number] = ticket.delay
        return eta_for(ticket, margin, broker_wait_below)

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    monkeypatch.setattr(publish, "eta_for", spy)
    install()  # siq_celery's own receivers first (connected when an interval task first binds)
    signals.before_task_publish.connect(capture, weak=False)  # so this one runs after them
    try:

        @app.task(base=IntervalTask, shared=False, interval=interval, interval_queue=f"short-{interval}-{setting}")
        def job(n: int) -> None: ...

        for n in range(20):  # a backlog: the last slots are 20 intervals out, far beyond the margin
            job.delay(n)
        job.apply_many([(n,) for n in range(60)], chunk_size=30)  # claimed 30 at once: 150 ms and more out
    finally:
        signals.before_task_publish.disconnect(capture)
    assert [h["siq_ticket"] for h in sent] == list(range(1, 81))
    far = [h for h in sent if delays[h["siq_ticket"]] > 0.02]  # beyond the 20 ms margin when published
    assert len(far) >= 20, delays  # a chunk of 30 claimed at once reaches 150 ms out however slow the host
    assert all((h["eta"] is not None) is by_eta for h in far), [h["eta"] for h in far]
    assert all(h["eta"] is None for h in sent if delays[h["siq_ticket"]] <= 0.02)


def test_broker_wait_below_must_be_seconds() -> None:
    with pytest.raises(ConfigurationError, match="siq_broker_wait_below"):
        SiqSettings.from_app(make_app(siq_url="memory://", siq_broker_wait_below=-0.01))


@pytest.mark.parametrize(
    ("broker", "options", "horizon", "warns"),
    [
        ("redis://localhost/0", {"visibility_timeout": 20}, 600.0, True),
        ("redis://localhost/0", {"visibility_timeout": 20}, 10.0, False),
        ("redis://localhost/0", {}, 600.0, False),  # kombu's default visibility_timeout: 1 h
        ("amqp://guest@localhost//", {}, 1800.0, True),  # RabbitMQ's default consumer_timeout: 30 min
        ("amqp://guest@localhost//", {}, 600.0, False),
    ],
)
def test_a_worker_warns_when_the_broker_would_forget_before_the_horizon(
    broker: str, options: dict[str, int], horizon: float, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from celery import Celery

    from siq_celery.broker.check import warn_if_broker_forgets_before_horizon

    app = Celery("warn", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = options
    with caplog.at_level("WARNING", logger="siq_celery"):
        warn_if_broker_forgets_before_horizon(app, horizon)
    assert ("lower siq_horizon" in caplog.text) is warns


def test_per_key_queues_costs_and_limits_are_checked_at_publish(celery_app: Celery, siq_store: SiqStore) -> None:
    app = celery_app

    @app.task(
        base=IntervalTask, shared=False, interval="1s", interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}"
    )
    def per_shop(shop: str) -> None: ...

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="w", cost=lambda args, kwargs: args[0])
    def weighted(points: object) -> None: ...

    @app.task(base=IntervalTask, shared=False, interval=["1s"], interval_queue=["{a}x", "{a}y"])
    def mismatched() -> None: ...

    assert per_shop.siq_queue([], {"shop": "s1"}).name == "shop:s1"
    assert per_shop.siq_queue([], {"shop": "s1"}) is per_shop.siq_queue([], {"shop": "s1"})
    with pytest.raises(ConfigurationError, match="interval_queue"):
        per_shop.delay(1)  # no shop: the callable raised, nothing claimed
    with pytest.raises(InvalidQueueNameError):
        per_shop.delay(shop="has space")
    for bad in (0, 2.5, "3", True, None):
        with pytest.raises(ConfigurationError, match="cost"):
            weighted.delay(bad)
    with pytest.raises(ConfigurationError, match="2 interval queues but 1 intervals"):
        mismatched.delay()
    assert siq_store.backend.queues() == [], "nothing was claimed"


def test_interval_tasks_are_durable_unless_the_task_or_the_app_says_otherwise() -> None:
    """Acknowledged after they ran and given back if their process dies, by default; an
    explicit choice (task attribute, app.conf.update, config_from_object) is kept."""
    from celery import Celery

    from siq_celery import IntervalTask

    def app(**conf: object) -> Celery:
        made = Celery("durable", set_as_current=False)
        made.conf.update(siq_url="memory://durable", **conf)
        return made

    plain_app = app()

    @plain_app.task(base=IntervalTask, interval="1s", shared=False)
    def defaults() -> None: ...

    @plain_app.task(base=IntervalTask, interval="1s", shared=False, acks_late=False)
    def early() -> None: ...

    @plain_app.task(shared=False)
    def not_interval() -> None: ...

    assert (defaults.acks_late, defaults.reject_on_worker_lost) == (True, True)
    assert (early.acks_late, early.reject_on_worker_lost) == (False, True)
    assert not_interval.acks_late is False  # Celery's own default, for other tasks

    configured = app(task_acks_late=False)

    @configured.task(base=IntervalTask, interval="1s", shared=False)
    def app_says() -> None: ...

    assert (app_says.acks_late, app_says.reject_on_worker_lost) == (False, True)

    class Config:
        task_reject_on_worker_lost = False

    from_object = Celery("durable-object", set_as_current=False)
    from_object.config_from_object(Config)

    @from_object.task(base=IntervalTask, interval="1s", shared=False)
    def object_says() -> None: ...

    assert (object_says.acks_late, object_says.reject_on_worker_lost) == (True, False)


def test_ensure_and_declare_with_another_interval_leave_the_cached_queue_as_declared(
    celery_app: Celery, siq_store: SiqStore
) -> None:
    """The app caches one IntervalQueue per declaration: an ``ensure(..., reset=True)`` or a
    ``declare(...)`` with another interval changes the store, never the cached object (the
    worker's renewals would declare that interval for the code's)."""

    @celery_app.task(base=IntervalTask, shared=False, interval="200ms", interval_queue="cached")
    def job() -> None: ...

    job.siq_queue().ensure("1s", reset=True)
    assert job.siq_queue().status().state.interval_us == 1_000_000
    job.siq_queue().declare("2s")
    assert job.siq_queue().status().state.interval_us == 2_000_000
    print(f"\nthe cached queue's interval after ensure and declare: {job.siq_queue().interval_us} us")
    assert job.siq_queue().interval_us == 200_000
    assert job.siq_queue().declare().declared_us == 200_000, "a renewal declares the code's interval"
    standalone = IntervalQueue("fresh", backend=job.siq_queue().backend)
    standalone.ensure("1s")  # an object without an interval of its own takes the one it was given
    assert standalone.interval_us == 1_000_000


def test_an_amqp_brokers_password_never_reaches_the_error_of_a_publish() -> None:
    app = make_app(broker="amqp://alice:s3cretpw@127.0.0.1:5672//")

    @app.task(base=IntervalTask, shared=False, interval="1s")
    def lookup() -> None: ...

    with pytest.raises(ConfigurationError) as info:
        lookup.delay()
    assert "s3cretpw" not in str(info.value) and "amqp://alice:***@127.0.0.1:5672//" in str(info.value)


def test_an_empty_interval_queue_is_refused_not_taken_for_the_task_name() -> None:
    app = make_app(siq_url="memory://")
    with pytest.raises(InvalidQueueNameError, match="empty"):

        @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="", name="pkg.empty")
        def lookup() -> None: ...

        lookup.delay()  # (a lazily created task class is refused here, at its first publish)
    with pytest.raises(InvalidQueueNameError, match="empty"):

        @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue=["ok", ""], name="pkg.empty2")
        def lookup2() -> None: ...

        lookup2.delay()


@pytest.mark.celery(siq_default_interval="250ms", siq_default_margin="2ms")
def test_a_tasks_margin_and_the_apps_default_margin_reach_its_queue(celery_app: Celery, siq_store: SiqStore) -> None:
    @celery_app.task(base=IntervalTask, shared=False, name="pkg.call", margin="5ms")
    def call() -> None: ...

    @celery_app.task(base=IntervalTask, shared=False, name="pkg.other")
    def other() -> None: ...

    assert (call.siq_queue().limits.margin_us, other.siq_queue().limits.margin_us) == (5_000, 2_000)
    call.delay()
    state = call.siq_queue().status().state
    assert (state.interval_us, state.margin_us) == (255_000, 5_000)


def test_a_tasks_margin_that_is_not_a_duration_is_refused_at_definition() -> None:
    app = make_app(siq_url="memory://")
    with pytest.raises(ConfigurationError, match=r"task .*margin 'soon': a duration from 0 to 60 s"):

        @app.task(base=IntervalTask, shared=False, interval="1s", margin="soon")
        def bad() -> None: ...

        bad.name  # noqa: B018 (the task is defined when the app finalizes it)


@pytest.mark.parametrize("option", [{"quota": "100/d"}, {"burst": 3}, {"margin": "5ms"}])
@pytest.mark.parametrize("queues", [["{g}a", "{g}b"], {"{g}a": "1s", "{g}b": "10ms"}])
def test_a_task_wide_burst_or_quota_on_several_queues_is_refused_at_definition(queues: Any, option: Any) -> None:
    app = make_app(siq_url="memory://")
    with pytest.raises(ConfigurationError, match=r"Limit\("):

        @app.task(base=IntervalTask, shared=False, interval_queue=queues, interval="1s", **option)
        def several() -> None: ...

        several.name  # noqa: B018 (the task is defined when the app finalizes it)


INTERVAL_OPTIONS = [
    {"interval": "1s"}, {"interval_queue": "plain"}, {"burst": 2}, {"quota": "10/s"}, {"concurrency": 2},
    {"margin": "5ms"}, {"cost": 2}, {"fair_key": lambda args, kwargs: "k"}, {"fair_weight": {"k": 2}},
]  # fmt: skip


@pytest.mark.parametrize("option", INTERVAL_OPTIONS, ids=lambda option: next(iter(option)))
def test_an_interval_option_without_base_interval_task_is_refused_at_definition(option: dict[str, Any]) -> None:
    """``@app.task(interval="1s")`` without ``base=IntervalTask``: Celery makes the option a
    class attribute no one reads, and the task would run unlimited."""
    app = make_app(siq_url="memory://")

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="limited")
    def limited() -> None: ...

    @app.task(shared=False, name="pkg.plain", **option)
    def plain() -> None: ...

    with pytest.raises(ConfigurationError) as refused:
        app.finalize()  # (a task is defined when its app is finalized: here, a worker's start or a first call)
    print(f"\n{refused.value}")
    assert str(refused.value).startswith(f"task pkg.plain: {next(iter(option))}= is an option of IntervalTask")
    assert "base=IntervalTask" in str(refused.value) and "\n" not in str(refused.value)


def test_an_interval_option_on_a_task_defined_later_stops_the_worker_start(caplog: pytest.LogCaptureFixture) -> None:
    """A task defined after the app was finalized is bound at once, by Celery alone: the
    worker's start finds it."""
    from celery import signals

    app = make_app(siq_url="memory://late-option")

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="limited-late")
    def limited() -> None: ...

    app.finalize()

    @app.task(shared=False, name="pkg.late", interval="1s")
    def late() -> None: ...

    class Worker:
        hostname = "w1@host"

    worker = Worker()
    worker.app = app  # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, "siq_celery"), pytest.raises(SystemExit):
        signals.worker_init.send(sender=worker)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "task pkg.late: interval= is an option of IntervalTask" in lines[0]


def test_a_deferred_delivery_ends_with_a_short_ignore_raised_in_before_start(
    celery_app: Celery, siq_store: SiqStore
) -> None:
    """Celery lists every frame of an Ignore's traceback twice and pickles it to the pool's
    parent: a deferral's Ignore carries no chained exception and no frame of the wait."""
    import traceback

    from celery.exceptions import Ignore

    @celery_app.task(base=IntervalTask, shared=False, interval="10s", interval_queue="deferred-short")
    def work(n: int) -> None: ...

    queue = work.siq_queue()
    queue.claim()  # its slot now; the next ticket's is 10 s out: that delivery is deferred
    headers = ticket_headers(queue.claim())
    work.push_request(
        id="deferred-1", args=[1], kwargs={}, headers=headers, is_eager=False, hostname="unit@test",
        delivery_info={"exchange": "", "routing_key": "celery"}, retries=0,
    )  # fmt: skip
    try:
        with pytest.raises(Ignore) as ended:
            work.before_start("deferred-1", [1], {})
    finally:
        work.pop_request()
    frames = [frame.name for frame in traceback.extract_tb(ended.value.__traceback__)]
    assert frames == ["test_a_deferred_delivery_ends_with_a_short_ignore_raised_in_before_start", "before_start"]
    assert ended.value.__context__ is None and ended.value.__cause__ is None
    assert siq_store.starts("deferred-short") == []  # deferred: nothing started
