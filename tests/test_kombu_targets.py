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
from siq_celery.broker_kombu import PAUSE_BRPOP_SINCE, missing_kombu_targets

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
