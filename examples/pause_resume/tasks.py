"""A Celery app with one IntervalTask, ``send_report``, in the interval queue ``reports``
at 200 ms. Each start is recorded in Redis so ``run.py`` can show the timeline.
``EXAMPLE_BROKER`` (Redis URL) is the broker and siq_celery's state store."""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from siq_celery import IntervalTask

BROKER = os.environ.get("EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
STARTS = "example:pause_resume:starts"

app = Celery("pause_resume", broker=BROKER)
app.conf.update(
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    siq_paused_poll=0.5,  # tasks of a paused queue look again every 0.5 s (default 1 s)
)


@app.task(base=IntervalTask, interval="200ms", interval_queue="reports")
def send_report(n: int) -> int:
    redis.Redis.from_url(BROKER).rpush(STARTS, json.dumps({"n": n, "t": time.time()}))
    return n
