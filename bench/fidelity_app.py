"""The Celery app bench/fidelity.py runs in its workers (configured by environment).

Tasks that record when their body starts: ``fid.siq`` (an IntervalTask), ``fid.rate`` (a
plain task under Celery's own ``rate_limit``, ``SIQ_BENCH_RATE``, e.g. "50/s"),
``fid.fair`` (bench/fair_workers.py) and ``fid.window`` (50 ms and a window quota of
50 in 10 s: bench/window_workers.py). Each runs on its own broker queue. ``SIQ_BENCH_BROKER``, ``SIQ_BENCH_STORE``,
``SIQ_BENCH_RECORD``; ``SIQ_BENCH_MARGIN`` (``siq_default_margin``, e.g. "1ms").
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from siq_celery import IntervalTask

app = Celery("fidelity", broker=os.environ.get("SIQ_BENCH_BROKER", "redis://127.0.0.1:6379/15"))
app.conf.update(
    siq_url=os.environ.get("SIQ_BENCH_STORE"),
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    task_routes={
        "fid.siq": {"queue": "fid-siq"}, "fid.rate": {"queue": "fid-rate"}, "fid.fair": {"queue": "fid-fair"},
        "fid.window": {"queue": "fid-window"},
    },
    siq_default_margin=os.environ.get("SIQ_BENCH_MARGIN") or None,
)  # fmt: skip
_clients: dict[int, redis.Redis] = {}


def _record(key: str, row: dict[str, Any]) -> None:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(os.environ.get("SIQ_BENCH_RECORD", "redis://127.0.0.1:6379/14"))
    _clients[pid].rpush(key, json.dumps(row))


@app.task(name="fid.siq", base=IntervalTask, interval="20ms", interval_queue="fidelity", bind=True)
def siq_task(self: Any, n: int) -> None:
    t = time.time()
    d = self.request.siq_decision
    _record("fid:siq", {"n": n, "t": t, "start_us": d.now_us, "slot_us": d.slot_us, "ticket": d.ticket})


@app.task(name="fid.rate", bind=True, rate_limit=os.environ.get("SIQ_BENCH_RATE"))
def rate_task(self: Any, n: int) -> None:
    _record("fid:rate", {"n": n, "t": time.time()})


@app.task(name="fid.plain")
def plain_task(n: int) -> None:
    """Only published (into a queue nobody consumes), to measure publish cost."""


@app.task(name="fid.siq_publish", base=IntervalTask, interval="1ms", interval_queue="fidelity-publish")
def siq_publish_task(n: int) -> None:
    """Only published, to measure publish cost against fid.plain."""


@app.task(name="fid.fair", base=IntervalTask, interval="50ms", interval_queue="fair", bind=True,
          fair_key=lambda args, kwargs: args[0], fair_weight={"gold": 2})  # fmt: skip
def fair_task(self: Any, tenant: str, n: int) -> None:
    """bench/fair_workers.py: a tenant's call under a limit shared fairly."""
    t = time.time()
    d = self.request.siq_decision
    _record("fid:fair", {"tenant": tenant, "n": n, "t": t, "start_us": d.now_us, "slot_us": d.slot_us,
                         "ticket": d.ticket, "pid": os.getpid()})  # fmt: skip


@app.task(name="fid.window", base=IntervalTask, interval="50ms", quota="50/10s", interval_queue="window", bind=True)
def window_task(self: Any, n: int) -> None:
    """bench/window_workers.py: a call under spacing and a window quota."""
    t = time.time()
    d = self.request.siq_decision
    _record("fid:window", {"n": n, "t": t, "start_us": d.now_us, "slot_us": d.slot_us, "ticket": d.ticket})
