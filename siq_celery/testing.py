"""Helpers for testing code that uses siq_celery (and for siq_celery's own tests).

* :class:`PinnedClock` - a store clock that only moves when told to (or when something
  waits on it).
* :class:`EmbeddedRedisCluster` - three ``redis-server`` nodes in cluster mode on free
  loopback ports, slots spread evenly, built without ``redis-cli``.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from .embedded import EmbeddedRedis, free_cluster_port
from .errors import ConfigurationError

CLUSTER_SLOTS = 16_384


class PinnedClock:
    """A clock in microseconds that moves only by :meth:`advance` (or by assignment).

    Given as a store's clock and as an :class:`~siq_celery.IntervalQueue`'s local time
    (``sleep=clock.sleep, monotonic=clock.monotonic``), a wait for a slot passes at once:
    the clock moves by it, and the store's answers take no time."""

    def __init__(self, now_us: int = 1_700_000_000_000_000) -> None:
        self.now_us = now_us
        self._lock = threading.Lock()  # a worker's threads move it too

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float = 0.0, *, us: int = 0) -> int:
        with self._lock:
            self.now_us += round(seconds * 1_000_000) + us
            return self.now_us

    def advance_to(self, now_us: int) -> int:
        """Move to ``now_us`` (microseconds) unless the clock is there already; never back."""
        with self._lock:
            self.now_us = max(self.now_us, now_us)
            return self.now_us

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on this clock, at once: to ``seconds`` after now, so that
        two threads waiting 10 s and 20 s from one moment leave it 20 s on, not 30."""
        if seconds > 0:
            self.advance_to(self.now_us + round(seconds * 1_000_000))

    def monotonic(self) -> float:
        """This clock in seconds (``time.monotonic``'s stand-in)."""
        return self.now_us / 1e6


class EmbeddedRedisCluster:
    """``with EmbeddedRedisCluster() as c: c.url`` - a 3-node Redis Cluster."""

    def __init__(self, nodes: int = 3) -> None:
        self.nodes = [
            EmbeddedRedis(
                port=free_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
            )
            for _ in range(nodes)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 20.0) -> EmbeddedRedisCluster:
        import redis

        for node in self.nodes:
            node.start()
        clients = [redis.Redis(port=n.port) for n in self.nodes]
        per_node = CLUSTER_SLOTS // len(clients)
        for i, client in enumerate(clients):
            end = CLUSTER_SLOTS if i == len(clients) - 1 else (i + 1) * per_node
            client.execute_command("CLUSTER ADDSLOTS", *range(i * per_node, end))
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [c.execute_command("CLUSTER INFO") for c in clients]
            if all(
                i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(clients) for i in infos
            ):
                for c in clients:
                    c.close()
                return self
            time.sleep(0.1)
        self.stop()
        raise ConfigurationError("the embedded Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()
