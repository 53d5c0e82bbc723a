"""Per-key queues, a weighted task, two limits on one task, and a back-off on 429.
Broker and state store: $EXAMPLE_BROKER (run.py starts a private Redis)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import redis
from celery import Celery, current_task

from siq_celery import IntervalTask

app = Celery("fleet_limits", broker=os.environ.get("EXAMPLE_BROKER", "redis://localhost:6379/0"))
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=4)
STARTS = "fleet-limits:starts"
_records: dict[int, Any] = {}


def record(task: str, **fields: Any) -> None:
    """When a body started (``t``: this host's clock) and when the store authorized its
    start (``authorized_us``: the store's clock, where the limits hold), for run.py."""
    authorized_us = current_task.request.siq_decision.now_us
    client = _records.setdefault(os.getpid(), redis.Redis.from_url(app.conf.broker_url))
    client.rpush(STARTS, json.dumps({"task": task, "t": time.time(), "authorized_us": authorized_us, **fields}))


# One queue per shop: each shop's own 200 ms, whatever the others do.
@app.task(base=IntervalTask, interval="200ms", interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}")
def sync_orders(shop: str) -> None:
    record("sync_orders", shop=shop)


# A search costs 3 slots of the "points" queue: the next start waits 3 x 50 ms.
@app.task(base=IntervalTask, interval="50ms", interval_queue="points", cost=lambda args, kwargs: kwargs["points"])
def search(n: int, points: int) -> None:
    record("search", n=n, points=points)


# Two limits at once: 100 ms apart, and never more than 5 in any 2 s.
@app.task(base=IntervalTask, interval_queue={"{geo}per-second": "100ms", "{geo}per-2s": "5/2s"}, bind=True)
def geocode(self: Any, n: int) -> None:
    record("geocode", n=n)


# A 429 holds the queue for every worker as long as the response says, then this call runs again first.
@app.task(base=IntervalTask, interval="100ms", interval_queue="api", bind=True, max_retries=0)
def call_api(self: Any, n: int, url: str) -> None:
    try:
        urllib.request.urlopen(f"{url}?n={n}", timeout=5).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            self.siq_backoff(exc)  # its Retry-After (or RateLimit-Reset) header
        raise
    record("call_api", n=n)


# Fair shares of one limit among tenants: a tenant's backlog never starves another. The
# slots of "reports" go to the tenants with work waiting, gold twice as often as others.
@app.task(base=IntervalTask, interval="50ms", interval_queue="reports",
          fair_key=lambda args, kwargs: kwargs["tenant"], fair_weight={"gold": 2})  # fmt: skip
def build_report(n: int, tenant: str) -> None:
    record("build_report", n=n, tenant=tenant)
