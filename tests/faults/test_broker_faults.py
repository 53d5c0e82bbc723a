"""The broker restarts under running workers (Redis with its append-only file, and
RabbitMQ): the workers reconnect, the broker redelivers what was not acknowledged, and
every task runs once (a redelivered copy of a finished task is skipped: the store
remembers finished task ids) at the interval."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from kombu import Connection

from tests.apps.geo import REFUSED, REPUBLISHES
from tests.faults.conftest import ControlledRedis, publish, wait_finished
from tests.integration.conftest import CeleryRun, gaps_ms
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults, HOST_CLOCK_RERUNS]


def skipped_copies(run: CeleryRun) -> int:
    return sum(w.log().count("a redelivered copy, not run again") for w in run.workers)


def report(run: CeleryRun, what: str, down_s: float) -> None:
    starts = run.starts()
    print(f"\n{what} down {down_s:.1f} s: {len(starts)} starts, {skipped_copies(run)} redelivered copies of finished "
          f"tasks skipped, smallest gap {min(gaps_ms(starts)):.2f} ms")  # fmt: skip


def supervise(run: CeleryRun, names: list[str], until_done: int, timeout: float) -> int:
    """Restart any worker that exited, as systemd's Restart=always or Kubernetes would,
    until ``until_done`` tasks finished; how many restarts that took."""
    restarts, deadline = 0, time.monotonic() + timeout
    while len({f["n"] for f in run.finishes()}) < until_done and time.monotonic() < deadline:
        for name in names:
            current = [w for w in run.workers if w.name == f"{name}@siq-test"][-1]
            if not current.alive:
                run.start_worker(name, 2)
                restarts += 1
        time.sleep(0.5)
    return restarts


def test_redis_broker_restarted_mid_run(fault_run: CeleryRun, broker: ControlledRedis) -> None:
    """Celery 5.7 / kombu 5.7 workers exit ("Unrecoverable error: AttributeError: 'NoneType'
    object has no attribute 'hostname'", while restoring unacknowledged messages on the
    lost connection) when a Redis broker goes away: under a supervisor they come back, and
    what they held is redelivered after the visibility timeout."""
    fault_run.start_workers(2, 2)
    publish(fault_run, range(120))
    fault_run.wait_for(lambda s: len(s) >= 40, 30, "40 starts")
    stopped = time.monotonic()
    broker.shutdown_saving()
    time.sleep(3.0)
    broker.start()
    down = time.monotonic() - stopped
    restarts = supervise(fault_run, ["node0", "node1"], 120, 90)
    finishes = wait_finished(fault_run, 120, 30)
    report(fault_run, f"Redis broker ({restarts} worker restarts by the supervisor)", down)
    assert sorted(finishes) == list(range(120)) and max(finishes.values()) == 1
    host_gaps_at_least(gaps_ms(fault_run.starts()), 45.0)


def rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def rabbitmq(amqp_url: str) -> Iterator[str]:
    if shutil.which("rabbitmqctl") is None or rabbitmqctl("status").returncode != 0:
        pytest.skip("rabbitmqctl cannot control the RabbitMQ server here: cannot restart it")
    yield amqp_url
    rabbitmqctl("start_app")  # whatever happened in the test, the server runs again after it


def test_rabbitmq_restarted_mid_run(fault_run: CeleryRun, rabbitmq: str) -> None:
    fault_run.env.update(SIQ_TEST_BROKER=rabbitmq)
    try:
        fault_run.start_workers(2, 2)
        publish(fault_run, range(120))
        fault_run.wait_for(lambda s: len(s) >= 40, 30, "40 starts")
        stopped = time.monotonic()
        try:
            assert rabbitmqctl("stop_app").returncode == 0
            time.sleep(2.0)
        finally:
            assert rabbitmqctl("start_app").returncode == 0
        down = time.monotonic() - stopped
        finishes = wait_finished(fault_run, 120, 120)
        report(fault_run, "RabbitMQ", down)
        assert sorted(finishes) == list(range(120)) and max(finishes.values()) == 1
        host_gaps_at_least(gaps_ms(fault_run.starts()), 45.0)
        assert all(w.alive for w in fault_run.workers)
    finally:
        with Connection(rabbitmq) as conn:  # a durable queue of this test: leave the server as found
            conn.default_channel.queue_delete(fault_run.env["SIQ_TEST_QUEUE"])


def test_a_body_longer_than_the_visibility_timeout_runs_once(fault_run: CeleryRun) -> None:
    """The Redis broker hands a message its worker has not acknowledged within the
    visibility timeout to another worker while the body still runs ("tasks run twice on the
    Redis broker"). The copy finds the body's lease live (renewed every third of
    ``siq_lease_timeout`` while it runs), is deferred, and is refused once the body finished."""
    fault_run.env.update(
        SIQ_TEST_INTERVAL="100ms", SIQ_TEST_HORIZON="1", SIQ_TEST_LEASE_TIMEOUT="3",
        SIQ_TEST_TRANSPORT=json.dumps(
            {"visibility_timeout": 2, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        ),
    )  # fmt: skip
    for name in ("a", "b", "c"):  # more pool processes than bodies: the copies find one free
        fault_run.start_worker(name, 2).wait_ready()
    publish(fault_run, range(3), work=6.0)
    finishes = wait_finished(fault_run, 3, 60)
    time.sleep(4)  # a copy deferred past the finishes comes back and is refused
    starts = fault_run.starts()
    held = sum(w.log().count("is running elsewhere") for w in fault_run.workers)
    print(f"\n3 bodies of 6 s, visibility timeout 2 s: {held} copies found their body running, "
          f"{skipped_copies(fault_run)} refused after it finished; starts per task "
          f"{sorted(Counter(s['n'] for s in starts).values())}")  # fmt: skip
    assert held >= 1, "no copy came while a body ran: the test did not test"
    assert sorted(finishes) == [0, 1, 2] and max(finishes.values()) == 1
    assert sorted(s["n"] for s in starts) == [0, 1, 2], "every body ran exactly once"


def test_a_broker_that_refuses_three_republishes_loses_no_deferred_task(fault_run: CeleryRun) -> None:
    """Tasks sent by name (no ticket: each worker claims one, far from its slot) are
    deferred, again and again; the broker refuses three of those re-publishes mid-run.
    Every task runs, once, and none fails."""
    fault_run.env.update(SIQ_TEST_REFUSE_REPUBLISHES="3@30", SIQ_TEST_HORIZON="600")
    fault_run.start_workers(2, 2)
    for n in range(200):
        fault_run.app.send_task("geo.record", (n,))
    finishes = wait_finished(fault_run, 200, 120)
    refused = [json.loads(r) for r in fault_run.records.lrange(REFUSED, 0, -1)]
    republished = int(fault_run.records.get(REPUBLISHES) or 0)
    failed = sum(w.log().count("raised unexpected") for w in fault_run.workers)
    print(f"\n{republished} deferrals re-published, {len(refused)} refused; {len(finishes)} tasks finished, "
          f"most runs of one {max(finishes.values())}, {failed} failures")  # fmt: skip
    assert len(refused) == 3, "the broker refused three re-publishes"
    assert sorted(finishes) == list(range(200)) and max(finishes.values()) == 1, "every task ran, once"
    assert failed == 0, "no task failed"
    store_us = sorted(s["store_start_us"] for s in fault_run.starts())
    assert min(b - a for a, b in itertools.pairwise(store_us)) >= 50_000, "the interval held (store clock)"
