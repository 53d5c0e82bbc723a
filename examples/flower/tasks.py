"""A Celery app with one IntervalTask, ``geocode``, in the interval queue ``geocoder`` at
200 ms. ``EXAMPLE_BROKER`` (Redis URL) is the broker, the result backend and
siq_celery's state store."""

from __future__ import annotations

import os

from celery import Celery

from siq_celery import IntervalTask

BROKER = os.environ.get("EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("flower_example", broker=BROKER, backend=BROKER)
app.conf.update(
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    worker_send_task_events=True,  # what Flower shows comes from task events (same as -E)
    siq_paused_poll=0.5,
)


@app.task(base=IntervalTask, interval="200ms", interval_queue="geocoder")
def geocode(address: str) -> str:
    return f"{address}: 52.52, 13.40"
