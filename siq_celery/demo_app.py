"""The Celery app ``siq demo`` runs in its workers (configured by environment).

One IntervalTask, ``siq_demo.call_api``, standing in for a call to a rate-limited API:
it records when its body starts (host clock) and the store's authorized start and slot.
``SIQ_DEMO_BROKER`` (also the state store), ``SIQ_DEMO_QUEUE`` (the broker queue),
``SIQ_DEMO_INTERVAL`` (the queue's interval when it is created; default 100ms).

``python -m siq_celery.demo_app N`` publishes N tasks (the producer of docker/compose.yaml).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from celery import Celery

from siq_celery import IntervalTask
from siq_celery.observe.readings import drain_seconds

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


@app.task(  # type: ignore[untyped-decorator]
    name="siq_demo.call_api",
    base=IntervalTask,
    interval=os.environ.get("SIQ_DEMO_INTERVAL", "100ms"),
    interval_queue="demo",
    bind=True,
    shared=False,
)
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


def main(argv: list[str] | None = None) -> int:
    """Publish N tasks (default 100) and say when the last one should start."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and not args[0].isdigit()):
        print("usage: python -m siq_celery.demo_app [N]", file=sys.stderr)
        return 2
    count = int(args[0]) if args else 100
    queue = call_api.siq_queue()
    for n in range(count):
        call_api.delay(n)
    status = queue.status()
    state, last_in = status.state, drain_seconds(status)
    print(f"published {count} tasks to interval queue {queue.name!r} ({state.interval_us / 1000:g} ms): "
          f"backlog {state.backlog}, the last starts in about {last_in:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
