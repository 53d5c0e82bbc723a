"""The Celery app ``siq demo`` runs in its workers (configured by environment).

One IntervalTask, ``siq_demo.call_api``, standing in for a call to a rate-limited API:
it records when its body starts (host clock) and the store's authorized start and slot.
``SIQ_DEMO_BROKER`` (also the state store), ``SIQ_DEMO_QUEUE`` (the broker queue).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from siq_celery import IntervalTask

STARTS_KEY = "siq-demo:starts"
BROKER = os.environ.get("SIQ_DEMO_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("siq_demo", broker=BROKER, set_as_current=False)
app.conf.update(
    siq_url=BROKER,
    task_default_queue=os.environ.get("SIQ_DEMO_QUEUE", "siq-demo"),
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)
_recorders: dict[int, redis.Redis] = {}


@app.task(name="siq_demo.call_api", base=IntervalTask, interval="100ms", interval_queue="demo", bind=True, shared=False)  # type: ignore[untyped-decorator]
def call_api(self: Any, n: int) -> int:
    started = time.time()
    decision = self.request.siq_decision
    pid = os.getpid()
    if pid not in _recorders:  # one client per pool process
        _recorders[pid] = redis.Redis.from_url(BROKER)
    _recorders[pid].rpush(STARTS_KEY, json.dumps({
        "n": n, "t": started, "worker": f"{self.request.hostname}/{pid}", "ticket": decision.ticket,
        "start_us": decision.now_us, "slot_us": decision.slot_us,
    }))  # fmt: skip
    return n
