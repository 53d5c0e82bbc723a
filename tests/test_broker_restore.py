"""The restore sweep of a worker without Celery's event loop (broker/restore.py), against
a real Redis broker: what a dead consumer left unacknowledged comes back to its queue once
the visibility timeout passed, and only on the workers that need it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from kombu import Connection

from siq_celery.broker.restore import UnackedRestore, needs_restore_sweep


def app_on(broker: str, **transport: object) -> Celery:
    app = Celery("restore", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = transport
    return app


@pytest.mark.parametrize(
    ("broker", "hub", "needed"),
    [
        ("redis://127.0.0.1:1/0", None, True),  # a green pool: synloop, no hub
        ("redis://127.0.0.1:1/0", object(), False),  # prefork, threads, solo: the event loop sweeps
        ("amqp://guest@127.0.0.1:1//", None, False),  # the server requeues a dead consumer's messages
        ("memory://", None, False),
    ],
)
def test_only_a_worker_without_the_event_loop_on_a_redis_broker_sweeps(broker: str, hub: object, needed: bool) -> None:
    consumer = SimpleNamespace(hub=hub, app=app_on(broker))
    assert needs_restore_sweep(consumer) is needed  # decided without connecting


def test_the_period_is_kombus_own_cadence() -> None:
    now = [100.0]
    default = UnackedRestore(app_on("redis://127.0.0.1:1/0"), clock=lambda: now[0])
    assert default.period == 100.0  # kombu's defaults: every 10 s, a scan every 10th call
    fast = UnackedRestore(
        app_on("redis://127.0.0.1:1/0", unacked_restore_interval=1, unacked_restore_throttle=1), clock=lambda: now[0]
    )
    assert fast.period == 1.0
    assert fast.maybe_sweep() is None  # nothing of a worker dead before this one started is due yet


def test_a_dead_consumers_message_comes_back_after_the_visibility_timeout(redis_url: str) -> None:
    broker = redis_url.rsplit("/", 1)[0] + "/5"
    redis.Redis.from_url(broker).flushdb()
    options = {"visibility_timeout": 1, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
    with Connection(broker, transport_options=options) as dead:
        queue = dead.SimpleQueue("restore-test")
        queue.put({"n": 1})
        taken = queue.get(timeout=5)  # delivered, never acknowledged: its consumer "dies" holding it
        assert taken.payload == {"n": 1}
        client = redis.Redis.from_url(broker)
        assert client.llen("restore-test") == 0
        restore = UnackedRestore(app_on(broker, **options))
        assert restore.sweep() == 0, "not before the visibility timeout"
        time.sleep(1.2)
        assert restore.sweep() == 1
        assert client.llen("restore-test") == 1, "back in its queue"
        assert restore.sweep() == 0
        restore.close()
        queue.close()
    redis.Redis.from_url(broker).flushdb()
