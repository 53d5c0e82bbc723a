"""The failover harness: a state store behind Redis Sentinel (a master, one replica and
three sentinels, all from one ``redis-server`` binary), or on Redis Cluster (three masters
with one replica each), and the faults of issue 27 on it.

:class:`SentinelSet` starts and stops the five processes (by pid, each in a temp dir)
and injects the faults: the master killed, the master stopped and resumed (a partition
and its return), a lagging replica promoted. :class:`ClusterSet` does the same for six
cluster nodes, with one fault: the master of a queue's hash slot killed. Every wait is
bounded. The broker and the
records the task bodies write (tests/apps/geo.py) live on servers of their own
(:class:`tests.faults.conftest.ControlledRedis`), never on the set that fails over.
:func:`failover_env` builds the environment of the test app on those three.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import pytest
import redis

from siq_celery import IntervalQueue
from siq_celery.embedded import free_cluster_port, free_port, redis_server_binary, wait_for_own_server
from tests.faults.conftest import ControlledRedis
from tests.integration.conftest import ROOT, CeleryRun

SERVICE = "mymaster"
#: Sentinel settings of the issue's setup: a master is down after 1 s without a reply.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
QUORUM = 2


class HarnessError(RuntimeError):
    """A process of the harness did not come up, or a wait ran out of time."""


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> float:
    """Poll ``predicate`` until it is true; the seconds it took. HarnessError after ``timeout`` s."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if predicate():
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


@dataclass
class Server:
    """One ``redis-server`` process of the set (a data server or a sentinel)."""

    name: str
    port: int
    dir: Path
    process: subprocess.Popen[bytes] | None = None
    #: One client per socket timeout, closed with the process (a client per call leaves its
    #: socket to the garbage collector, which warns at random).
    clients: dict[float, redis.Redis] = field(default_factory=dict, repr=False)

    @property
    def conf(self) -> Path:
        return self.dir / f"{self.name}.conf"

    @property
    def logfile(self) -> Path:
        return self.dir / f"{self.name}.log"

    def client(self, timeout: float = 1.0) -> redis.Redis:
        if timeout not in self.clients:
            self.clients[timeout] = redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)
        return self.clients[timeout]

    def close_clients(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()

    def start(self, *extra: str) -> Server:
        with open(self.logfile, "ab") as log:
            self.process = subprocess.Popen([redis_server_binary(), str(self.conf), *extra],
                                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        if wait_for_own_server(self.process, self.port, 10):
            return self
        if self.exited():
            raise HarnessError(f"{self.name} exited at start:\n{self.log()[-2000:]}")
        raise HarnessError(f"timed out after 10s waiting for {self.name} on {self.port}")

    def exited(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def signal(self, sig: int) -> None:
        if not self.exited():
            assert self.process is not None
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if not self.exited():
            assert self.process is not None
            self.signal(signal.SIGCONT)  # a stopped process dies of SIGKILL too, but let it go cleanly
            self.process.kill()
            self.process.wait(10)
        self.close_clients()

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""


class ServerSet:
    """The lifecycle both sets share: ``servers`` (every process of the set) are killed by
    pid on :meth:`stop`, their logs read together, and ``with`` starts and stops the set
    (a start that fails stops what it started)."""

    tmp: tempfile.TemporaryDirectory[str]

    @property
    def servers(self) -> list[Server]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """The store URL a user would write for the set."""
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        """Kill every process of the set by its pid (resumed first if stopped), remove the temp dir."""
        for server in self.servers:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                server.kill()
        self.tmp.cleanup()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log()[-3000:]}" for s in self.servers)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelSet(ServerSet):
    """A master, ``replicas`` replicas (1) and three sentinels (``mymaster``, quorum 2,
    ``down-after-milliseconds`` 1000, ``failover-timeout`` 5000) on free loopback ports.

    ``with SentinelSet() as s: s.url`` is the store URL a user would write,
    ``redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/mymaster/0``.
    """

    def __init__(
        self, *, replicas: int = 1, down_after_ms: int = DOWN_AFTER_MS, failover_timeout_ms: int = FAILOVER_TIMEOUT_MS
    ) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="siq-sentinel-")
        base = Path(self.tmp.name)
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.data = [Server(f"redis-{chr(ord('a') + i)}", free_port(), base) for i in range(1 + replicas)]
        self.sentinels = [Server(f"sentinel-{i}", free_port(), base) for i in range(3)]
        #: The data server each fault was injected on (the master of the moment).
        self.old_master: Server | None = None
        self.fault_at = 0.0  #: time.time() of the last fault
        self._cut: tuple[Server, list[Server]] | None = None  #: (master, replicas) of cut_replica

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout: float = 30.0) -> SentinelSet:
        master, *replicas = self.data
        for server in self.data:
            lines = [f"port {server.port}", "bind 127.0.0.1", "protected-mode no", 'save ""', "appendonly no",
                     f"dir {server.dir}", "repl-diskless-sync no"]  # fmt: skip
            if server is not master:
                lines.append(f"replicaof 127.0.0.1 {master.port}")
            server.conf.write_text("\n".join(lines) + "\n")
            server.start()
        wait_until(lambda: all(self._link_up(r) for r in replicas), timeout, "the replicas' first sync")
        for sentinel in self.sentinels:
            sentinel.conf.write_text("\n".join([
                f"port {sentinel.port}", "bind 127.0.0.1", "protected-mode no", f"dir {sentinel.dir}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} {QUORUM}",
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {SERVICE} 1",
            ]) + "\n")  # fmt: skip
            sentinel.start("--sentinel")
        # Every sentinel knows the replica and the two others (through the master's hello channel).
        try:
            wait_until(lambda: all(map(self._sees_all, self.sentinels)), timeout, "the sentinels to see each other")
        except HarnessError as e:
            raise HarnessError(f"{e}; they see {self._views()}\n{self.logs()}") from None
        return self

    def _counts(self, sentinel: Server) -> tuple[int, int]:
        """(replicas, other sentinels) that ``sentinel`` knows of."""
        master: dict[str, Any] = sentinel.client().sentinel_master(SERVICE)  # type: ignore[assignment]
        return int(master["num-slaves"]), int(master["num-other-sentinels"])

    def _views(self) -> list[str]:
        """What each sentinel knows of the set, for the message of a start that timed out."""
        views = []
        for sentinel in self.sentinels:
            try:
                replicas, others = self._counts(sentinel)
                views.append(f"{sentinel.name}: {replicas} replicas, {others} other sentinels")
            except (redis.RedisError, OSError) as err:
                views.append(f"{sentinel.name}: {err}")
        return views

    def _link_up(self, replica: Server) -> bool:
        info = replica.client().info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def _sees_all(self, sentinel: Server) -> bool:
        replicas, others = self._counts(sentinel)
        return replicas >= len(self.data) - 1 and others >= len(self.sentinels) - 1

    def master_addresses(self) -> list[int | None]:
        """The master's port as each sentinel reports it now (None: no answer)."""
        ports: list[int | None] = []
        for sentinel in self.sentinels:
            try:
                reply = sentinel.client(0.5).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                ports.append(int(reply[1]) if reply else None)
            except (redis.RedisError, OSError):
                ports.append(None)
        return ports

    def master_port(self) -> int:
        """The master's port, as the first sentinel that answers sees it."""
        for port in self.master_addresses():
            if port is not None:
                return port
        raise HarnessError("no sentinel answers")

    def master(self) -> Server:
        port = self.master_port()
        return next(s for s in self.data if s.port == port)

    def replica(self) -> Server:
        return self.replicas()[0]

    def replicas(self) -> list[Server]:
        port = self.master_port()
        return [s for s in self.data if s.port != port]

    # The faults. Each remembers the server it hit (``old_master``) and the moment
    # (``fault_at``, time.time()); wait_promotion() times the failover from there.

    def kill_master(self) -> float:
        """Fault 1: SIGKILL the master. Its unreplicated writes are gone."""
        self.old_master = self.master()
        self.fault_at = time.time()
        self.old_master.kill()
        return self.fault_at

    def stop_master(self) -> float:
        """Fault 2, first half: SIGSTOP the master (it hangs, as behind a cut network)."""
        self.old_master = self.master()
        self.fault_at = time.time()
        self.old_master.signal(signal.SIGSTOP)
        return self.fault_at

    def cont_master(self) -> None:
        """Fault 2, second half: SIGCONT the old master. It comes back a writable master,
        with the clients still connected to it, until Sentinel turns it into a replica."""
        assert self.old_master is not None
        self.old_master.signal(signal.SIGCONT)

    def lag_replica(self, lag: float = 3.0) -> float:
        """Fault 3: a lagging replica promoted. :meth:`cut_replica`, let the master take
        writes for ``lag`` seconds, then :meth:`promote_lagging`: Sentinel promotes a
        replica that missed the master's last ``lag`` s of writes (every replica misses
        them). The moment of the kill."""
        self.cut_replica()
        time.sleep(lag)
        return self.promote_lagging()

    def cut_replica(self) -> None:
        """Freeze the replicas (SIGSTOP) and cut their links (``CLIENT KILL TYPE replica``
        on the master): from now on they get none of the master's writes. (What the master
        had sent before the cut is still delivered when they resume.) Keep the lag short: a
        replica whose link was down longer than 10 x down-after is never promoted."""
        self._cut = (self.master(), self.replicas())
        for replica in self._cut[1]:
            replica.signal(signal.SIGSTOP)
        self._cut[0].client().execute_command("CLIENT", "KILL", "TYPE", "replica")

    def promote_lagging(self) -> float:
        """SIGKILL the master and SIGCONT the cut replicas; the moment of the kill."""
        assert self._cut is not None, "cut_replica() first"
        master, replicas = self._cut
        self.old_master = master
        self.fault_at = time.time()
        master.kill()
        for replica in replicas:
            replica.signal(signal.SIGCONT)
        return self.fault_at

    def wait_promotion(self, timeout: float = 30.0) -> float:
        """Seconds from the last fault until a sentinel reports a new master address
        (``SENTINEL get-master-addr-by-name``), polled every 20 ms."""
        assert self.old_master is not None, "no fault injected"
        old = self.old_master.port
        wait_until(lambda: any(p not in (None, old) for p in self.master_addresses()), timeout,
                   "a sentinel to report a new master", every=0.02)  # fmt: skip
        return time.time() - self.fault_at

    def wait_demoted(self, timeout: float = 30.0) -> float:
        """After :meth:`cont_master`: seconds until the old master reports itself a replica."""
        assert self.old_master is not None
        old = self.old_master
        return wait_until(lambda: old.client(0.5).info("replication")["role"] == "slave", timeout,
                          "the old master to become a replica", every=0.05)  # fmt: skip

    def restore(self, timeout: float = 30.0) -> None:
        """Bring a killed old master back as a replica of the new one (a set that can fail over again)."""
        if self.old_master is not None and self.old_master.exited():
            self.old_master.start()
            wait_until(lambda: self.old_master is not None and self._link_up(self.old_master), timeout,
                       "the old master to rejoin as a replica")  # fmt: skip

    @property
    def servers(self) -> list[Server]:
        return [*self.data, *self.sentinels]


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    with SentinelSet() as s:
        yield s


#: Redis Cluster settings of the issue's setup: a master is failed after 1 s without a reply.
CLUSTER_NODE_TIMEOUT_MS = 1000
CLUSTER_SLOTS = 16_384


class ClusterSet(ServerSet):
    """A Redis Cluster of three masters, each with one replica (the ``--cluster-replicas 1``
    arrangement, built with CLUSTER ADDSLOTS / MEET / REPLICATE from the one
    ``redis-server`` binary, no ``redis-cli``), ``cluster-node-timeout`` 1000, on free
    loopback ports (each with its bus port, + 10000, free too).

    ``with ClusterSet() as c: c.url`` is the store URL a user would write,
    ``redis+cluster://127.0.0.1:P1,...`` (every node, masters and replicas). The fault:
    :meth:`kill_slot_master` SIGKILLs the master serving a queue's hash slot; its replica
    is promoted by the cluster itself (the replicas' election), timed by :meth:`wait_promotion`.
    """

    def __init__(self, *, node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="siq-cluster-")
        base = Path(self.tmp.name)
        self.node_timeout_ms = node_timeout_ms
        self.masters = [Server(f"master-{i}", free_cluster_port(), base) for i in range(3)]
        self.replicas = [Server(f"replica-{i}", free_cluster_port(), base) for i in range(3)]
        self.ids: dict[int, str] = {}  #: port -> cluster node id
        self.old_master: Server | None = None  #: the master :meth:`kill_slot_master` killed
        self.slot = -1  #: the hash slot of that fault
        self.fault_at = 0.0  #: time.time() of the last fault

    @property
    def nodes(self) -> list[Server]:
        return [*self.masters, *self.replicas]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self, timeout: float = 30.0) -> ClusterSet:
        for server in self.nodes:
            server.conf.write_text("\n".join([
                f"port {server.port}", "bind 127.0.0.1", "protected-mode no", 'save ""', "appendonly no",
                f"dir {server.dir}", "repl-diskless-sync no", "cluster-enabled yes",
                f"cluster-config-file {server.name}-nodes.conf", f"cluster-node-timeout {self.node_timeout_ms}",
            ]) + "\n")  # fmt: skip
            server.start()
            self.ids[server.port] = server.client().execute_command("CLUSTER", "MYID").decode()
        per = CLUSTER_SLOTS // len(self.masters)
        for i, master in enumerate(self.masters):
            end = CLUSTER_SLOTS if i == len(self.masters) - 1 else (i + 1) * per
            master.client().execute_command("CLUSTER", "ADDSLOTS", *range(i * per, end))
        first = self.nodes[0].client()
        for server in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
        wait_until(lambda: all(self._knows_all(s) for s in self.nodes), timeout, "the nodes to meet")
        for master, replica in zip(self.masters, self.replicas, strict=True):
            replica.client().execute_command("CLUSTER", "REPLICATE", self.ids[master.port])
        wait_until(lambda: all(self._link_up(r) for r in self.replicas), timeout, "the replicas' first sync")
        wait_until(lambda: all(self._ok(s) for s in self.nodes), timeout, "cluster_state:ok on every node")
        return self

    def _knows_all(self, server: Server) -> bool:
        info = server.client().execute_command("CLUSTER INFO")
        return int(info["cluster_known_nodes"]) == len(self.nodes)

    def _ok(self, server: Server) -> bool:
        return bool(server.client().execute_command("CLUSTER INFO")["cluster_state"] == "ok")

    @staticmethod
    def _link_up(replica: Server) -> bool:
        info = replica.client().info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def keyslot(self, queue: str) -> int:
        """The hash slot of ``queue``'s keys (siq_celery.keys: every key carries ``{queue}``)."""
        from siq_celery.keys import DEFAULT_KEY_PREFIX, QueueKeys

        key = QueueKeys(DEFAULT_KEY_PREFIX, queue).state
        for server in self.nodes:
            if not server.exited():
                with contextlib.suppress(redis.RedisError, OSError):
                    return int(server.client().execute_command("CLUSTER", "KEYSLOT", key))
        raise HarnessError("no cluster node answers")

    def slot_owners(self, slot: int) -> list[int | None]:
        """The port of the master serving ``slot`` as each live node's CLUSTER SLOTS names it
        (None: no answer, or the slot uncovered)."""
        ports: list[int | None] = []
        for server in self.nodes:
            if server.exited():
                continue
            try:
                ranges = server.client(0.5).execute_command("CLUSTER", "SLOTS")
            except (redis.RedisError, OSError):
                ports.append(None)
                continue
            ports.append(next((int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1])), None))
        return ports

    def slot_master(self, queue: str = "geo") -> Server:
        """The master serving ``queue``'s slot now (as the first live node that answers says)."""
        port = next((p for p in self.slot_owners(self.keyslot(queue)) if p is not None), None)
        if port is None:
            raise HarnessError(f"no node names a master for the slot of {queue!r}")
        return next(s for s in self.nodes if s.port == port)

    def replica_of(self, master: Server) -> Server:
        """The node replicating ``master`` (CLUSTER REPLICAS)."""
        lines = master.client().execute_command("CLUSTER", "REPLICAS", self.ids[master.port])
        ports = {int(str(line if isinstance(line, str) else line.decode()).split()[1].split(":")[1].split("@")[0])
                 for line in lines}  # fmt: skip
        return next(s for s in self.nodes if s.port in ports)

    def kill_slot_master(self, queue: str = "geo") -> float:
        """The fault: SIGKILL the master serving ``queue``'s slot; the moment (time.time())."""
        self.slot = self.keyslot(queue)
        self.old_master = self.slot_master(queue)
        self.fault_at = time.time()
        self.old_master.kill()
        return self.fault_at

    def wait_promotion(self, timeout: float = 30.0) -> float:
        """Seconds from the kill until the slot's new master is in charge: every live node's
        CLUSTER SLOTS names a master other than the killed one for the slot, and that node
        reports role master. Polled every 20 ms."""
        assert self.old_master is not None, "no fault injected"
        old = self.old_master.port

        def promoted() -> bool:
            owners = self.slot_owners(self.slot)
            new = owners[0] if owners else None
            if new in (None, old) or any(p != new for p in owners):
                return False
            server = next(s for s in self.nodes if s.port == new)
            return bool(server.client(0.5).info("replication")["role"] == "master")

        wait_until(promoted, timeout, "the cluster to promote the slot's replica", every=0.02)
        return time.time() - self.fault_at

    def restore(self, timeout: float = 30.0) -> None:
        """Bring a killed master back (it rejoins as a replica of the promoted one)."""
        if self.old_master is not None and self.old_master.exited():
            self.old_master.start()
            wait_until(lambda: self.old_master is not None and self._link_up(self.old_master), timeout,
                       "the old master to rejoin as a replica")  # fmt: skip

    @property
    def servers(self) -> list[Server]:
        return self.nodes


@pytest.fixture
def failover_run(
    store_set: ServerSet, broker: ControlledRedis, records: ControlledRedis, tmp_path: Path
) -> Iterator[CeleryRun]:
    """Workers of tests/apps/geo.py at 50 ms on the store the test module's ``store_set``
    fixture gives (a SentinelSet or a ClusterSet)."""
    run = CeleryRun(failover_env(store_set.url, broker, records, "50ms"), tmp_path / "logs")
    yield run
    run.close()


@pytest.fixture
def cluster_set() -> Iterator[ClusterSet]:
    with ClusterSet() as c:
        yield c


def slots(queue: IntervalQueue, count: int, timeout: float) -> float:
    """Take ``count`` slots of ``queue`` one after another; the seconds it took."""
    started = time.monotonic()
    for _ in range(count):
        with queue.slot(timeout=timeout):
            pass
    return time.monotonic() - started


#: The app's Redis broker visibility timeout (issue 27): an unacknowledged message (held by
#: ETA, prefetched, or running) comes back after 8 s.
VISIBILITY_TIMEOUT_S = 8


def failover_env(store_url: str, broker: ControlledRedis, records: ControlledRedis, interval: str) -> dict[str, str]:
    """The environment of tests/apps/geo.py for a run on ``store_url`` (the sentinel or cluster URL)."""
    return {
        "SIQ_TEST_QUEUE": f"siq-failover-{uuid.uuid4().hex[:12]}",
        "SIQ_TEST_BROKER": broker.url(1),
        "SIQ_TEST_STORE": store_url,
        "SIQ_TEST_RECORD": records.url(0),
        "SIQ_TEST_INTERVAL": interval,
        "SIQ_TEST_TRANSPORT": json.dumps(
            {"visibility_timeout": VISIBILITY_TIMEOUT_S, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        ),
        "SIQ_TEST_HORIZON": str(VISIBILITY_TIMEOUT_S - 2),  # nothing waits by ETA as long as the visibility timeout
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


@dataclass
class Figures:
    """What one failover run measured, from the bodies' records (host clock) and the set."""

    tasks: int
    completed: int  #: distinct tasks that finished
    ran_twice: list[int]  #: tasks whose body started more than once (by task id)
    smallest_gap_ms: float
    below_cap: int  #: gaps between consecutive body starts below 0.9 x the interval
    stall_s: float  #: the largest gap between consecutive body starts from the fault on
    promotion_s: float
    close_pairs: list[tuple[dict[str, Any], dict[str, Any]]]  #: the starts of each gap below the cap

    def line(self) -> str:
        return (f"completed {self.completed}/{self.tasks}, ran twice {len(self.ran_twice)}, smallest gap "
                f"{self.smallest_gap_ms:.1f} ms, gaps < 0.9 I {self.below_cap}, stall {self.stall_s:.2f} s, "
                f"promotion {self.promotion_s:.2f} s")  # fmt: skip


def measure(
    starts: list[dict[str, Any]],
    finishes: list[dict[str, Any]],
    tasks: int,
    interval_ms: float,
    fault_at: float,
    promotion_s: float,
) -> Figures:
    """The figures of a run from the records (geo.record's starts and finishes)."""
    by_id = Counter(s["task_id"] for s in starts)
    twice = sorted({s["n"] for s in starts if by_id[s["task_id"]] > 1})
    ordered = sorted(starts, key=lambda s: s["t"])
    pairs = list(itertools.pairwise(ordered))
    gaps = [(b["t"] - a["t"]) * 1000 for a, b in pairs]
    cap = 0.9 * interval_ms
    around = [(b["t"] - a["t"]) for a, b in pairs if b["t"] >= fault_at]
    return Figures(
        tasks=tasks,
        completed=len({f["n"] for f in finishes}),
        ran_twice=twice,
        smallest_gap_ms=min(gaps) if gaps else float("nan"),
        below_cap=sum(g < cap for g in gaps),
        stall_s=max(around, default=0.0),
        promotion_s=promotion_s,
        close_pairs=[(a, b) for (a, b), g in zip(pairs, gaps, strict=True) if g < cap],
    )
