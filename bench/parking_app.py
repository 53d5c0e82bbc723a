"""The Celery app bench/parking.py runs in its workers (configured by environment)."""

from __future__ import annotations

import os

from celery import Celery

from siq_celery import IntervalTask

BROKER = os.environ.get("SIQ_BENCH_BROKER", "redis://127.0.0.1:6379/0")
app = Celery("siq_bench_parking", broker=BROKER, set_as_current=False)
app.conf.update(
    siq_url=BROKER,
    siq_horizon=float(os.environ.get("SIQ_BENCH_HORIZON", "20")),
    siq_ledger_max=200_000,
    siq_paused_poll=float(os.environ.get("SIQ_BENCH_PAUSED_POLL", "1.0")),
    task_default_queue="siq-bench-parking",
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)


@app.task(name="bench.parked", base=IntervalTask, interval=os.environ.get("SIQ_BENCH_INTERVAL", "2ms"),
          interval_queue="bench-parking", shared=False)  # type: ignore[untyped-decorator]  # fmt: skip
def parked(n: int) -> int:
    return n


@app.task(name="bench.plain", shared=False)  # type: ignore[untyped-decorator]
def plain(n: int) -> int:
    return n
