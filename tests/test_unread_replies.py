"""A consumer SIGKILLed while kombu holds a BRPOP reply unread (its credit ran out with a
BRPOP pending): with siq_celery's guard the message is back in its queue, not lost.

Against a real Redis broker and a real kombu consumer in a forked process: prefetch 2,
one message taken and held, a second BRPOP sent, then the credit lowered to 1 (what Celery
does when it applies a task it held for an ETA) and a second message published. Unguarded,
kombu leaves the reply with that message in it unread (5.7 stops watching the socket, older
ones skip it while there is no credit): after the kill the queue is empty and the unacked
hash holds only the first, so nothing can bring the second back."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from siq_celery.broker.unread_replies import guard_unread_replies

pytestmark = [pytest.mark.processes]

EXCHANGE = Exchange("unread", type="direct")
QUEUE = Queue("unread", EXCHANGE, routing_key="unread")


def consume_then_lose_credit(broker: str, guarded: bool, ready: int) -> None:
    """The forked consumer: never returns (it is killed)."""
    if guarded:
        assert guard_unread_replies()
    conn = Connection(broker)
    channel = conn.default_channel
    channel.basic_qos(0, 2, False)
    got: list[object] = []
    Consumer(channel, queues=[QUEUE], callbacks=[lambda body, message: got.append(body)]).consume()
    while not got:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.2)  # a second BRPOP goes out, with a message of credit left
    channel.basic_qos(0, 1, False)  # the credit is gone, the BRPOP still pending
    os.write(ready, b"1")
    while True:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)


def killed_with_a_pending_reply(broker: str, guarded: bool) -> tuple[int, int]:
    """(messages in the queue, in the unacked hash) after the consumer's SIGKILL."""
    client = redis.Redis.from_url(broker)
    client.flushdb()
    with Connection(broker) as producer:
        QUEUE(producer.default_channel).declare()
        Producer(producer.default_channel).publish({"n": 1}, exchange=EXCHANGE, routing_key="unread")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            consume_then_lose_credit(broker, guarded, ready_w)
        finally:
            os._exit(1)
    try:
        assert os.read(ready_r, 1) == b"1"
        with Connection(broker) as producer:  # another producer, while that BRPOP is pending
            Producer(producer.default_channel).publish({"n": 2}, exchange=EXCHANGE, routing_key="unread")
        time.sleep(1.0)  # the reply reaches the consumer's socket; the consumer runs on
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
    return client.llen("unread"), client.hlen("unacked")


def test_a_message_in_a_reply_the_consumer_had_no_credit_for_survives_its_kill(redis_url: str) -> None:
    broker = redis_url.rsplit("/", 1)[0] + "/6"
    queued, unacked = killed_with_a_pending_reply(broker, guarded=True)
    assert (queued, unacked) == (1, 1), "the second message is back in its queue, the first in the unacked hash"
