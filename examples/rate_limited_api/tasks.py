"""Two Celery tasks calling the same rate-limited API (``service.py``), one request each.

``call_with_siq`` is an IntervalTask: every start, on every worker, takes its turn in the
interval queue ``pretend-api`` at 100 ms. ``call_with_rate_limit`` uses Celery's own
``rate_limit="10/s"``: the same rate, but counted by each worker on its own.

Settings by environment: ``EXAMPLE_BROKER`` (Redis URL; also siq_celery's state store),
``EXAMPLE_API_URL`` (the service).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from celery import Celery

from siq_celery import IntervalTask

app = Celery("rate_limited_api", broker=os.environ.get("EXAMPLE_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_acks_late=True,  # a task whose worker dies runs again
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)
API_URL = os.environ.get("EXAMPLE_API_URL", "http://127.0.0.1:8080")


def call_api(caller: str, n: int) -> int:
    """One request to the API; its HTTP status (a 429 is counted by the service, not retried)."""
    try:
        with urllib.request.urlopen(f"{API_URL}/lookup?caller={caller}&n={n}", timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@app.task(base=IntervalTask, interval="100ms", interval_queue="pretend-api")
def call_with_siq(n: int) -> int:
    return call_api("siq_celery", n)


@app.task(rate_limit="10/s")
def call_with_rate_limit(n: int) -> int:
    return call_api("celery_rate_limit", n)
