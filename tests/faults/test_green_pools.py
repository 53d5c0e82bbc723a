"""Workers on a green pool (``-P gevent``, ``-P eventlet``) die while they hold interval tasks.

Celery runs a green pool without its event loop: the consumer drains the broker
synchronously, and on the Redis broker that path never sweeps the unacknowledged messages
of a dead worker back into the queue (kombu's ``restore_visible`` runs only from the event
loop's timer, or after a poll that saw no socket at all, which never happens while a BRPOP
is pending). The worker's upkeep sweeps them instead (siq_celery/broker_restore.py). On
RabbitMQ the server requeues a dead connection's unacknowledged messages at once.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from kombu import Connection

from tests.faults.conftest import publish, wait_finished
from tests.faults.test_worker_faults import running_on, until
from tests.integration.conftest import CeleryRun

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults]


def kill_one_mid_body(run: CeleryRun, pool: str) -> None:
    """Three nodes of ``-c 20`` on ``pool``, 90 bodies of 0.3 s at 30 ms; one node SIGKILLed
    with bodies running (and more tasks taken, waiting): within 30 s of the kill every task
    finished once, the interrupted bodies started again."""
    run.env.update(SIQ_TEST_INTERVAL="30ms")
    for name in ("survivor-a", "survivor-b"):
        run.start_worker(name, 20, pool).wait_ready()
    victim = run.start_worker("victim", 20, pool).wait_ready()
    publish(run, range(90), work=0.3)
    until(lambda: len(running_on(run, victim.name)) >= 2, 30, "two bodies running on the victim")
    victim.kill()
    killed_at = time.monotonic()
    interrupted = running_on(run, victim.name)
    finishes = wait_finished(run, 90, 40)
    took = time.monotonic() - killed_at - 1.0  # wait_finished looks a second longer for duplicates
    starts = run.starts()
    twice = sorted(n for n, c in Counter(s["n"] for s in starts).items() if c > 1)
    print(f"\n{pool}: killed with {sorted(interrupted)} running; all finished {took:.1f} s after the kill; "
          f"started twice: {twice}")  # fmt: skip
    assert sorted(finishes) == list(range(90)) and max(finishes.values()) == 1, "every task finished once"
    assert set(twice) == interrupted, "an interrupted body runs again, nothing else does"
    assert took < 30.0


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_sigkilled_green_worker_s_tasks_come_back_on_the_redis_broker(fault_run: CeleryRun, pool: str) -> None:
    kill_one_mid_body(fault_run, pool)  # visibility timeout 10 s, swept every second
    log = "".join(w.log() for w in fault_run.workers if w.name.startswith("survivor"))
    assert "put back" in log, "the survivor's upkeep restored them"


@pytest.mark.rabbitmq
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_sigkilled_green_worker_s_tasks_come_back_on_rabbitmq(fault_run: CeleryRun, amqp_url: str, pool: str) -> None:
    fault_run.env.update(SIQ_TEST_BROKER=amqp_url)
    try:
        kill_one_mid_body(fault_run, pool)
    finally:
        with Connection(amqp_url) as conn:  # a durable queue of this test: leave the server as found
            conn.default_channel.queue_delete(fault_run.env["SIQ_TEST_QUEUE"])
