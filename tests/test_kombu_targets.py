"""A kombu whose Redis transport lacks what siq_celery patches (siq_celery/broker_kombu.py):
a worker of interval tasks on the Redis broker refuses to start, in one line naming the
kombu version and what is missing, instead of running with a guard silently off. Runs on
the newest kombu (``make test``) and on the floor (``make test-floors``)."""

from __future__ import annotations

import logging
from typing import Any

import kombu
import pytest
from celery import Celery, signals
from kombu.transport import redis as transport

from siq_celery import IntervalTask
from siq_celery.broker.kombu_api import PAUSE_BRPOP_SINCE, missing_kombu_targets

NEWER_POLLER = tuple(kombu.VERSION[:2]) >= PAUSE_BRPOP_SINCE


class Worker:
    """What siq_celery's worker signals read of Celery's WorkController."""

    def __init__(self, app: Celery) -> None:
        self.app, self.hostname = app, "w1@host"


def test_this_kombu_has_every_target() -> None:
    assert missing_kombu_targets() == [], kombu.__version__


@pytest.mark.parametrize(
    ("owner", "attribute"),
    [
        ("Channel", "_put"),
        ("QoS", "append"),
        ("MultiChannelPoller", "on_readable"),
        ("module", "time"),
        pytest.param("MultiChannelPoller", "_pause_brpop", marks=pytest.mark.skipif(
            not NEWER_POLLER, reason=f"kombu {kombu.__version__} pauses no BRPOP")),
    ],
)  # fmt: skip
def test_a_worker_whose_patch_target_is_missing_refuses_to_start(
    owner: str, attribute: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target: Any = transport if owner == "module" else getattr(transport, owner)
    if owner == "module":
        monkeypatch.setattr(target, attribute, None)  # no longer the function kombu stamps with
    else:
        monkeypatch.delattr(target, attribute)
    app = Celery("kombu-check", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.siq_url = "memory://kombu-check"

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="kombu-check")
    def job() -> None: ...

    app.finalize()  # as a worker does before worker_init
    with caplog.at_level(logging.INFO, "siq_celery"), pytest.raises(SystemExit) as refused:
        signals.worker_init.send(sender=Worker(app))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    print("\n".join(lines))
    assert refused.value.code == 1
    name = f"kombu.transport.redis.{attribute}" if owner == "module" else f"kombu.transport.redis.{owner}.{attribute}"
    assert len(lines) == 1 and f"kombu {kombu.__version__} has no {name}" in lines[0] and "\n" not in lines[0]


def test_on_another_broker_the_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards are the Redis broker's: elsewhere a missing target changes nothing."""
    monkeypatch.delattr(transport.Channel, "_put")
    app = Celery("kombu-check-memory", broker="memory://", set_as_current=False)
    app.conf.siq_url = "memory://kombu-check-memory"

    @app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="kombu-check-memory")
    def job() -> None: ...

    app.finalize()
    worker = Worker(app)
    try:
        signals.worker_init.send(sender=worker)
    finally:
        signals.worker_shutdown.send(sender=worker)


def test_nothing_is_patched_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from siq_celery.broker.transit import guard_transit
    from siq_celery.broker.unread_replies import guard_unread_replies

    monkeypatch.setattr(transport.Channel, "_siq_transit", False, raising=False)  # as before the first guard
    monkeypatch.setattr(transport.MultiChannelPoller, "_siq_guarded", False, raising=False)
    monkeypatch.delattr(transport.QoS, "append")
    put, readable = transport.Channel._put, transport.MultiChannelPoller.on_readable
    assert guard_transit() is False and guard_unread_replies() is False
    assert (transport.Channel._put, transport.MultiChannelPoller.on_readable) == (put, readable)


def test_a_producer_says_once_that_it_publishes_without_transit_records(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from siq_celery.tasks import task as task_module

    monkeypatch.setattr(task_module, "_UNGUARDED", ["kombu 9.0 has no kombu.transport.redis.QoS.append: ..."])
    app = Celery("kombu-check-producer", broker="memory://", set_as_current=False)
    app.conf.update(siq_url="memory://kombu-check-producer", task_always_eager=True)

    @app.task(base=IntervalTask, shared=False, interval="1ms", interval_queue="kombu-check-producer")
    def job() -> None: ...

    with caplog.at_level(logging.INFO, "siq_celery"):
        job.delay()
        job.delay()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "siq_celery"]
    assert lines == ["siq_celery: kombu 9.0 has no kombu.transport.redis.QoS.append: ...; interval tasks are "
                     "published without transit records"]  # fmt: skip
