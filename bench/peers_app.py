"""The Celery app bench/peers.py runs in its workers (configured by environment).

``peers.siq`` is an IntervalTask at ``SIQ_BENCH_INTERVAL``; ``peers.burst`` the same with
``burst=SIQ_BENCH_BURST`` (default 4) on a queue of its own; ``peers.capped`` an
IntervalTask with ``concurrency=SIQ_BENCH_CAP`` (default 3) and no spacing; ``peers.rate`` a
plain task under Celery's own ``rate_limit`` (``SIQ_BENCH_RATE``, per worker node, as
Celery defines it; unset, no limit). Each records when its body starts, then sleeps the
body time it was given; ``peers.capped`` also counts the bodies running (``INCR`` as it
starts, ``DECR`` as it ends, on the record's Redis) and records its end.
``SIQ_BENCH_BROKER``, ``SIQ_BENCH_STORE``, ``SIQ_BENCH_RECORD``;
``SIQ_BENCH_BROKER_WAIT_BELOW`` sets ``siq_broker_wait_below`` (0 compares the ETA path),
``SIQ_BENCH_MAX_SLEEP`` ``siq_max_sleep``, ``SIQ_BENCH_PREFETCH`` ``worker_prefetch_multiplier`` (1).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from siq_celery import IntervalTask
from siq_celery.messages import deferrals

app = Celery("peers", broker=os.environ.get("SIQ_BENCH_BROKER", "redis://127.0.0.1:6379/15"))
app.conf.update(
    siq_url=os.environ.get("SIQ_BENCH_STORE"),
    siq_broker_wait_below=float(os.environ.get("SIQ_BENCH_BROKER_WAIT_BELOW", "0.02")),
    **({"siq_max_sleep": float(os.environ["SIQ_BENCH_MAX_SLEEP"])} if os.environ.get("SIQ_BENCH_MAX_SLEEP") else {}),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=int(os.environ.get("SIQ_BENCH_PREFETCH", "1")),
    broker_connection_retry_on_startup=True,
    task_routes={
        "peers.siq": {"queue": "peers-siq"}, "peers.burst": {"queue": "peers-burst"},
        "peers.capped": {"queue": "peers-capped"}, "peers.rate": {"queue": "peers-rate"},
    },
)  # fmt: skip
_clients: dict[int, redis.Redis] = {}
_arrived: dict[str, float] = {}  #: task id -> when its pool process took it (task_prerun)


@signals.task_prerun.connect
def _note_arrival(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _arrived[task_id] = time.time()


RECORD_KEY = "peers:starts"
IN_FLIGHT_KEY = "peers:in-flight"  #: bodies of peers.capped running now, as they count themselves


def _client() -> redis.Redis:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = redis.Redis.from_url(os.environ.get("SIQ_BENCH_RECORD", "redis://127.0.0.1:6379/14"))
    return _clients[pid]


def _record(row: dict[str, Any]) -> None:
    _client().rpush(RECORD_KEY, json.dumps(row))


def _spaced_body(task: Any, n: int, body_ms: float) -> None:
    t = time.time()
    d = task.request.siq_decision
    arrived = _arrived.pop(task.request.id, t)
    _record({"n": n, "t": t, "store_us": d.now_us, "slot_us": d.slot_us, "ticket": d.ticket, "pid": os.getpid(),
             "arrived": arrived})  # fmt: skip
    if body_ms:
        time.sleep(body_ms / 1000)


@app.task(name="peers.siq", base=IntervalTask, bind=True, interval=os.environ.get("SIQ_BENCH_INTERVAL", "10ms"),
          interval_queue="peers")  # fmt: skip
def siq_task(self: Any, n: int, body_ms: float) -> None:
    _spaced_body(self, n, body_ms)


@app.task(name="peers.burst", base=IntervalTask, bind=True, interval=os.environ.get("SIQ_BENCH_INTERVAL", "10ms"),
          burst=int(os.environ.get("SIQ_BENCH_BURST", "4")), interval_queue="peers-burst")  # fmt: skip
def burst_task(self: Any, n: int, body_ms: float) -> None:
    _spaced_body(self, n, body_ms)


@app.task(name="peers.capped", base=IntervalTask, bind=True, concurrency=int(os.environ.get("SIQ_BENCH_CAP", "3")),
          interval_queue="peers-capped")  # fmt: skip
def capped_task(self: Any, n: int, body_ms: float) -> None:
    t = time.time()
    client = _client()
    in_flight = client.incr(IN_FLIGHT_KEY)  # this body included
    time.sleep(body_ms / 1000)
    client.decr(IN_FLIGHT_KEY)
    _record({"n": n, "t": t, "end": time.time(), "in_flight": in_flight, "store_us": self.request.siq_decision.now_us,
             "pid": os.getpid(), "deferrals": deferrals(self.request.headers)})  # fmt: skip


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


#: Spacing of 2,000 starts per 10 s, a quota of 1,000: the quota sets the slot of every
#: ticket past the first 1,000, and 6,000 tickets reach 60 s ahead, well within half of
#: siq_horizon (beyond it a publish claims before building the message; beyond the horizon
#: it parks), so this measures the one publish path with the window's estimates in it.
@app.task(name="peers.quota_publish", base=IntervalTask, interval="5ms", quota="1000/10s",
          interval_queue="peers-publish-quota")  # fmt: skip
def quota_publish_task(n: int) -> None:
    """Only published, to measure publish cost with an interval and a window quota."""
