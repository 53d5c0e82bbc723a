"""Fidelity benchmark: siq_celery's IntervalTask against Celery's own rate_limit.

    make bench          # runs this after bench/core.py
    python bench/fidelity.py [--intervals 50,20,10,5,2] [--seconds 3]

The same 4 worker processes (2 nodes x -c 2, prefork, on a private Redis) run, at each
interval, a burst of IntervalTasks and then the same burst of plain tasks under
``rate_limit`` set to the same rate (Celery's limit is per node, which is the point).
Prints one Markdown table, plus the publish cost per task against a plain apply_async.
Violations are gaps below 0.9 x interval between task bodies (host clock), and for
siq_celery also between the store's authorized starts (store clock: the guarantee).
``SIQ_BENCH_DEBUG=1`` prints, for each body-gap violation, how late each body ran after
its authorization.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from siq_celery import IntervalQueue  # noqa: E402
from siq_celery.embedded import EmbeddedRedis  # noqa: E402
from siq_celery.workers import WorkerProcess  # noqa: E402


def bench_env(port: int) -> dict[str, str]:
    """bench/fidelity_app.py's environment on a Redis at ``port`` (broker, store and the
    bodies' records in databases 1, 2 and 3), set in this process too (the app reads it
    at import) and given to the workers."""
    base = f"redis://127.0.0.1:{port}"
    env = {
        "SIQ_BENCH_BROKER": f"{base}/1", "SIQ_BENCH_STORE": f"{base}/2", "SIQ_BENCH_RECORD": f"{base}/3",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "SIQ_BENCH_MARGIN": os.environ.get("SIQ_BENCH_MARGIN", ""),  # siq_default_margin, e.g. "1ms"
    }  # fmt: skip
    os.environ.update(env)
    return env


@contextmanager
def three_nodes(name: str, queue: str, logs: Path, env: dict[str, str]) -> Iterator[list[WorkerProcess]]:
    """3 nodes x ``-c 2`` (prefork) of bench/fidelity_app.py consuming ``queue``, started and
    ready for the block; stopped after it, and the broker's database emptied
    (bench/fair_workers.py, bench/window_workers.py)."""
    workers = [
        WorkerProcess("bench.fidelity_app", f"{name}{i}@bench", logs / f"{name}{i}.log", concurrency=2, env=env,
                      cwd=ROOT, extra_args=["-Q", queue]).start()
        for i in range(3)
    ]  # fmt: skip
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            w.stop(10)
        redis.Redis.from_url(env["SIQ_BENCH_BROKER"]).flushdb()


def collect(client: redis.Redis, key: str, count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while client.llen(key) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return [json.loads(r) for r in client.lrange(key, 0, -1)]


def measure(rows: list[dict[str, Any]], interval_s: float, slots: list[float] | None) -> dict[str, float]:
    times = sorted(r["t"] for r in rows)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0]
    # rate_limit has no slots: its lateness is measured against the ideal grid
    grid = [max(t - (times[0] + k * interval_s), 0.0) for k, t in enumerate(times)]
    lateness = sorted(grid if slots is None else slots)
    return {
        "starts": len(rows),
        "rate_pct": 100 * (len(rows) - 1) * interval_s / span if span else 0.0,
        "min_gap_ms": min(gaps) * 1000,
        "p50_ms": statistics.median(lateness) * 1000,
        "p99_ms": lateness[int(len(lateness) * 0.99) - 1] * 1000,
        "violations": sum(g < 0.9 * interval_s for g in gaps),
    }


SETTLE_S = 2.0


def run_row(app: Any, record: redis.Redis, ms: float, name: str, key: str, count: int) -> str:
    """Publish ``count`` tasks of one kind at once, wait for their starts, format a row."""
    interval_s = ms / 1000
    record.delete(key)
    task = app.tasks["fid.siq" if key == "fid:siq" else "fid.rate"]
    for n in range(count):
        task.delay(n)
    rows = collect(record, key, count, timeout=30 + 2 * count * interval_s)
    slots = [(r["start_us"] - r["slot_us"]) / 1e6 for r in rows] if key == "fid:siq" else None
    m = measure(rows, interval_s, slots)
    store_violations = "n/a"  # rate_limit has no store clock
    if key == "fid:siq":
        starts = sorted(r["start_us"] for r in rows)
        store_violations = str(sum(b - a < 0.9 * interval_s * 1e6 for a, b in itertools.pairwise(starts)))
    if os.environ.get("SIQ_BENCH_DEBUG") and key == "fid:siq":  # what made a body gap short
        ordered = sorted(rows, key=lambda r: r["t"])
        for a, b in itertools.pairwise(ordered):
            if b["t"] - a["t"] < 0.9 * interval_s:
                print(
                    "violation: post-auth delays (ms)",
                    round(a["t"] * 1e3 - a["start_us"] / 1e3, 3),
                    round(b["t"] * 1e3 - b["start_us"] / 1e3, 3),
                    "store gap",
                    (b["start_us"] - a["start_us"]) / 1e3,
                )
    return (
        f"| {ms:g} ms | {name} | {m['starts']:.0f} | {m['rate_pct']:.1f}% | {m['min_gap_ms']:.2f} ms"
        f" | {m['p50_ms']:.2f} / {m['p99_ms']:.2f} ms | {m['violations']:.0f} | {store_violations} |"
    )


def publish_cost(app: Any, rounds: int = 15, per_round: int = 300) -> tuple[float, float]:
    """Median µs per publish of a plain task and of an IntervalTask, rounds interleaved."""
    plain, siq = app.tasks["fid.plain"], app.tasks["fid.siq_publish"]
    sink = "fidelity-publish-sink"  # no worker consumes it
    results: dict[str, list[float]] = {"plain": [], "siq": []}
    for task in (plain, siq):  # warm connections and scripts
        for n in range(50):
            task.apply_async((n,), queue=sink)
    for _ in range(rounds):
        for name, task in (("plain", plain), ("siq", siq)):
            t = time.perf_counter()
            for n in range(per_round):
                task.apply_async((n,), queue=sink)
            results[name].append((time.perf_counter() - t) / per_round * 1e6)
    return statistics.median(results["plain"]), statistics.median(results["siq"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", default="50,20,10,5,2", help="milliseconds, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="schedule length per run")
    args = parser.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    print(f"# IntervalTask vs Celery rate_limit, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"4 worker processes (2 nodes x -c 2, prefork), Redis broker\n", flush=True)  # fmt: skip
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        env = bench_env(server.port)
        from bench.fidelity_app import app

        record = redis.Redis.from_url(env["SIQ_BENCH_RECORD"])
        broker = redis.Redis.from_url(env["SIQ_BENCH_BROKER"])

        def start_workers(queue: str, extra_env: dict[str, str]) -> list[WorkerProcess]:
            started = [
                WorkerProcess("bench.fidelity_app", f"{queue}{i}@bench", Path(tmp) / f"{queue}{i}.log",
                              concurrency=2, env={**env, **extra_env}, cwd=ROOT, extra_args=["-Q", queue]).start()
                for i in range(2)
            ]  # fmt: skip
            for w in started:
                w.wait_ready()
            time.sleep(SETTLE_S)  # pool children finish starting before the clock runs
            return started

        siq_workers = start_workers("fid-siq", {})
        try:
            header = (
                "| interval | limiter | starts | achieved rate | smallest gap | p50 / p99 lateness | violations "
                "| violations, store clock |"
            )
            print(header + "\n" + "|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
            for ms in intervals:
                interval_s = ms / 1000
                count = max(50, int(args.seconds / interval_s))
                IntervalQueue("fidelity", backend=app.tasks["fid.siq"].siq_queue().backend).ensure(
                    interval_s, reset=True
                )
                print(run_row(app, record, ms, "siq_celery", "fid:siq", count), flush=True)
                # Celery's limit is set per worker at start; tasks a run cannot finish stay
                # reserved in its workers, so each rate_limit run gets new ones.
                rate_workers = start_workers("fid-rate", {"SIQ_BENCH_RATE": f"{1 / interval_s:g}/s"})
                try:
                    print(run_row(app, record, ms, "rate_limit", "fid:rate", count), flush=True)
                finally:
                    for w in rate_workers:
                        w.stop(10)
                    broker.delete("fid-rate")  # what the run could not start must not leak into the next
            plain_us, siq_us = publish_cost(app)
            print(f"\nPublish cost per task (median of 15 interleaved rounds of 300): plain apply_async "
                  f"{plain_us:.0f} µs, IntervalTask {siq_us:.0f} µs = {siq_us / plain_us:.2f} x plain")  # fmt: skip
        finally:
            for w in siq_workers:
                w.stop(10)


if __name__ == "__main__":
    main()
