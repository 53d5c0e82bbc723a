"""Real ``celery worker`` processes on a private Redis (broker db 1, siq store db 2,
start records db 3), or RabbitMQ as the broker when ``SIQ_TEST_AMQP_URL`` is set."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from siq_celery.embedded import EmbeddedRedis
from siq_celery.ledger import LedgerRow
from siq_celery.workers import WorkerProcess
from tests.apps.geo import FINISHES, PRERUNS, STARTS, make_app

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CeleryRun:
    env: dict[str, str]
    logdir: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    _app: Celery | None = None

    @property
    def app(self) -> Celery:
        """The publisher: the same app the workers run, built in this process."""
        if self._app is None:
            self._app = make_app(self.env)
        return self._app

    @property
    def records(self) -> redis.Redis:
        return redis.Redis.from_url(self.env["SIQ_TEST_RECORD"])

    def start_worker(
        self, name: str, concurrency: int = 2, pool: str = "prefork", *extra: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        worker = WorkerProcess(
            "tests.apps.geo", f"{name}@siq-test", self.logdir / f"{name}.log",
            concurrency=concurrency, pool=pool, env={**self.env, **(env or {})}, extra_args=extra, cwd=ROOT,
        )  # fmt: skip
        self.workers.append(worker.start())
        return worker

    def start_workers(
        self, nodes: int, concurrency: int = 2, pool: str = "prefork", *extra: str
    ) -> list[WorkerProcess]:
        started = [self.start_worker(f"node{i}", concurrency, pool, *extra) for i in range(nodes)]
        for w in started:
            w.wait_ready()
        return started

    def close(self) -> None:
        """Stop the workers and close the publisher: every node asked for a warm shutdown at
        once, then those still up after 5 s in all are killed (a node waiting out a task's
        wait in the gate would take that long; the test is over, its store is flushed)."""
        for w in self.workers:
            w.request_stop()
        deadline = time.monotonic() + 5.0
        for w in self.workers:
            w.stop(timeout=max(deadline - time.monotonic(), 0.1))
        if self._app is not None:
            self._app.close()

    def starts(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(STARTS, 0, -1)]

    def finishes(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(FINISHES, 0, -1)]

    def preruns(self) -> list[dict[str, Any]]:
        """Tasks that entered their trace (with ``SIQ_TEST_TRACE_PRERUN``): waiting or running."""
        return [json.loads(raw) for raw in self.records.lrange(PRERUNS, 0, -1)]

    def held_by_workers(self) -> tuple[int, float]:
        """Tasks the workers hold by ETA, and their main processes' RSS in MB."""
        import psutil

        scheduled = self.app.control.inspect(timeout=3.0).scheduled() or {}
        rss = sum(psutil.Process(w.process.pid).memory_info().rss for w in self.workers if w.process)
        return sum(len(tasks) for tasks in scheduled.values()), rss / 2**20

    def siq(self, *args: str) -> str:
        """Run ``celery -A tests.apps.geo siq ARGS`` as an operator would; its output."""
        # nice: the CLI spends about a second of CPU starting up; on a 2-core machine that
        # must not be taken from the workers whose spacing the test measures.
        result = subprocess.run(
            ["nice", "-n", "19", sys.executable, "-m", "celery", "-A", "tests.apps.geo", "siq", *args],
            env={**os.environ, **self.env}, cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def wait_for(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            starts = self.starts()
            if predicate(starts):
                return starts
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {w.name}\n{w.log()[-2000:]}" for w in self.workers)
                raise AssertionError(f"timed out waiting for {what}: {len(starts)} starts\n{logs}")
            time.sleep(0.1)

    def wait_for_count(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        return self.wait_for(lambda s: len({r["n"] for r in s}) >= count, timeout, f"{count} distinct tasks")


@pytest.fixture
def celery_run(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[CeleryRun]:
    base = f"redis://127.0.0.1:{redis_server.port}"
    for db in (1, 2, 3):
        redis.Redis.from_url(f"{base}/{db}").flushdb()
    env = {
        "SIQ_TEST_QUEUE": f"siq-test-{uuid.uuid4().hex[:12]}",  # never assume a shared broker is empty
        "SIQ_TEST_BROKER": f"{base}/1",
        "SIQ_TEST_STORE": f"{base}/2",
        "SIQ_TEST_RECORD": f"{base}/3",
        "SIQ_TEST_INTERVAL": "20ms",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = CeleryRun(env, tmp_path / "logs")
    yield run
    run.close()


def used_starts(ledger: Iterable[LedgerRow]) -> list[LedgerRow]:
    """The ledger's starts whose bodies ran: a start given back (finished ``LATE``: its
    process stood still after the body's report while a later start came, so the body did
    not begin and its task waited again) is an authorization the store recorded, not a run."""
    return [r for r in ledger if r.outcome != "LATE"]


def gaps_ms(starts: list[dict[str, Any]]) -> list[float]:
    times = sorted(r["t"] for r in starts)
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def inversions(starts: list[dict[str, Any]]) -> int:
    """Starts whose ticket is lower than an earlier start's (by store start time)."""
    ordered = sorted(starts, key=lambda r: r["store_start_us"])
    highest, count = 0, 0
    for r in ordered:
        count += r["ticket"] < highest
        highest = max(highest, r["ticket"])
    return count


def overtaken_on_time(starts: list[dict[str, Any]], preruns: list[dict[str, Any]]) -> list[str]:
    """Inversions the design does not allow: a ticket overtaken although its task was at
    the gate (had entered its trace, ``SIQ_TEST_TRACE_PRERUN``) before the overtaking
    start was authorized. A head that reaches its worker after the next ticket's slot is
    overtaken by design (docs/design.md, "The guarantees"); one described here was not late.
    Host clock: the trace times are the bodies' (:func:`tests.apps.geo.real_time`)."""
    entered: dict[str, list[float]] = {}
    for p in preruns:
        entered.setdefault(p["task_id"], []).append(p["t"])
    ordered = sorted(starts, key=lambda r: r["store_start_us"])
    found = []
    for i, r in enumerate(ordered):
        # the trace that led to this start: the last one before it
        at_gate = max((t for t in entered.get(r["task_id"], []) if t <= r["t"]), default=r["t"])
        for earlier in ordered[:i]:
            if earlier["ticket"] > r["ticket"] and earlier["store_start_us"] / 1e6 > at_gate:
                found.append(
                    f"ticket {r['ticket']} at the gate {(earlier['store_start_us'] / 1e6 - at_gate) * 1000:.2f} ms "
                    f"before ticket {earlier['ticket']} started ahead of it"
                )
                break
    return found


@contextmanager
def busy_queue(url: str, name: str, callers: int) -> Iterator[None]:
    """``callers`` threads, each taking ``name``'s slots one after another with
    ``IntervalQueue.slot()``: the queue runs at its limit, with ``callers - 1`` waiting."""
    from siq_celery.backends import backend_from_url
    from siq_celery.client.queue import IntervalQueue

    stop = threading.Event()

    def starts() -> None:
        queue = IntervalQueue(name, backend=backend_from_url(url))
        while not stop.is_set():
            with queue.slot():
                pass

    threads = [threading.Thread(target=starts, daemon=True) for _ in range(callers)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(15)
