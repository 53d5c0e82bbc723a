"""The state store fails over behind Redis Sentinel (issue 27): the harness works, and
what happens today.

Cheap checks only (the whole file runs in well under 3 minutes); bench/failover.py runs
the issue's full acceptance runs (240 tasks, three runs per fault, 5 s intervals).
"""

from __future__ import annotations

import itertools
import time

import pytest

from siq_celery import IntervalQueue
from tests.failover.conftest import SentinelSet, measure, slots
from tests.faults.conftest import publish
from tests.integration.conftest import CeleryRun
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults]

INTERVAL_MS = 50.0


def test_the_set_promotes_the_replica_and_a_queue_on_the_sentinel_url_goes_on(sentinel_set: SentinelSet) -> None:
    queue = IntervalQueue("geo", url=sentinel_set.url, interval="10ms")
    slots(queue, 5, timeout=5)
    old = sentinel_set.master_port()
    sentinel_set.kill_master()
    promotion = sentinel_set.wait_promotion(timeout=20)
    took = slots(queue, 5, timeout=20)
    state = queue.status().state
    print(f"\npromoted in {promotion:.2f} s; 5 slots after it in {took:.2f} s; ticket {state.ticket}")
    assert sentinel_set.master_port() != old
    assert promotion < 6.0, "down-after 1 s, then the vote and the promotion: a few seconds"
    assert state.ticket == 10, "the replica had every claim (no writes were lost), and claims go on"


def test_a_lagging_replica_is_promoted_without_the_masters_last_writes(sentinel_set: SentinelSet) -> None:
    """Fault 3 does what it says: what the master took after the cut is not on the new master."""
    queue = IntervalQueue("geo", url=sentinel_set.url, interval="1ms")
    slots(queue, 3, timeout=5)
    replica = sentinel_set.replica()
    sentinel_set.cut_replica()
    slots(queue, 4, timeout=5)  # on the master only
    sentinel_set.promote_lagging()
    promotion = sentinel_set.wait_promotion(timeout=20)
    slots(queue, 1, timeout=20)
    state = queue.status().state
    print(f"\npromoted in {promotion:.2f} s; ticket {state.ticket} after 8 claims")
    assert sentinel_set.master_port() == replica.port
    assert state.ticket == 4, "the 4 claims made after the cut are gone: the new master reissues their tickets"


@pytest.fixture
def store_set(sentinel_set: SentinelSet) -> SentinelSet:
    return sentinel_set


@HOST_CLOCK_RERUNS
def test_master_killed_under_real_workers_loses_nothing_runs_nothing_twice_keeps_the_interval(
    failover_run: CeleryRun, sentinel_set: SentinelSet
) -> None:
    failover_run.start_workers(3, 2)
    publish(failover_run, range(60))
    failover_run.wait_for(lambda s: len(s) >= 20, 30, "20 starts")
    at = sentinel_set.kill_master()
    promotion = sentinel_set.wait_promotion(timeout=20)
    failover_run.wait_for_count(60, timeout=60)
    time.sleep(2.0)  # a second copy, if any, shows
    figures = measure(failover_run.starts(), failover_run.finishes(), 60, INTERVAL_MS, at, promotion)
    print(f"\n{figures.line()}")
    assert figures.completed == 60 and figures.ran_twice == [], "every task ran, once"
    host_gaps_at_least([figures.smallest_gap_ms], 0.9 * INTERVAL_MS)


def test_a_partitioned_master_that_comes_back_authorizes_no_start_beside_the_new_master(
    sentinel_set: SentinelSet,
) -> None:
    """Fault 2 at the queue level: a client that talked to the master before the partition
    keeps its pooled connection to it (redis-py asks Sentinel only for a new connection),
    and the old master takes writes for about 10 s after it is back; a client that
    connects after the promotion talks to the new master. Before a start the store asks a
    sentinel which master it names (RedisBackend._check_master) and leaves the old one."""
    stale = IntervalQueue("geo", url=sentinel_set.url, interval="2s")
    slots(stale, 1, timeout=5)
    sentinel_set.stop_master()
    promotion = sentinel_set.wait_promotion(timeout=20)
    sentinel_set.cont_master()
    fresh = IntervalQueue("geo", url=sentinel_set.url, interval="2s")
    with stale.slot(timeout=10):
        first = time.time()
    with fresh.slot(timeout=10):
        second = time.time()
    demoted = sentinel_set.wait_demoted(timeout=30)
    print(
        f"\npromoted in {promotion:.2f} s, demoted {demoted:.2f} s after the return; starts {second - first:.3f} s "
        f"apart; the new master's ticket {fresh.status().state.ticket}"
    )
    assert second - first >= 0.9 * 2.0, "two starts closer than the interval: one per master"


def replicated(url: str, interval: str) -> IntervalQueue:
    """A queue whose starts and finishes count once a replica has them (siq_store_replicas=1)."""
    from siq_celery.backends import backend_from_url

    return IntervalQueue("geo", interval=interval, backend=backend_from_url(url, replicas=1, replica_timeout_ms=300))


def test_with_store_replicas_a_partitioned_master_that_comes_back_authorizes_nothing(
    sentinel_set: SentinelSet,
) -> None:
    """The same partition, with siq_store_replicas = 1: the old master, back and cut off
    from its replica (promoted), authorizes starts that no replica acknowledges, so they are
    not used: the client drops its connections and asks Sentinel anew. Nothing starts beside
    the new master; the price is a stall until a replica follows the new master."""
    stale = replicated(sentinel_set.url, "2s")
    slots(stale, 1, timeout=5)
    stopped = sentinel_set.stop_master()
    promotion = sentinel_set.wait_promotion(timeout=20)
    sentinel_set.cont_master()
    fresh = replicated(sentinel_set.url, "2s")
    starts = []
    for queue in (stale, fresh):
        with queue.slot(timeout=60):
            starts.append(time.time())
    ledger = sorted(r.start_us for r in fresh.ledger())
    gaps = [b - a for a, b in itertools.pairwise(ledger)]
    print(f"\npromoted in {promotion:.2f} s; the stale client's start {starts[0] - stopped:.2f} s after the stop, "
          f"the fresh one's {starts[1] - starts[0]:.3f} s later; starts on the new master's ledger: {len(ledger)}, "
          f"smallest gap {min(gaps) / 1e6 if gaps else float('nan'):.3f} s")  # fmt: skip
    assert starts[1] - starts[0] >= 0.9 * 2.0, "two starts closer than the interval: one per master"
    assert len(ledger) >= 2 and min(gaps) >= 0.9 * 2_000_000, "both on the new master, an interval apart"


def test_with_store_replicas_what_a_lagging_replica_lacks_was_never_authorized(sentinel_set: SentinelSet) -> None:
    """Fault 3 with siq_store_replicas = 1: while the replica is cut off, starts are not
    acknowledged and so not used; after the lagging replica is promoted, every start that
    was used is on it."""
    from siq_celery import StoreUnavailableError

    queue = replicated(sentinel_set.url, "1ms")
    slots(queue, 3, timeout=5)
    sentinel_set.cut_replica()
    used = 3
    for _ in range(4):  # on the master only: refused, each after the replica timeout
        try:
            with queue.slot(timeout=0.5):
                used += 1
        except (StoreUnavailableError, TimeoutError):
            pass
    sentinel_set.promote_lagging()
    sentinel_set.wait_promotion(timeout=20)
    after = replicated(sentinel_set.url, "1ms")
    deadline = time.monotonic() + 20
    while True:  # redis-py finds no master for a second or two after the promotion
        try:
            ledger = list(after.ledger())
            break
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    print(f"\n{used} starts used; the promoted replica's ledger holds {len(ledger)}")
    assert used == 3, "no start was used while no replica acknowledged it"
    assert len(ledger) == used, "every start used is on the promoted replica"
