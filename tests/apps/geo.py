"""The Celery app the integration tests run in real workers.

Configured by environment, so the test process (publisher) and the worker subprocesses
build the same app: ``SIQ_TEST_BROKER``, ``SIQ_TEST_STORE`` (siq_url),
``SIQ_TEST_RECORD`` (Redis URL where bodies record their starts), ``SIQ_TEST_INTERVAL``,
``SIQ_TEST_TRANSPORT`` (JSON broker transport options), ``SIQ_TEST_QUEUE`` (the broker queue),
``SIQ_TEST_HORIZON`` and ``SIQ_TEST_RELEASE_EVERY`` (parking).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from siq_celery import IntervalTask

STARTS = "siq-test:starts"
FINISHES = "siq-test:finishes"


def make_app(env: Mapping[str, str]) -> Celery:
    app = Celery("geo", broker=env.get("SIQ_TEST_BROKER", "redis://127.0.0.1:6379/15"), set_as_current=False)
    app.conf.update(
        siq_url=env.get("SIQ_TEST_STORE"),
        siq_paused_poll=float(env.get("SIQ_TEST_PAUSED_POLL", "0.5")),
        siq_horizon=float(env.get("SIQ_TEST_HORIZON", "600")),
        siq_release_every=float(env.get("SIQ_TEST_RELEASE_EVERY", "1.0")),
        broker_transport_options=json.loads(env.get("SIQ_TEST_TRANSPORT", "{}")),
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=int(env.get("SIQ_TEST_PREFETCH", "4")),
        result_backend=env.get("SIQ_TEST_RESULTS") or None,
        task_default_queue=env.get("SIQ_TEST_QUEUE", "celery"),
    )
    interval = env.get("SIQ_TEST_INTERVAL", "20ms")
    record_url = env.get("SIQ_TEST_RECORD", "redis://127.0.0.1:6379/14")
    clients: dict[int, redis.Redis] = {}

    def recorder() -> redis.Redis:
        pid = os.getpid()  # one client per process: prefork children must not share a socket
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(record_url)
        return clients[pid]

    def note(task: Any, n: int, t: float) -> None:
        headers = task.request.headers or {}
        decision = getattr(task.request, "siq_decision", None)
        recorder().rpush(STARTS, json.dumps({
            "n": n, "t": t, "task_id": task.request.id, "ticket": decision.ticket if decision else None,
            "header_ticket": headers.get("siq_ticket"), "store_start_us": decision.now_us if decision else None,
            "slot_us": decision.slot_us if decision else None, "pid": os.getpid(),
            "node": task.request.hostname, "host": socket.gethostname(), "retries": task.request.retries,
        }))  # fmt: skip

    @app.task(shared=False, name="geo.record", base=IntervalTask, interval=interval, interval_queue="geo", bind=True)
    def record(self: Any, n: int, work: float = 0.0) -> int:
        t = time.time()
        note(self, n, t)
        if work:
            time.sleep(work)
        recorder().rpush(FINISHES, json.dumps({"n": n, "t": time.time(), "node": self.request.hostname}))
        return n

    @app.task(
        shared=False,
        name="geo.no_retries",
        base=IntervalTask,
        interval=interval,
        interval_queue="geo",
        bind=True,
        max_retries=0,
    )
    def no_retries(self: Any, n: int) -> int:
        note(self, n, time.time())
        return n

    @app.task(
        shared=False, name="geo.retry_once", base=IntervalTask, interval=interval, interval_queue="geo", bind=True
    )
    def retry_once(self: Any, n: int) -> int:
        note(self, n, time.time())
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return n

    return app


app = make_app(os.environ)
