"""Backlog benchmark: worker memory with 100,000 waiting tasks, bulk publishing, and how
late a parked task starts after its slot.

    make bench            # or: python bench/parking.py [--tasks 100000] [--interval 2ms]

Two real worker nodes (-c 2) on a private redis-server; siq_horizon 20 s, so at 2 ms all
but the first 10,000 tasks of a backlog are parked. Each run is checked against the
ledger: every task started exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from siq_celery import IntervalQueue
from siq_celery.embedded import EmbeddedRedis
from siq_celery.workers import WorkerProcess

HERE = Path(__file__).resolve().parent


def peak_rss(workers: list[WorkerProcess], stop: threading.Event, peaks: dict[int, int]) -> None:
    """Poll the RSS of every worker process (main and pool children) until ``stop``."""
    while not stop.is_set():
        for w in workers:
            if w.process is None:
                continue
            try:
                tree = [psutil.Process(w.process.pid), *psutil.Process(w.process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
        stop.wait(0.2)


def run(broker: str, tasks: int, interval: str, logs: str) -> dict[str, float]:
    env = {"SIQ_BENCH_BROKER": broker, "SIQ_BENCH_INTERVAL": interval,
           "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    from parking_app import parked

    queue: IntervalQueue = parked.siq_queue()
    queue.delete()
    queue.ensure(reset=True)
    workers = [
        WorkerProcess("parking_app", f"bench{i}@siq", Path(logs) / f"bench{i}-{tasks}.log", concurrency=2,
                      env=env, cwd=HERE)
        for i in range(2)
    ]  # fmt: skip
    peaks: dict[int, int] = {}
    stop = threading.Event()
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready()
        watcher = threading.Thread(target=peak_rss, args=(workers, stop, peaks), daemon=True)
        watcher.start()
        started = time.monotonic()
        parked.apply_many([(n,) for n in range(tasks)], chunk_size=500)
        publish_s = time.monotonic() - started
        parked_count = queue.status().parked
        deadline = time.monotonic() + 120 + tasks * 0.01
        while True:
            status = queue.status()
            if status.finished >= tasks:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out: {status.finished} of {tasks} finished, {status.parked} parked")
            time.sleep(1)
    finally:
        stop.set()
        for w in workers:
            w.stop(timeout=30)
    if os.environ.get("SIQ_BENCH_DEBUG"):
        for pid, rss in sorted(peaks.items(), key=lambda kv: -kv[1]):
            main = any(w.process and w.process.pid == pid for w in workers)
            print(f"  pid {pid} {'main ' if main else 'child'} peak {rss / 2**20:.1f} MB", flush=True)
    rows = list(queue.ledger())
    ids = [r.task_id for r in rows]
    assert len(rows) == tasks and len(set(ids)) == tasks, f"{len(rows)} starts, {len(set(ids))} distinct"
    horizon_tickets = int(20 / (parked.siq_queue().status().state.interval_us / 1e6))
    late = sorted((r.start_us - r.slot_us) / 1000 for r in rows if r.ticket > horizon_tickets)
    return {
        "tasks": tasks, "parked": parked_count, "publish_s": publish_s,
        "peak_main_mb": max(peaks[w.process.pid] for w in workers if w.process) / 2**20,  # type: ignore[index]
        "peak_any_mb": max(peaks.values()) / 2**20,
        "late_p50": statistics.median(late) if late else float("nan"),
        "late_p99": late[int(len(late) * 0.99) - 1] if late else float("nan"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--interval", default="2ms")
    args = parser.parse_args()
    print(f"# siq_celery backlog benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}\n")
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        results = [run(server.url, n, args.interval, logs) for n in (1_000, args.tasks)]
        from parking_app import app, plain

        n = 20_000
        started = time.monotonic()
        for i in range(n):
            plain.apply_async((i,))
        plain_rate = n / (time.monotonic() - started)
        app.connection_for_write().default_channel.queue_purge("siq-bench-parking")
    print(f"## 2 worker nodes x -c 2, interval {args.interval}, siq_horizon 20 s\n")
    print("| backlog | parked at publish | apply_many publish | tasks/s | peak RSS, worker main "
          "| peak RSS, any process | parked start - slot p50 / p99 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        late = f"{r['late_p50']:.2f} / {r['late_p99']:.2f} ms"
        print(f"| {r['tasks']:,} | {r['parked']:,} | {r['publish_s']:.1f} s | {r['tasks'] / r['publish_s']:,.0f} "
              f"| {r['peak_main_mb']:.1f} MB | {r['peak_any_mb']:.1f} MB | {late} |")  # fmt: skip
    print(f"\nplain `Task.apply_async` in a loop, same broker: {plain_rate:,.0f} tasks/s")
    print("every task started exactly once (ledger: as many starts as tasks, all task ids distinct)")


if __name__ == "__main__":
    main()
