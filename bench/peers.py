"""Peers benchmark: siq_celery beside BullMQ's global limiter and Celery's rate_limit.

    make bench-peers
    python bench/peers.py [--intervals 50,20,10,5,2] [--profiles empty,mixed] [--runs 3]
                          [--limiters siq,bullmq,rate_limit] [--seconds 4]

One private Redis serves all three, one after another, on the same workload: 4 worker
processes (Celery: 2 nodes x ``-c 2``, prefork, Redis broker, ``acks_late``, prefetch 1;
BullMQ: 4 Node processes, concurrency 1, ``limiter {max: 1, duration: I}``), a backlog
published at once (``--seconds`` of schedule, 100 to 400 tasks), bodies that sleep 0 ms
("empty") or 0, 0, 5, 20, 40 ms in turn ("mixed"). Celery's ``rate_limit`` is per
worker node, as Celery defines it: set to 1/I, two nodes allow twice the rate.

Prints one Markdown table; each cell is the median (min-max) of ``--runs`` runs:

* achieved rate: ``(starts - 1) x I / span`` of body starts, as % of 1/I;
* smallest gap between body starts (host clock), and violations: gaps < 0.9 x I;
* p99 lateness: a start's delay past the previous start + I (what a limiter loses);
* max starts in any window of 10 x I (10 is the cap; 11 can happen at the edges);
* order inversions: starts of a task published after one that had not started yet;
* siq_celery only: violations on the store's clock (authorized starts closer than I).

``--limiters none`` adds the same plain task with no limit at all: its achieved rate
(over 100 % where Celery alone is faster than 1/I) is the ceiling that Celery's own
per-task cost sets on this machine, which no limiter running inside Celery can pass.

BullMQ is installed with ``npm ci`` (or ``npm install``, at the lock's versions) into
bench/peers/ (Node from the machine; skipped with a message where ``node``/``npm`` are
missing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"
sys.path.insert(0, str(ROOT))

from siq_celery.embedded import EmbeddedRedis  # noqa: E402
from siq_celery.workers import WorkerProcess  # noqa: E402

PROFILES = {"empty": [0.0], "mixed": [0.0, 0.0, 5.0, 20.0, 40.0]}
RECORD_KEY = "peers:starts"
SETTLE_S = 2.0


def metrics(rows: list[dict[str, Any]], interval_s: float) -> dict[str, float]:
    """The table's figures for one run (``t``: body start, seconds; ``n``: publish order)."""
    ordered = sorted(rows, key=lambda r: r["t"])
    times = [r["t"] for r in ordered]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0]
    late = sorted(max(g - interval_s, 0.0) for g in gaps)
    window = 10 * interval_s
    most, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        most = max(most, i - j + 1)
    highest, inversions = -1, 0
    for r in ordered:
        inversions += r["n"] < highest
        highest = max(highest, r["n"])
    out = {
        "rate": 100 * (len(times) - 1) * interval_s / span if span else 0.0,
        "min_gap": min(gaps) * 1000,
        "violations": sum(g < 0.9 * interval_s for g in gaps),
        "p99_late": late[min(int(len(late) * 0.99), len(late) - 1)] * 1000,
        "window": most,
        "inversions": inversions,
    }
    if "store_us" in ordered[0]:
        store = sorted(r["store_us"] for r in rows)
        out["store_violations"] = sum(b - a < interval_s * 1e6 for a, b in itertools.pairwise(store))
        # where the time goes (milliseconds, medians): a pool process took the task this
        # long before its slot; authorized this long after it; the body began this long after
        out["arrived_early"] = statistics.median((r["slot_us"] / 1e6 - r["arrived"]) * 1e3 for r in rows)
        out["auth_late"] = statistics.median((r["store_us"] - r["slot_us"]) / 1e3 for r in rows)
        out["body_after_auth"] = statistics.median((r["t"] - r["store_us"] / 1e6) * 1e3 for r in rows)
    return out


def collect(record: redis.Redis, count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while record.llen(RECORD_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads(r) for r in record.lrange(RECORD_KEY, 0, -1)]


class Bench:
    def __init__(self, server: EmbeddedRedis, tmp: Path, broker_wait_below: float = 0.02) -> None:
        self.port, self.tmp = server.port, tmp
        base = f"redis://127.0.0.1:{server.port}"
        self.env = {
            "SIQ_BENCH_BROKER": f"{base}/1", "SIQ_BENCH_STORE": f"{base}/2", "SIQ_BENCH_RECORD": f"{base}/3",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "SIQ_BENCH_BROKER_WAIT_BELOW": f"{broker_wait_below:g}",
        }  # fmt: skip
        os.environ.update(self.env)
        self.record = redis.Redis.from_url(self.env["SIQ_BENCH_RECORD"])
        self.broker = redis.Redis.from_url(self.env["SIQ_BENCH_BROKER"])

    def celery_workers(self, queue: str, extra: dict[str, str]) -> list[WorkerProcess]:
        workers = [
            WorkerProcess("bench.peers_app", f"{queue}{i}@bench", self.tmp / f"{queue}{i}.log", concurrency=2,
                          env={**self.env, **extra}, cwd=ROOT, extra_args=["-Q", queue]).start()
            for i in range(2)
        ]  # fmt: skip
        for w in workers:
            w.wait_ready()
        time.sleep(SETTLE_S)  # pool children finish starting before the clock runs
        return workers

    def run_celery(self, limiter: str, interval_s: float, bodies: list[float], count: int) -> dict[str, float]:
        from bench.peers_app import app

        # Workers start for each run: rate_limit is read at worker start, and a siq_celery
        # worker declares its interval (the code's interval= decides).
        if limiter == "siq":
            queue, extra, task = "peers-siq", {"SIQ_BENCH_INTERVAL": f"{interval_s * 1000:g}ms"}, "peers.siq"
        elif limiter == "rate_limit":
            queue, extra, task = "peers-rate", {"SIQ_BENCH_RATE": f"{1 / interval_s:g}/s"}, "peers.rate"
        else:  # "none": the same plain task with no limit, what Celery alone can start here
            queue, extra, task = "peers-rate", {}, "peers.rate"
        workers = self.celery_workers(queue, extra)
        try:
            self.record.delete(RECORD_KEY)
            publish = app.tasks[task]
            if limiter == "siq":
                publish.siq_queue().declare(interval_s)  # the publisher runs this interval's code too
            for n in range(count):
                publish.delay(n, bodies[n % len(bodies)])
            rows = collect(self.record, count, 60 + 3 * count * interval_s)
        finally:
            for w in workers:
                w.stop(10)
            self.broker.delete(queue)  # what a run could not start must not leak into the next
        return metrics(rows, interval_s) if len(rows) > 1 else {}

    def run_bullmq(self, interval_s: float, bodies: list[float], count: int) -> dict[str, float]:
        name = f"peers-{int(time.time() * 1000)}"
        record_db = redis.Redis(port=self.port, db=0)
        record_db.delete(RECORD_KEY)
        script = str(PEERS / "bullmq_run.mjs")
        workers = [
            subprocess.Popen(
                ["node", script, "worker", str(self.port), name, f"{interval_s * 1000:g}", RECORD_KEY],
                cwd=PEERS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for _ in range(4)
        ]  # fmt: skip
        try:
            for w in workers:
                assert w.stdout is not None
                line = w.stdout.readline()
                if "ready" not in line:
                    raise RuntimeError(f"a BullMQ worker did not start: {line}{w.stdout.read()}")
            time.sleep(SETTLE_S)
            subprocess.run(
                ["node", script, "produce", str(self.port), name, str(count), ",".join(f"{b:g}" for b in bodies)],
                cwd=PEERS, check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            rows = [{"n": r["n"], "t": r["t_us"] / 1e6} for r in collect(record_db, count, 60 + 3 * count * interval_s)]
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                try:
                    w.wait(10)
                except subprocess.TimeoutExpired:
                    w.kill()
            for key in record_db.scan_iter(f"bull:{name}:*"):
                record_db.delete(key)
        return metrics(rows, interval_s) if len(rows) > 1 else {}


def bullmq_ready() -> str | None:
    """None if BullMQ can run here (installing it if needed), else why not."""
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are not on PATH: BullMQ skipped"
    if not (PEERS / "node_modules" / "bullmq").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=PEERS, capture_output=True, text=True)
        if done.returncode != 0:  # npm 11's ci rejects the lock over other platforms' optional packages
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=PEERS, capture_output=True,
                                  text=True)  # fmt: skip
        if done.returncode != 0:
            return f"npm ci failed, BullMQ skipped: {done.stderr.strip()[-300:]}"
    return None


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    """``median (min-max)`` of the runs, or one figure where they agree."""
    if not values:
        return "-"
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(mid)} ({fmt(lo)}-{fmt(hi)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", default="50,20,10,5,2", help="milliseconds, comma-separated")
    parser.add_argument("--profiles", default="empty,mixed", help=f"body profiles: {', '.join(PROFILES)}")
    parser.add_argument(
        "--limiters",
        default="siq,bullmq,rate_limit,none",
        help="siq, bullmq, rate_limit, none (no limit: the ceiling of 4 Celery processes)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="schedule length of a backlog")
    parser.add_argument("--broker-wait-below", type=float, default=0.02,
                        help="siq_broker_wait_below, seconds (0: every siq_celery task by ETA)")  # fmt: skip
    parser.add_argument("--explain", action="store_true", help="siq_celery: where each start's time goes")
    args = parser.parse_args()
    limiters = args.limiters.split(",")
    skip = bullmq_ready() if "bullmq" in limiters else None
    if skip:
        print(f"note: {skip}", flush=True)
        limiters.remove("bullmq")
    print(f"# siq_celery vs BullMQ vs Celery rate_limit, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"{os.cpu_count()} cores, 4 worker processes, {args.runs} runs per cell: median (min-max)\n",
          flush=True)  # fmt: skip
    print("| interval | bodies | limiter | achieved rate | smallest gap | violations (< 0.9 I) | p99 lateness "
          "| max starts / 10 I | inversions | store-clock violations |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        bench = Bench(server, Path(tmp), args.broker_wait_below)
        for ms in (float(x) for x in args.intervals.split(",")):
            interval_s = ms / 1000
            count = int(min(400, max(100, args.seconds / interval_s)))
            for profile in args.profiles.split(","):
                bodies = PROFILES[profile]
                for limiter in limiters:
                    runs = []
                    for _ in range(args.runs):
                        if limiter == "bullmq":
                            runs.append(bench.run_bullmq(interval_s, bodies, count))
                        else:
                            runs.append(bench.run_celery(limiter, interval_s, bodies, count))
                    runs = [r for r in runs if r]

                    def cells(key: str, fmt: Callable[[float], str], runs: list[dict[str, float]] = runs) -> str:
                        return span([r[key] for r in runs if key in r], fmt)

                    if limiter == "siq" and args.explain:
                        ms2 = lambda v: f"{v:.2f}"  # noqa: E731
                        print(f"<!-- siq {ms:g} ms {profile}, medians: taken by a pool process "
                              f"{cells('arrived_early', ms2)} ms before the slot, authorized "
                              f"{cells('auth_late', ms2)} ms after it, body {cells('body_after_auth', ms2)} ms "
                              "after that -->")  # fmt: skip
                    print(
                        f"| {ms:g} ms | {profile} | {limiter} | {cells('rate', lambda v: f'{v:.1f}%')} "
                        f"| {cells('min_gap', lambda v: f'{v:.2f} ms')} | {cells('violations', lambda v: f'{v:.0f}')} "
                        f"| {cells('p99_late', lambda v: f'{v:.2f} ms')} | {cells('window', lambda v: f'{v:.0f}')} "
                        f"| {cells('inversions', lambda v: f'{v:.0f}')} "
                        f"| {cells('store_violations', lambda v: f'{v:.0f}') if limiter == 'siq' else 'n/a'} |",
                        flush=True,
                    )
            print(f"<!-- {ms:g} ms: {count} tasks per run -->", flush=True)


if __name__ == "__main__":
    main()
