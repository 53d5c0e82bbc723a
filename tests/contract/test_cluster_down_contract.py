"""Redis Cluster answers CLUSTERDOWN while a slot has no master (every node, to every key,
once it marks the cluster failed: between a master's death and its replica's promotion,
queues on the surviving masters stop too). The command did not run: to siq_celery that is
the store unreachable (StoreUnavailableError: waiters retry, a publish goes out without a
ticket, a finish is kept and tried again), never a raw redis-py error that fails the task.
"""

from __future__ import annotations

import time

import pytest
import redis

from siq_celery import IntervalQueue, StoreUnavailableError
from siq_celery.keys import QueueKeys
from siq_celery.testing import EmbeddedRedisCluster

pytestmark = pytest.mark.cluster


def wait_state(*nodes: redis.Redis, state: str = "fail", timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while {n.execute_command("CLUSTER INFO")["cluster_state"] for n in nodes} != {state}:
        assert time.monotonic() < deadline, f"the nodes did not reach cluster_state:{state}"
        time.sleep(0.05)


def test_clusterdown_is_the_store_unavailable_and_the_queue_goes_on_after_it(
    redis_cluster: EmbeddedRedisCluster,
) -> None:
    queue = IntervalQueue("down", url=redis_cluster.url, interval="1ms")
    queue.ensure()
    assert queue.claim().number == 1
    # Take another slot away from the queue's master: it sees a slot without a master, fails
    # the cluster (full coverage is required by default) and answers CLUSTERDOWN to every key.
    admin = [redis.Redis(port=n.port) for n in redis_cluster.nodes]
    ours = admin[0].execute_command("CLUSTER", "KEYSLOT", QueueKeys("siq", "down").state)
    owner = next(c for c in admin if ours in owned(c))
    other = next(s for s in sorted(owned(owner)) if s != ours)
    owner.execute_command("CLUSTER", "DELSLOTS", other)
    try:
        wait_state(owner, state="fail")
        with pytest.raises(StoreUnavailableError, match=r"cluster is down|not served"):
            queue.claim()
        with pytest.raises(StoreUnavailableError):
            queue.status()
    finally:
        owner.execute_command("CLUSTER", "ADDSLOTS", other)
    wait_state(*admin, state="ok")
    assert queue.claim().number == 2, "the refused claim took no ticket, and claims go on"


def owned(client: redis.Redis) -> set[int]:
    """The slots ``client``'s node serves, as it sees itself."""
    me = client.execute_command("CLUSTER", "MYID")
    me = me.decode() if isinstance(me, bytes) else me
    ranges = client.execute_command("CLUSTER", "SLOTS")
    return {s for r in ranges if (r[2][2].decode() if isinstance(r[2][2], bytes) else r[2][2]) == me
            for s in range(int(r[0]), int(r[1]) + 1)}  # fmt: skip
