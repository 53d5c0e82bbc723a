"""Transit records on the Redis broker (siq_celery/broker_transit.py): a message of an
interval task that a consumer took with BRPOP and died before holding is put back, and
nothing else is: not a message still queued, not one a live consumer is about to hold,
not a purged one.

Against a real Redis and real kombu producers and consumers; the death between BRPOP and
the unacked write is a real SIGKILL of a forked consumer, at the start of that write."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

from siq_celery.broker import transit as broker_transit
from siq_celery.broker.transit import TRANSIT, TRANSIT_DUE, TransitSweep, guard_transit
from siq_celery.clock import CLOCK

pytestmark = [pytest.mark.processes]

EXCHANGE = Exchange("transit", type="direct")
QUEUE = Queue("transit", EXCHANGE, routing_key="transit")
GRACE = 0.2
TICKETED = {"siq_queue": "transit", "siq_ticket": 1, "siq_epoch": "ab"}


@pytest.fixture
def broker(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    url = redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(url).flushdb()
    assert guard_transit()
    monkeypatch.setattr(broker_transit, "GRACE_S", GRACE)
    yield url
    redis.Redis.from_url(url).flushdb()


def options(prefix: str) -> dict[str, Any]:
    return {"global_keyprefix": prefix} if prefix else {}


def publish(broker: str, n: int, prefix: str = "", ticketed: bool = True) -> None:
    with Connection(broker, transport_options=options(prefix)) as conn:
        QUEUE(conn.default_channel).declare()
        producer = Producer(conn.default_channel)
        for i in range(n):
            producer.publish({"n": i}, exchange=EXCHANGE, routing_key="transit", headers=TICKETED if ticketed else {})


def sweeper(broker: str, prefix: str = "") -> TransitSweep:
    app = Celery("transit", broker=broker)
    app.conf.broker_transport_options = options(prefix)
    return TransitSweep(app, grace=GRACE)


def sweep_until_quiet(sweep: TransitSweep, rounds: int = 4) -> int:
    """Sweeps a grace apart (a record is first due a grace after its publish): put back."""
    restored = 0
    for _ in range(rounds):
        time.sleep(GRACE * 1.2)
        restored += sweep.sweep()
    return restored


def die_holding(broker: str, prefix: str) -> None:
    """The forked consumer: SIGKILLed by itself as it starts to write the message it took
    to the unacked hash (after BRPOP's reply was read: the window)."""
    from kombu.transport import redis as transport

    def killed(self: Any, message: Any, delivery_tag: str) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    transport.QoS.append = killed  # type: ignore[method-assign]
    conn = Connection(broker, transport_options=options(prefix))
    Consumer(conn.default_channel, queues=[QUEUE], callbacks=[lambda body, message: None]).consume()
    while True:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)


def killed_in_transit(broker: str, prefix: str) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            die_holding(broker, prefix)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the consumer died in the window"


def received(broker: str, prefix: str = "", timeout: float = 5.0) -> list[Any]:
    """Consume (and acknowledge) what the queue holds now."""
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with (
        Connection(broker, transport_options=options(prefix)) as conn,
        Consumer(conn.default_channel, queues=[QUEUE], callbacks=[on_message]),
    ):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.3)
            except TimeoutError:
                if got:
                    break
    return got


@pytest.mark.parametrize("prefix", ["", "tenant-a:"])
def test_a_message_whose_consumer_died_before_holding_it_goes_back(broker: str, prefix: str) -> None:
    client = redis.Redis.from_url(broker)
    publish(broker, 1, prefix)
    killed_in_transit(broker, prefix)
    assert (client.llen(f"{prefix}transit"), client.hlen(f"{prefix}unacked")) == (0, 0), "lost to kombu alone"
    assert client.hlen(f"{prefix}{TRANSIT}") == 1
    sweep = sweeper(broker, prefix)
    restored = sweep_until_quiet(sweep)
    assert restored == 1
    assert client.llen(f"{prefix}transit") == 1
    assert received(broker, prefix) == [{"n": 0}], "the very message, once"
    assert client.hlen(f"{prefix}{TRANSIT}") == 0 and client.zcard(f"{prefix}{TRANSIT_DUE}") == 0
    assert sweep_until_quiet(sweep, 2) == 0
    sweep.close()


def test_without_a_ticket_kombu_alone_loses_it(broker: str) -> None:
    """The window itself: a message of another task, no record, nothing brings it back."""
    client = redis.Redis.from_url(broker)
    publish(broker, 1, ticketed=False)
    killed_in_transit(broker, "")
    assert sweep_until_quiet(sweeper(broker)) == 0
    assert (client.llen("transit"), client.hlen("unacked"), client.hlen(TRANSIT)) == (0, 0, 0)


def test_queued_messages_are_not_copied_and_held_ones_leave_no_record(broker: str) -> None:
    client = redis.Redis.from_url(broker)
    publish(broker, 30)
    sweep = sweeper(broker)
    assert sweep_until_quiet(sweep) == 0, "30 messages waiting in their list for 4 graces"
    assert client.llen("transit") == 30 and client.hlen(TRANSIT) == 30
    assert sorted(body["n"] for body in received(broker)) == list(range(30))
    assert (client.hlen(TRANSIT), client.zcard(TRANSIT_DUE), client.hlen("unacked")) == (0, 0, 0)


def test_a_consumer_between_brpop_and_holding_is_not_taken_for_dead(broker: str) -> None:
    """Found in no list once, the record is only suspect: the consumer's write deletes it."""
    client = redis.Redis.from_url(broker)
    publish(broker, 1)
    assert client.rpop("transit") is not None  # what BRPOP does; the unacked write comes "later"
    sweep = sweeper(broker)
    time.sleep(GRACE * 1.2)
    assert sweep.sweep() == 0, "suspect, not put back"
    (tag,) = client.hkeys(TRANSIT)
    client.hdel(TRANSIT, tag)  # the consumer's write, as kombu's QoS.append does it here
    assert sweep_until_quiet(sweep) == 0 and client.llen("transit") == 0
    assert (client.zcard(TRANSIT_DUE), client.zcard("siq:transit:suspect")) == (0, 0)


def test_a_purge_drops_the_records(broker: str) -> None:
    client = redis.Redis.from_url(broker)
    publish(broker, 5)
    with Connection(broker) as conn:
        assert QUEUE(conn.default_channel).purge() == 5
    assert client.hlen(TRANSIT) == 0
    assert sweep_until_quiet(sweeper(broker)) == 0 and client.llen("transit") == 0


def test_a_deleted_queue_takes_its_records_along(broker: str) -> None:
    client = redis.Redis.from_url(broker)
    publish(broker, 4)
    with Connection(broker) as conn:
        bound = QUEUE(conn.default_channel)
        bound.declare()
        bound.delete()
    assert (client.hlen(TRANSIT), client.exists("transit")) == (0, 0)
    assert sweep_until_quiet(sweeper(broker)) == 0 and client.exists("transit") == 0


def test_without_ack_emulation_no_record_is_written(broker: str) -> None:
    """kombu then keeps no unacked hash, so nothing would end a record: none is written."""
    client = redis.Redis.from_url(broker)
    with Connection(broker, transport_options={"ack_emulation": False}) as conn:
        QUEUE(conn.default_channel).declare()
        Producer(conn.default_channel).publish({"n": 0}, exchange=EXCHANGE, routing_key="transit", headers=TICKETED)
    assert (client.llen("transit"), client.hlen(TRANSIT)) == (1, 0)


def test_a_message_held_by_a_worker_whose_clock_went_back_is_not_handed_out_again(
    broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose clock is 180 s behind (and knows it: clock.py) holds a message; a
    worker on the right clock sweeps with a 10 s visibility timeout. The stamp is on the
    store's clock, so the message is not taken for one held 3 minutes and put back."""
    real = time.time
    monkeypatch.setattr(CLOCK, "skew", 0.0)
    publish(broker, 1)
    held: list[Any] = []
    with Connection(broker, transport_options={"visibility_timeout": 10}) as conn:
        monkeypatch.setattr(time, "time", lambda: real() - 180)
        CLOCK.observe(int(real() * 1e6))  # the worker noticed
        with Consumer(conn.default_channel, queues=[QUEUE], callbacks=[lambda body, message: held.append(body)]):
            conn.drain_events(timeout=5)
        monkeypatch.setattr(time, "time", real)
        CLOCK.observe(int(real() * 1e6))  # the sweeper's clock is right
        with Connection(broker, transport_options={"visibility_timeout": 10}) as other:
            other.default_channel.qos.restore_visible(num=100, interval=1)
        assert held == [{"n": 0}]
        assert received(broker, timeout=1.0) == [], "held 0 s, not 180 s: not put back"
