"""The Celery app bench/peers.py runs in its workers (configured by environment).

``peers.siq`` is an IntervalTask at ``SIQ_BENCH_INTERVAL``; ``peers.rate`` a plain task
under Celery's own ``rate_limit`` (``SIQ_BENCH_RATE``, per worker node, as Celery
defines it; unset, no limit). Both record when their body starts, then sleep the body time they were
given. ``SIQ_BENCH_BROKER``, ``SIQ_BENCH_STORE``, ``SIQ_BENCH_RECORD``;
``SIQ_BENCH_BROKER_WAIT_BELOW`` sets ``siq_broker_wait_below`` (0 compares the ETA path).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from siq_celery import IntervalTask

app = Celery("peers", broker=os.environ.get("SIQ_BENCH_BROKER", "redis://127.0.0.1:6379/15"))
app.conf.update(
    siq_url=os.environ.get("SIQ_BENCH_STORE"),
    siq_broker_wait_below=float(os.environ.get("SIQ_BENCH_BROKER_WAIT_BELOW", "0.02")),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_routes={"peers.siq": {"queue": "peers-siq"}, "peers.rate": {"queue": "peers-rate"}},
)
_clients: dict[int, redis.Redis] = {}
_arrived: dict[str, float] = {}  #: task id -> when its pool process took it (task_prerun)


@signals.task_prerun.connect
def _note_arrival(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _arrived[task_id] = time.time()


def _record(row: dict[str, Any]) -> None:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(os.environ.get("SIQ_BENCH_RECORD", "redis://127.0.0.1:6379/14"))
    _clients[pid].rpush("peers:starts", json.dumps(row))


@app.task(name="peers.siq", base=IntervalTask, bind=True, interval=os.environ.get("SIQ_BENCH_INTERVAL", "10ms"),
          interval_queue="peers")  # fmt: skip
def siq_task(self: Any, n: int, body_ms: float) -> None:
    t = time.time()
    d = self.request.siq_decision
    arrived = _arrived.pop(self.request.id, t)
    _record({"n": n, "t": t, "store_us": d.now_us, "slot_us": d.slot_us, "ticket": d.ticket, "pid": os.getpid(),
             "arrived": arrived})  # fmt: skip
    if body_ms:
        time.sleep(body_ms / 1000)


@app.task(name="peers.rate", rate_limit=os.environ.get("SIQ_BENCH_RATE") or None)
def rate_task(n: int, body_ms: float) -> None:
    _record({"n": n, "t": time.time(), "pid": os.getpid()})
    if body_ms:
        time.sleep(body_ms / 1000)


@app.task(name="peers.plain")
def plain_task(n: int) -> None:
    """Only published (into a queue nobody consumes), to measure publish cost."""


@app.task(name="peers.siq_publish", base=IntervalTask, interval="1ms", interval_queue="peers-publish")
def siq_publish_task(n: int) -> None:
    """Only published, to measure publish cost against peers.plain."""
