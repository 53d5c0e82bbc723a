"""Helpers for testing code that uses siq_celery (and for siq_celery's own tests).

* :class:`PinnedClock` - a store clock that only moves when told to.
* :class:`EmbeddedRedisCluster` - three ``redis-server`` nodes in cluster mode on free
  loopback ports, slots spread evenly, built without ``redis-cli``.
"""

from __future__ import annotations

import time
from types import TracebackType

from .embedded import EmbeddedRedis, free_cluster_port
from .errors import ConfigurationError

CLUSTER_SLOTS = 16_384


class PinnedClock:
    """A clock in microseconds that moves only by :meth:`advance` (or by assignment)."""

    def __init__(self, now_us: int = 1_700_000_000_000_000) -> None:
        self.now_us = now_us

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float = 0.0, *, us: int = 0) -> int:
        self.now_us += round(seconds * 1_000_000) + us
        return self.now_us


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
