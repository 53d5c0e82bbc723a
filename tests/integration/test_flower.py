"""Interval tasks as an operator sees them in a real Flower (``celery -A app flower``).

One worker with ``-E`` at 200 ms, Flower on a free port with its HTTP API open. A monitor
thread polls Flower's task list the way its dashboard does and keeps every state it saw.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import redis

from siq_celery.embedded import free_port
from siq_celery.workers import FlowerProcess
from tests.integration.conftest import ROOT, CeleryRun
from tests.timing import HOST_CLOCK_RERUNS, host_gaps_at_least

pytestmark = [pytest.mark.processes, pytest.mark.slow, HOST_CLOCK_RERUNS]

INTERVAL_S = 0.2
MARGIN_S = 0.02  # siq_countdown_margin: the ETA brings a task this much before its slot


def http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


class FlowerWatch:
    """Every state Flower showed for each task, in the order it showed them."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, defaultdict[str, list[str]](list)
        self.last: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for task_id, task in http("GET", f"{self.url}/api/tasks?limit=1000").items():
                states = self.seen[task_id]
                if not states or states[-1] != task["state"]:
                    states.append(task["state"])
                self.last[task_id] = task
            time.sleep(0.05)

    def __enter__(self) -> FlowerWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait_succeeded(self, task_ids: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(self.last.get(t, {}).get("state") != "SUCCESS" for t in task_ids):
            assert time.monotonic() < deadline, {t: self.seen.get(t) for t in task_ids}
            time.sleep(0.1)


@pytest.fixture
def flower(celery_run: CeleryRun) -> Iterator[FlowerProcess]:
    base = celery_run.env["SIQ_TEST_BROKER"].rsplit("/", 1)[0]
    redis.Redis.from_url(f"{base}/4").flushdb()
    celery_run.env.update(SIQ_TEST_INTERVAL="200ms", SIQ_TEST_RESULTS=f"{base}/4")
    process = FlowerProcess(
        "tests.apps.geo", free_port(), celery_run.logdir / "flower.log",
        env={**celery_run.env, "FLOWER_UNAUTHENTICATED_API": "true"}, cwd=ROOT,
    )  # fmt: skip
    process.start().wait_ready()
    yield process
    process.stop(timeout=10)


def test_flower_shows_interval_tasks_received_at_their_slot_started_succeeded(
    celery_run: CeleryRun, flower: FlowerProcess
) -> None:
    # Flower is subscribed before the worker sends anything, so it misses no event.
    celery_run.start_workers(1, 2, "prefork", "-E")
    record = celery_run.app.tasks["geo.record"]
    queue = record.siq_queue()
    queue.ensure(INTERVAL_S, reset=True)
    with FlowerWatch(flower.url) as watch:
        # Through the producer API, and through Flower's HTTP API (Flower publishes them,
        # as any HTTP client of the fleet would), with and without a countdown.
        direct = [record.apply_async((n,)).id for n in range(6)]
        over_http = [
            http("POST", f"{flower.url}/api/task/async-apply/geo.record", {"args": [10 + n], "timeout": 0})["task-id"]
            for n in range(3)
        ]
        delayed = http(
            "POST", f"{flower.url}/api/task/async-apply/geo.record", {"args": [20], "countdown": 1, "timeout": 0}
        )["task-id"]
        every = [*direct, *over_http, delayed]
        watch.wait_succeeded(every, timeout=60)

        # A paused queue defers its tasks: Flower shows DEFERRED, never FAILURE.
        queue.pause()
        paused = [record.apply_async((30 + n,)).id for n in range(3)]
        deadline = time.monotonic() + 20
        while any("DEFERRED" not in watch.seen.get(t, []) for t in paused):
            assert time.monotonic() < deadline, {t: watch.seen.get(t) for t in paused}
            time.sleep(0.1)
        assert celery_run.starts() and all(r["n"] < 30 for r in celery_run.starts())
        queue.resume(grace=0.5)
        watch.wait_succeeded(paused, timeout=60)

    starts = {r["task_id"]: r for r in celery_run.starts()}
    assert sorted(starts) == sorted([*every, *paused])  # each ran once
    for task_id in every + paused:
        assert "FAILURE" not in watch.seen[task_id]
        assert watch.seen[task_id][-1] == "SUCCESS"
        info = http("GET", f"{flower.url}/api/task/info/{task_id}")
        assert info["state"] == "SUCCESS" and info["received"] and info["started"] and info["succeeded"]
        assert starts[task_id]["header_ticket"] is not None, task_id  # the producer (or Flower) claimed it
    for task_id in paused:
        assert watch.seen[task_id][-2:] == ["DEFERRED", "SUCCESS"], watch.seen[task_id]

    # The ETA Flower shows is the task's slot (less the margin that brings it just before),
    # as estimated at publish: a late first start (the first task of a fresh worker, whose
    # pool may still be starting) shifts the slots of the tickets claimed before it by its
    # lateness, so those come that much earlier (never later); and each start counts from
    # its body's report, which moves the slots after it by the body's delay after its
    # authorization.
    first = starts[direct[0]]
    shift = (first["store_start_us"] - first["slot_us"]) / 1e6
    by_start = sorted(starts.values(), key=lambda r: r["store_start_us"])
    delays = list(itertools.accumulate(max(r["t"] - r["store_start_us"] / 1e6, 0.0) + 0.001 for r in by_start))
    moved = {r["task_id"]: delays[i - 1] if i else 0.0 for i, r in enumerate(by_start)}
    checked = 0
    for task_id in [*direct[1:], *over_http]:
        eta = http("GET", f"{flower.url}/api/task/info/{task_id}")["eta"]
        if eta is None:  # a task whose slot was already near at publish gets no ETA
            continue
        slot = starts[task_id]["slot_us"] / 1e6
        early = slot - (datetime.fromisoformat(eta).timestamp() + MARGIN_S)
        assert -0.01 < early < shift + moved[task_id] + 0.01, (task_id, eta, slot, shift, moved[task_id])
        checked += 1
    assert checked >= 4

    # The interval held for every task, however it was submitted.
    ordered = sorted(starts.values(), key=lambda r: r["store_start_us"])
    store_gaps = [(b["store_start_us"] - a["store_start_us"]) / 1e3 for a, b in itertools.pairwise(ordered)]
    assert min(store_gaps) >= INTERVAL_S * 1000
    body_gaps = [(b["t"] - a["t"]) * 1e3 for a, b in itertools.pairwise(sorted(starts.values(), key=lambda r: r["t"]))]
    host_gaps_at_least(body_gaps, 0.9 * INTERVAL_S * 1000)
    print(f"\nflower: {len(starts)} tasks, states of a paused one {watch.seen[paused[0]]}, "
          f"{checked} ETAs within 10 ms of slot - margin, smallest gap {min(store_gaps):.2f} ms (store), "
          f"{min(body_gaps):.2f} ms (bodies)")  # fmt: skip
