"""A fair queue's claim with 10, 1,000 and 10,000 tenants waiting, and what they cost the store.

    python bench/fair_keys.py [--keys 10,1000,10000] [--claims 2000] [--store redis,sqlite,memory]

A fair queue hands its tickets out in the release (rules.fair_promote): the claim of a
fair task is the release that hands the head with the smallest tag its ticket, leases it
and returns it to be published. Each key holds two waiting tasks (a message of about 200
bytes each); each round starts the ticket handed out last (pinned clock, 100 ms apart,
so the lookahead of 4 has room for one more), times one release (round trip, from the
caller), then pushes a task back to the key served, so the number of waiting keys stays
N. Store memory: Redis ``used_memory`` before the keys are pushed and with them waiting
(per key, with its two tasks). Prints one markdown table row per store and N.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import redis

from siq_celery.backends import backend_from_url
from siq_celery.backends.base import Backend
from siq_celery.embedded import EmbeddedRedis
from siq_celery.parked import FairTask
from siq_celery.testing import PinnedClock

INTERVAL_US = 100_000
QUEUE = "bench-fair"
MESSAGE = (
    '{"task": "bench.call", "args": [%d], "kwargs": {}, "options": {"headers": {}, "queue": "celery", "retries": 0}}'
)


def fill(backend: Backend, keys: int) -> None:
    for k in range(keys):
        tasks = [FairTask(f"k{k}-{n}", MESSAGE % n) for n in range(2)]
        backend.fair_park(QUEUE, f"tenant-{k:05d}", 1, tasks, INTERVAL_US, "bench")


def claims(backend: Backend, clock: PinnedClock, count: int) -> list[float]:
    """Round trips (µs) of ``count`` releases, each handing out one ticket."""
    times: list[float] = []
    waiting: dict[int, str] = {}
    epoch, pushed = "", 0
    while len(times) < count:
        sent = time.perf_counter()
        release = backend.release(QUEUE, 10 * INTERVAL_US)
        times.append((time.perf_counter() - sent) * 1e6)
        epoch = release.epoch or epoch
        for parked, _ in release.tasks:
            waiting[parked.ticket] = parked.task_id
        backend.unpark(QUEUE, [p.task_id for p, _ in release.tasks])
        for parked, _ in release.tasks:  # the key served gets a task back: N keys keep waiting
            key = "tenant-" + parked.task_id.split("-")[0][1:].zfill(5)
            pushed += 1
            backend.fair_park(QUEUE, key, 1, [FairTask(f"again-{pushed}", MESSAGE % pushed)], INTERVAL_US, "bench")
        ticket = min(waiting)
        clock.advance(us=INTERVAL_US)
        decision = backend.start(QUEUE, ticket, epoch, task_id=waiting.pop(ticket), interval_us=INTERVAL_US,
                                 new_epoch="x")  # fmt: skip
        assert decision.authorized, decision
    return times[4:]  # the first releases hand out the whole lookahead


def used_memory(url: str) -> int:
    return int(redis.Redis.from_url(url).info("memory")["used_memory"])


def run(kind: str, url: str, keys: int, count: int) -> str:
    clock = PinnedClock()
    backend = backend_from_url(url, clock=clock)
    backend.delete(QUEUE)
    before = used_memory(url) if kind == "redis" else 0
    fill(backend, keys)
    per_key = (used_memory(url) - before) / keys if kind == "redis" else float("nan")
    times = claims(backend, clock, count)
    backend.delete(QUEUE)
    backend.close()
    p99 = statistics.quantiles(times, n=100)[98]
    memory = f"{per_key:,.0f}" if kind == "redis" else "-"
    return f"| {kind} | {keys:,} | {statistics.median(times):.0f} | {p99:.0f} | {memory} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="10,1000,10000")
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--store", default="redis,sqlite,memory")
    args = parser.parse_args()
    print("| store | waiting keys | claim µs (median) | claim µs (p99) | store bytes per waiting key (2 tasks) |")
    print("|---|---:|---:|---:|---:|", flush=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        urls = {"redis": server.url, "sqlite": f"sqlite:///{Path(tmp) / 'fair.db'}", "memory": "memory://bench-fair"}
        for kind in args.store.split(","):
            for keys in (int(k) for k in args.keys.split(",")):
                print(run(kind, urls[kind], keys, args.claims), flush=True)


if __name__ == "__main__":
    main()
