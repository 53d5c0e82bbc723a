"""The state store fails over on Redis Cluster (issue 27, item 2): three masters with one
replica each, the master of the queue's hash slot SIGKILLed; the cluster promotes its
replica by itself (``cluster-node-timeout`` 1000 ms).

Cheap checks only; bench/failover.py --store cluster runs the issue's full acceptance runs.
"""

from __future__ import annotations

import time

import pytest

from siq_celery import IntervalQueue
from tests.failover.conftest import ClusterSet, measure, slots
from tests.faults.conftest import publish
from tests.integration.conftest import CeleryRun
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.faults]

INTERVAL_MS = 50.0


def test_the_cluster_promotes_the_slots_replica_and_a_queue_on_the_cluster_url_goes_on(
    cluster_set: ClusterSet,
) -> None:
    queue = IntervalQueue("geo", url=cluster_set.url, interval="10ms")
    slots(queue, 5, timeout=5)
    old = cluster_set.slot_master("geo")
    replica = cluster_set.replica_of(old)
    cluster_set.kill_slot_master("geo")
    promotion = cluster_set.wait_promotion(timeout=20)
    took = slots(queue, 5, timeout=20)
    state = queue.status().state
    print(f"\npromoted in {promotion:.2f} s; 5 slots after it in {took:.2f} s; ticket {state.ticket}")
    assert cluster_set.slot_master("geo") is replica, "the killed master's own replica serves the slot"
    assert promotion < 6.0, "node timeout 1 s, then the replica's election: a few seconds"
    assert took < 2.0, "the client finds the promoted master at once"
    assert state.ticket == 10, "the replica had every claim (no writes were lost), and claims go on"


def test_after_a_failed_command_the_next_one_asks_where_the_slot_is_now(cluster_set: ClusterSet) -> None:
    """redis-py refreshes its slot map right after a command fails, which, just after the
    kill, still names the dead master: a client that failed then must look again before its
    next command, or the first one after the promotion fails too (a second in the waiters'
    backoff: the stall was ~1 s longer than behind Sentinel, whose client asks anew on
    every connection)."""
    from siq_celery import StoreUnavailableError
    from siq_celery.backends import backend_from_url

    backend = backend_from_url(cluster_set.url)
    state, _ = backend.ensure("geo", 10_000, "e1")
    backend.claim("geo", 1, 10_000, state.epoch)
    cluster_set.kill_slot_master("geo")
    with pytest.raises(StoreUnavailableError):
        backend.claim("geo", 1, 10_000, state.epoch)  # refused: never sent, so no ticket taken
    cluster_set.wait_promotion(timeout=20)
    assert backend.claim("geo", 1, 10_000, state.epoch).first == 2, "the first claim after the promotion goes through"


@pytest.fixture
def store_set(cluster_set: ClusterSet) -> ClusterSet:
    return cluster_set


@HOST_CLOCK_RERUNS
def test_slot_master_killed_under_real_workers_loses_nothing_runs_nothing_twice_keeps_the_interval(
    failover_run: CeleryRun, cluster_set: ClusterSet
) -> None:
    failover_run.start_workers(3, 2)
    publish(failover_run, range(60))
    failover_run.wait_for(lambda s: len(s) >= 20, 30, "20 starts")
    at = cluster_set.kill_slot_master("geo")
    promotion = cluster_set.wait_promotion(timeout=20)
    failover_run.wait_for_count(60, timeout=60)
    time.sleep(2.0)  # a second copy, if any, shows
    figures = measure(failover_run.starts(), failover_run.finishes(), 60, INTERVAL_MS, at, promotion)
    print(f"\n{figures.line()}")
    assert figures.completed == 60 and figures.ran_twice == [], "every task ran, once"
    host_gaps_at_least([figures.smallest_gap_ms], 0.9 * INTERVAL_MS)
