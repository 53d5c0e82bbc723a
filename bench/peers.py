"""Peers benchmark: siq_celery beside BullMQ and Celery's rate_limit, in three scenarios.

    make bench-peers                        # all three
    make bench-peers SCENARIOS=burst        # one (or a comma-separated few)
    python bench/peers.py [--scenarios spacing,burst,concurrency] [--runs 3] [--limiters ...]
                          [--intervals 50,20,10,5,2] [--profiles empty,mixed] [--seconds 4]
                          [--burst 4] [--cap 3 --cap-tasks 150 --cap-body-ms 200]
                          [--pool gevent --procs 50]   # spacing, burst: the 2 nodes' pool and -c
                          [--busy 2]   # a loaded host: 2 busy loops beside every limiter

One private Redis serves every limiter, one after another, on the same workload.

**spacing** (one start per interval): 4 worker processes (Celery: 2 nodes x ``-c 2``,
prefork, Redis broker, ``acks_late``, prefetch 1; BullMQ: 4 Node processes, concurrency
1, ``limiter {max: 1, duration: I}``), a backlog published at once (``--seconds`` of
schedule, 100 to 400 tasks, or ``--count``), bodies that sleep 0 ms ("empty") or 0, 0, 5,
20, 40 ms in turn ("mixed"). Celery's ``rate_limit`` is per worker node, as Celery
defines it: set to 1/I, two nodes allow twice the rate. One Markdown table; each cell is
the median (min-max) of ``--runs`` runs:

* achieved rate: ``(starts - 1) x I / span`` of body starts, as % of 1/I;
* smallest gap between body starts (host clock), and violations: gaps < 0.9 x I;
* p99 lateness: a start's delay past the previous start + I (what a limiter loses);
* max starts in any window of 10 x I (10 is the cap; 11 can happen at the edges);
* order inversions: starts of a task published after one that had not started yet;
* siq_celery only: violations on the store's clock (authorized starts closer than I).

``--limiters none`` adds the same plain task with no limit at all: its achieved rate
(over 100 % where Celery alone is faster than 1/I) is the ceiling that Celery's own
per-task cost sets on this machine, which no limiter running inside Celery can pass.

**burst** (``burst=B``, default 4, at ``--intervals``, default 2 ms, empty bodies, the
same 4 processes): ``siq`` (burst 0), ``siq-burst`` (``burst=B``), ``bullmq`` (its limiter
at the same rate, ``{max: 1, duration: I}``) and ``bullmq-burst`` (``{max: B + 1,
duration: (B + 1) x I}``, the same rate in windows of B + 1). Besides the rate, the
*excess*: the most starts any half-open window of any length W holds beyond ceil(W / I),
computed exactly (bench/checks.py), on the store's clock (siq_celery: the start times its
bodies were given, ``Decision.now_us``, and the ledger's ``start_us`` of the run; the bound
is B) and on the bodies' clock (host).

**pools** (the spacing table at 20 and 10 ms, mixed bodies, for the pool I/O-bound fleets
run): ``siq`` on prefork (2 nodes x ``-c 2``), ``siq@gevent`` and ``none@gevent`` (Celery's
own ceiling on that pool, no limit) on 2 nodes x ``-c 50`` of gevent, and BullMQ. Any
spacing limiter takes ``@pool`` (``--limiters siq@eventlet``).

**concurrency** (``concurrency=N``, default 3; 3 nodes x ``-c 4``, 150 bodies of 200 ms):
siq_celery's cap beside BullMQ's global concurrency (``queue.setGlobalConcurrency(N)``, 3
Node processes of concurrency 4). In flight as the bodies count it (each ``INCR``s a counter
as it starts and ``DECR``s it as it ends: the most any body saw) and from their start and
end times; throughput from the first start to the last end, against N / body time; every
task run once.

Each scenario ends with ``SUMMARY`` lines, one per limiter, and the load average.

``--busy N`` runs N CPU-bound processes (a Python busy loop each, bench/load.py) for the
whole run, beside every limiter alike: a loaded host, as production hosts are
(``make bench-peers-loaded``: 2, this machine's cores).

BullMQ is installed with ``npm ci`` (or ``npm install``, at the lock's versions) into
bench/peers/ (Node from the machine; skipped with a message where ``node``/``npm`` are
missing).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"
sys.path.insert(0, str(ROOT))

from bench.checks import burst_excess, most_at_once, to_us  # noqa: E402
from bench.load import busy  # noqa: E402
from siq_celery.embedded import EmbeddedRedis  # noqa: E402
from siq_celery.workers import WorkerProcess  # noqa: E402

PROFILES = {"empty": [0.0], "mixed": [0.0, 0.0, 5.0, 20.0, 40.0]}
RECORD_KEY = "peers:starts"
IN_FLIGHT_KEY = "peers:in-flight"
SETTLE_S = 2.0
SCENARIOS = ("spacing", "burst", "concurrency", "pools")
DEFAULTS = {  # per scenario: intervals (ms), profiles, limiters
    "spacing": ("50,20,10,5,2", "empty,mixed", "siq,bullmq,rate_limit,none"),
    "burst": ("2", "empty", "siq,siq-burst,bullmq,bullmq-burst"),
    "concurrency": ("", "", "siq,bullmq"),
    "pools": ("20,10", "mixed", "siq,siq@gevent,none@gevent,bullmq"),
}
#: -c of each of the 2 nodes on a green pool in the pools scenario (Celery's advice: -c 50 to 100)
GREEN_PROCS = 50
BULLMQ = ("bullmq", "bullmq-burst")


def metrics(rows: list[dict[str, Any]], interval_s: float) -> dict[str, float]:
    """The tables' figures for one run (``t``: body start, seconds; ``n``: publish order)."""
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
    interval_us = round(interval_s * 1e6)
    out = {
        "rate": 100 * (len(times) - 1) * interval_s / span if span else 0.0,
        "min_gap": min(gaps) * 1000,
        "violations": sum(g < 0.9 * interval_s for g in gaps),
        "p99_late": late[min(int(len(late) * 0.99), len(late) - 1)] * 1000,
        "window": most,
        "inversions": inversions,
        "excess_bodies": burst_excess(to_us(times), interval_us).excess,
    }
    if "store_us" in ordered[0]:
        store = sorted(r["store_us"] for r in rows)
        out["store_violations"] = sum(b - a < interval_s * 1e6 for a, b in itertools.pairwise(store))
        out["excess_store"] = burst_excess(store, interval_us).excess
        # where the time goes (milliseconds, medians): a pool process took the task this
        # long before its slot; authorized this long after it; the body began this long after
        out["arrived_early"] = statistics.median((r["slot_us"] / 1e6 - r["arrived"]) * 1e3 for r in rows)
        out["auth_late"] = statistics.median((r["store_us"] - r["slot_us"]) / 1e3 for r in rows)
        out["body_after_auth"] = statistics.median((r["t"] - r["store_us"] / 1e6) * 1e3 for r in rows)
    return out


def cap_metrics(rows: list[dict[str, Any]], count: int, cap: int, body_s: float) -> dict[str, float]:
    """The concurrency table's figures for one run (``t``, ``end``: a body's start and end,
    seconds; ``in_flight``: the count the body saw as it started, itself included)."""
    first, last = min(r["t"] for r in rows), max(r["end"] for r in rows)
    rate = len(rows) / (last - first)
    handoffs = handoff_ms(rows, cap)
    return {
        "handoff_p50": percentile(handoffs, 50) if handoffs else float("nan"),
        "handoff_p99": percentile(handoffs, 99) if handoffs else float("nan"),
        "publishes": max(1 + r.get("deferrals", 0) for r in rows),
        "publishes_mean": sum(1 + r.get("deferrals", 0) for r in rows) / len(rows),
        "most_counted": max(r["in_flight"] for r in rows),
        "most_timed": most_at_once(zip(to_us([r["t"] for r in rows]), to_us([r["end"] for r in rows]), strict=True)),
        "throughput": rate,
        "of_cap": 100 * rate * body_s / cap,
        "once": len(rows) == count and len({r["n"] for r in rows}) == count,
        "span": last - first,
    }


def worker_tree(workers: list[WorkerProcess]) -> list[psutil.Process]:
    """Every process of ``workers``: each node's main process and its pool's children."""
    tree = []
    for w in workers:
        if w.process is not None:
            main = psutil.Process(w.process.pid)
            tree += [main, *main.children(recursive=True)]
    return tree


def cpu_profilers(workers: list[WorkerProcess], name: str) -> list[subprocess.Popen[bytes]]:
    """With ``SIQ_BENCH_PROFILE=DIR``: a py-spy sampler on each node and its pool over the run,
    folded stacks of the Python code that ran (threads holding the GIL, 500 a second) in
    ``DIR/NAME-<node>.txt``, read by ``bench/cpu_profile.py``; and the Redis commands a task
    (``INFO commandstats``, store and broker): where a start's CPU goes."""
    folder = os.environ.get("SIQ_BENCH_PROFILE")
    if not folder:
        return []
    os.makedirs(folder, exist_ok=True)
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    found = [w.process.pid for w in workers if w.process is not None]
    return [
        subprocess.Popen([spy, "record", "--pid", str(pid), "--subprocesses", "--rate", "500", "--gil",
                          "--format", "raw", "--output", os.path.join(folder, f"{name}-{i}.txt")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i, pid in enumerate(found)
    ]  # fmt: skip


def cpu_seconds(tree: list[psutil.Process]) -> float:
    """The CPU (user + system) the processes of ``tree`` have used so far."""
    total = 0.0
    for p in tree:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def handoff_ms(rows: list[dict[str, Any]], cap: int) -> list[float]:
    """For each body that began while the cap was full just before (``cap`` - 1 others
    running): how long after the last body's end before it (the lease it took), ms."""
    ends = sorted(r["end"] for r in rows)
    out = []
    for r in rows:
        t = r["t"]
        running = sum(1 for o in rows if o is not r and o["t"] <= t < o["end"])
        before = [e for e in ends if e <= t]
        if running == cap - 1 and before:
            last = before[-1]
            full = sum(1 for o in rows if o["t"] < last <= o["end"])  # running as the lease came back, it included
            if full >= cap:
                out.append(1e3 * (t - last))
    return out


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def collect(record: redis.Redis, count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while record.llen(RECORD_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads(r) for r in record.lrange(RECORD_KEY, 0, -1)]


class Bench:
    def __init__(
        self, server: EmbeddedRedis, tmp: Path, broker_wait_below: float = 0.02, burst: int = 4, cap: int = 3,
        pool: str = "prefork", procs: int = 2,
    ) -> None:  # fmt: skip
        self.port, self.tmp = server.port, tmp
        #: the Celery pool of the spacing and burst scenarios' 2 nodes, and -c of each
        self.pool, self.procs = pool, procs
        base = f"redis://127.0.0.1:{server.port}"
        self.env = {
            "SIQ_BENCH_BROKER": f"{base}/1", "SIQ_BENCH_STORE": f"{base}/2", "SIQ_BENCH_RECORD": f"{base}/3",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "SIQ_BENCH_BROKER_WAIT_BELOW": f"{broker_wait_below:g}",
            "SIQ_BENCH_BURST": str(burst), "SIQ_BENCH_CAP": str(cap),
        }  # fmt: skip
        os.environ.update(self.env)  # before bench.peers_app is imported: the publisher's tasks read it too
        self.record = redis.Redis.from_url(self.env["SIQ_BENCH_RECORD"])
        self.broker = redis.Redis.from_url(self.env["SIQ_BENCH_BROKER"])

    def celery_workers(
        self, queue: str, extra: dict[str, str], nodes: int = 2, procs: int | None = None
    ) -> list[WorkerProcess]:
        workers = [
            WorkerProcess("bench.peers_app", f"{queue}{i}@bench", self.tmp / f"{queue}{i}.log",
                          concurrency=self.procs if procs is None else procs, pool=self.pool,
                          env={**self.env, **extra}, cwd=ROOT, extra_args=["-Q", queue]).start()
            for i in range(nodes)
        ]  # fmt: skip
        for w in workers:
            w.wait_ready()
        time.sleep(SETTLE_S)  # pool children finish starting before the clock runs
        return workers

    def run_celery(self, limiter: str, interval_s: float, bodies: list[float], count: int) -> dict[str, float]:
        from bench.peers_app import app

        # Workers start for each run: rate_limit is read at worker start, and a siq_celery
        # worker declares its interval (the code's interval= decides).
        interval = {"SIQ_BENCH_INTERVAL": f"{interval_s * 1000:g}ms"}
        if limiter == "siq":
            queue, extra, task = "peers-siq", interval, "peers.siq"
        elif limiter == "siq-burst":  # SIQ_BENCH_BURST, on a queue of its own
            queue, extra, task = "peers-burst", interval, "peers.burst"
        elif limiter == "rate_limit":
            queue, extra, task = "peers-rate", {"SIQ_BENCH_RATE": f"{1 / interval_s:g}/s"}, "peers.rate"
        else:  # "none": the same plain task with no limit, what Celery alone can start here
            queue, extra, task = "peers-rate", {}, "peers.rate"
        workers = self.celery_workers(queue, extra)
        try:
            self.record.delete(RECORD_KEY)
            publish = app.tasks[task]
            if limiter.startswith("siq"):
                publish.siq_queue().declare(interval_s)  # the publisher runs this interval's code too
            begin = time.time()  # the last run's starts came before its workers stopped, seconds ago
            tree = worker_tree(workers)
            profilers = cpu_profilers(workers, f"{limiter}-{interval_s * 1000:g}ms")
            calls = self.record.info("commandstats") if profilers else {}
            cpu = cpu_seconds(tree)
            for n in range(count):
                publish.delay(n, bodies[n % len(bodies)])
            rows = collect(self.record, count, 60 + 3 * count * interval_s)
            cpu = cpu_seconds(tree) - cpu
            for p in profilers:
                p.send_signal(signal.SIGINT)
                p.wait(30)
            if profilers:  # the Redis commands a task: the broker's and the store's round trips
                after = self.record.info("commandstats")
                print(f"# Redis calls a task ({limiter}, {interval_s * 1000:g} ms): " + ", ".join(
                    f"{k.removeprefix('cmdstat_')} {(v['calls'] - calls.get(k, {}).get('calls', 0)) / count:.2f}"
                    for k, v in sorted(after.items()) if v["calls"] - calls.get(k, {}).get("calls", 0) >= count / 20
                ))  # fmt: skip
        finally:
            for w in workers:
                w.stop(10)
            self.broker.delete(queue)  # what a run could not start must not leak into the next
        # the store's own record of its authorized starts (siq_celery only), read once
        ledger = list(publish.siq_queue().ledger(since=begin - 0.5)) if limiter.startswith("siq") else []
        if os.environ.get("SIQ_BENCH_DUMP"):  # every body's record (and the ledger's), for a closer look
            ledger_rows = [
                {"ticket": r.ticket, "start_us": r.start_us, "slot_us": r.slot_us, "began_us": r.began_us,
                 "outcome": r.outcome, "pid": r.pid, "deferrals": r.deferrals}
                for r in ledger
            ]  # fmt: skip
            with open(os.environ["SIQ_BENCH_DUMP"], "a") as dump:
                dump.write(json.dumps({"limiter": limiter, "interval_s": interval_s, "rows": rows,
                                       "ledger": ledger_rows}) + "\n")  # fmt: skip
        out = metrics(rows, interval_s) if len(rows) > 1 else {}
        if out:  # the worker processes' CPU (user + system) a task, bodies' sleeps aside
            out["cpu_ms"] = 1e3 * cpu / len(rows)
        if out and limiter.startswith("siq"):
            out["excess_ledger"] = burst_excess([r.start_us for r in ledger], round(interval_s * 1e6)).excess
            out["ledger_rows"] = len(ledger)
        return out

    def run_celery_capped(self, cap: int, count: int, body_s: float, nodes: int, procs: int) -> dict[str, float]:
        from bench.peers_app import app

        workers = self.celery_workers("peers-capped", {}, nodes, procs)
        try:
            self.record.delete(RECORD_KEY, IN_FLIGHT_KEY)
            publish = app.tasks["peers.capped"]
            for n in range(count):
                publish.delay(n, body_s * 1000)
            rows = collect(self.record, count, 60 + 3 * count * body_s / cap)
        finally:
            for w in workers:
                w.stop(10)
            self.broker.delete("peers-capped")
        return cap_metrics(rows, count, cap, body_s) if rows else {}

    def bullmq(self, workers: list[list[str]], produce: list[str], timeout: float) -> list[dict[str, Any]]:
        """Start the BullMQ worker processes (``node bullmq_run.mjs ARGS``), let them
        settle, run the producer, and return what the bodies recorded (database 0)."""
        record_db = redis.Redis(port=self.port, db=0)
        record_db.delete(RECORD_KEY, IN_FLIGHT_KEY)
        script = str(PEERS / "bullmq_run.mjs")
        procs = [
            subprocess.Popen(["node", script, *args], cwd=PEERS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            for args in workers
        ]  # fmt: skip
        try:
            for w in procs:
                assert w.stdout is not None
                line = w.stdout.readline()
                if "ready" not in line:
                    raise RuntimeError(f"a BullMQ worker did not start: {line}{w.stdout.read()}")
            time.sleep(SETTLE_S)
            subprocess.run(["node", script, "produce", *produce], cwd=PEERS, check=True, capture_output=True,
                           timeout=60)  # fmt: skip
            count = int(produce[2])
            return collect(record_db, count, timeout)
        finally:
            for w in procs:
                w.terminate()
            for w in procs:
                try:
                    w.wait(10)
                except subprocess.TimeoutExpired:
                    w.kill()
            for key in record_db.scan_iter(f"bull:{produce[1]}:*"):
                record_db.delete(key)

    def run_bullmq(self, interval_s: float, bodies: list[float], count: int, most: int = 1) -> dict[str, float]:
        """4 processes of concurrency 1 under the limiter {max: most, duration: most x I}."""
        name, port = f"peers-{int(time.time() * 1000)}", str(self.port)
        worker = ["worker", port, name, f"{interval_s * 1000:g}", RECORD_KEY, str(most)]
        produce = [port, name, str(count), ",".join(f"{b:g}" for b in bodies)]
        rows = self.bullmq([worker] * 4, produce, 60 + 3 * count * interval_s)
        rows = [{"n": r["n"], "t": r["t_us"] / 1e6} for r in rows]
        return metrics(rows, interval_s) if len(rows) > 1 else {}

    def run_bullmq_capped(self, cap: int, count: int, body_s: float, nodes: int, procs: int) -> dict[str, float]:
        """``nodes`` processes of concurrency ``procs``; the queue's global concurrency ``cap``."""
        name, port = f"peers-capped-{int(time.time() * 1000)}", str(self.port)
        worker = ["capped", port, name, str(procs), RECORD_KEY, IN_FLIGHT_KEY]
        produce = [port, name, str(count), f"{body_s * 1000:g}", str(cap)]
        rows = self.bullmq([worker] * nodes, produce, 60 + 3 * count * body_s / cap)
        rows = [{"n": r["n"], "t": r["t_us"] / 1e6, "end": r["end_us"] / 1e6, "in_flight": r["in_flight"]}
                for r in rows]  # fmt: skip
        return cap_metrics(rows, count, cap, body_s) if rows else {}


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


def load() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


class Cells:
    """The runs of one table cell, formatted as :func:`span` does."""

    def __init__(self, runs: list[dict[str, float]]) -> None:
        self.runs = [r for r in runs if r]

    def __call__(self, key: str, fmt: Callable[[float], str]) -> str:
        return span([r[key] for r in self.runs if key in r], fmt)


PCT = lambda v: f"{v:.1f}%"  # noqa: E731
MS = lambda v: f"{v:.2f} ms"  # noqa: E731
WHOLE = lambda v: f"{v:.0f}"  # noqa: E731


def grid(args: argparse.Namespace, limiters: list[str], run: Callable[..., dict[str, Any]]) -> Iterator[Any]:
    """Each cell of a table by interval, body profile and limiter: ``(ms, profile, limiter,
    count, cells)`` of ``args.runs`` runs of ``run(limiter, interval_s, bodies, count)``,
    with a comment line after each interval giving its task count."""
    for ms in (float(x) for x in args.intervals.split(",")):
        interval_s = ms / 1000
        count = args.count or int(min(400, max(100, args.seconds / interval_s)))
        for profile in args.profiles.split(","):
            for limiter in limiters:
                runs = [run(limiter, interval_s, PROFILES[profile], count) for _ in range(args.runs)]
                yield ms, profile, limiter, count, Cells(runs)
        print(f"<!-- {ms:g} ms: {count} tasks per run -->", flush=True)


def spacing(args: argparse.Namespace, bench: Bench, limiters: list[str]) -> None:
    green = f"; limiter@pool: 2 nodes x -c {GREEN_PROCS} on that pool" if any("@" in x for x in limiters) else ""
    print(f"# spacing: siq_celery vs BullMQ vs Celery rate_limit, Celery 2 nodes x -c {args.procs} ({args.pool})"
          f"{green}, {args.runs} runs per cell: median (min-max); {load()}\n", flush=True)  # fmt: skip
    print("| interval | bodies | limiter | achieved rate | smallest gap | violations (< 0.9 I) | p99 lateness "
          "| max starts / 10 I | inversions | store-clock violations |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    summary = []

    def run(limiter: str, interval_s: float, bodies: list[float], count: int) -> dict[str, Any]:
        if limiter == "bullmq":
            return bench.run_bullmq(interval_s, bodies, count)
        limiter, _, pool = limiter.partition("@")  # the pools scenario: "siq@gevent" on 2 nodes x -c 50
        bench.pool, bench.procs = (pool, GREEN_PROCS) if pool else (args.pool, args.procs)
        return bench.run_celery(limiter, interval_s, bodies, count)

    for ms, profile, limiter, count, cells in grid(args, limiters, run):
        if limiter.startswith("siq") and args.explain:
            ms2 = lambda v: f"{v:.2f}"  # noqa: E731
            print(f"<!-- siq {ms:g} ms {profile}, medians: taken by a pool process "
                  f"{cells('arrived_early', ms2)} ms before the slot, authorized "
                  f"{cells('auth_late', ms2)} ms after it, body {cells('body_after_auth', ms2)} ms "
                  "after that -->")  # fmt: skip
        store = cells("store_violations", WHOLE) if limiter.startswith("siq") else "n/a"
        print(
            f"| {ms:g} ms | {profile} | {limiter} | {cells('rate', PCT)} | {cells('min_gap', MS)} "
            f"| {cells('violations', WHOLE)} | {cells('p99_late', MS)} | {cells('window', WHOLE)} "
            f"| {cells('inversions', WHOLE)} | {store} |",
            flush=True,
        )
        summary.append(f"SUMMARY spacing {ms:g}ms {profile} {limiter}: rate {cells('rate', PCT)}, "
                       f"body violations {cells('violations', WHOLE)}, store-clock violations {store}, "
                       f"CPU a task {cells('cpu_ms', MS)}, {len(cells.runs)} runs of {count}")  # fmt: skip
    print("\n" + "\n".join(summary) + f"\nSUMMARY spacing done: {load()}\n", flush=True)


def burst(args: argparse.Namespace, bench: Bench, limiters: list[str]) -> None:
    b = args.burst
    names = {
        "siq": "siq, burst 0", "siq-burst": f"siq, burst {b}", "bullmq": "bullmq {max: 1, duration: I}",
        "bullmq-burst": f"bullmq {{max: {b + 1}, duration: {b + 1} I}}",
    }  # fmt: skip
    print(f"# burst: excess = most starts in a half-open window of any length W beyond ceil(W / I); "
          f"Celery 2 nodes x -c {bench.procs} ({bench.pool}), {args.runs} runs per cell: median (min-max); {load()}\n",
          flush=True)  # fmt: skip
    print("| interval | bodies | limiter | achieved rate | excess, store clock | excess, ledger | excess, bodies "
          "| smallest gap | p99 lateness | inversions | store-clock gaps < I |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    summary = []

    def run(limiter: str, interval_s: float, bodies: list[float], count: int) -> dict[str, Any]:
        if limiter in BULLMQ:
            return bench.run_bullmq(interval_s, bodies, count, b + 1 if limiter == "bullmq-burst" else 1)
        return bench.run_celery(limiter, interval_s, bodies, count)

    for ms, profile, limiter, count, cells in grid(args, limiters, run):
        siq = limiter.startswith("siq")
        store = cells("excess_store", WHOLE) if siq else "n/a"
        ledger = f"{cells('excess_ledger', WHOLE)} of {cells('ledger_rows', WHOLE)} rows" if siq else "n/a"
        print(
            f"| {ms:g} ms | {profile} | {names[limiter]} | {cells('rate', PCT)} | {store} "
            f"| {cells('excess_ledger', WHOLE) if siq else 'n/a'} "
            f"| {cells('excess_bodies', WHOLE)} | {cells('min_gap', MS)} | {cells('p99_late', MS)} "
            f"| {cells('inversions', WHOLE)} | {cells('store_violations', WHOLE) if siq else 'n/a'} |",
            flush=True,
        )
        bound = f" (bound {b if limiter == 'siq-burst' else 0})" if siq else ""
        bodies_excess = cells("excess_bodies", WHOLE)
        summary.append(f"SUMMARY burst {ms:g}ms {profile} {names[limiter]}: rate {cells('rate', PCT)}, "
                       f"excess store clock {store}{bound}, ledger {ledger}, bodies {bodies_excess}, "
                       f"CPU a task {cells('cpu_ms', MS)}, {len(cells.runs)} runs of {count}")  # fmt: skip
    print("\n" + "\n".join(summary) + f"\nSUMMARY burst done: {load()}\n", flush=True)


def concurrency(args: argparse.Namespace, bench: Bench, limiters: list[str]) -> None:
    cap, count, body_s, nodes, procs = args.cap, args.cap_tasks, args.cap_body_ms / 1000, args.cap_nodes, args.cap_procs
    names = {"siq": f"siq, concurrency={cap}", "bullmq": f"bullmq setGlobalConcurrency({cap})"}
    print(f"# concurrency: cap {cap}, {nodes} x {procs} worker processes (Celery: {nodes} nodes x -c {procs}; "
          f"BullMQ: {nodes} processes of concurrency {procs}), {count} bodies of {args.cap_body_ms:g} ms, "
          f"{args.runs} runs per cell: median (min-max); {load()}\n", flush=True)  # fmt: skip
    print(
        "| limiter | most in flight, counted by the bodies | most in flight, body times | throughput "
        f"| % of {cap} / {args.cap_body_ms:g} ms | hand-off p50 / p99 | publishes a task (most, mean) "
        "| first start to last end | every task once |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    summary = []
    for limiter in limiters:
        run = bench.run_bullmq_capped if limiter == "bullmq" else bench.run_celery_capped
        cells = Cells([run(cap, count, body_s, nodes, procs) for _ in range(args.runs)])
        once = f"{sum(bool(r['once']) for r in cells.runs)} of {args.runs} runs"
        print(
            f"| {names[limiter]} | {cells('most_counted', WHOLE)} | {cells('most_timed', WHOLE)} "
            f"| {cells('throughput', lambda v: f'{v:.2f}/s')} | {cells('of_cap', PCT)} "
            f"| {cells('handoff_p50', MS)} / {cells('handoff_p99', MS)} "
            f"| {cells('publishes', WHOLE)}, {cells('publishes_mean', lambda v: f'{v:.2f}')} "
            f"| {cells('span', lambda v: f'{v:.2f} s')} | {once} |",
            flush=True,
        )
        summary.append(f"SUMMARY concurrency {names[limiter]}: most in flight {cells('most_counted', WHOLE)} "
                       f"(bodies' count; body times {cells('most_timed', WHOLE)}; cap {cap}), throughput "
                       f"{cells('of_cap', PCT)} of {cap / body_s:g}/s, hand-off p50 {cells('handoff_p50', MS)} "
                       f"p99 {cells('handoff_p99', MS)}, publishes a task at most {cells('publishes', WHOLE)}, "
                       f"every task once in {once}")  # fmt: skip
    print("\n" + "\n".join(summary) + f"\nSUMMARY concurrency done: {load()}\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--intervals", help="milliseconds, comma-separated (spacing: 50,20,10,5,2; burst: 2)")
    parser.add_argument("--profiles", help=f"body profiles: {', '.join(PROFILES)} (spacing: both; burst: empty)")
    parser.add_argument("--limiters", help="spacing: siq, bullmq, rate_limit, none (no limit: the ceiling of 4 "
                        "Celery processes); burst: siq, siq-burst, bullmq, bullmq-burst; concurrency: siq, bullmq "
                        "(default: all of the scenario's)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="schedule length of a backlog")
    parser.add_argument("--count", type=int, help="tasks per run (spacing, burst; default from --seconds)")
    parser.add_argument("--broker-wait-below", type=float, default=0.02,
                        help="siq_broker_wait_below, seconds (0: every siq_celery task by ETA)")  # fmt: skip
    parser.add_argument("--explain", action="store_true", help="siq_celery: where each start's time goes")
    parser.add_argument("--pool", default="prefork", help="spacing, burst: the Celery pool (prefork, gevent, eventlet)")
    parser.add_argument("--procs", type=int, default=2, help="spacing, burst: -c of each of the 2 Celery nodes")
    parser.add_argument("--burst", type=int, default=4, help="burst: siq-burst's burst= (bullmq-burst: max B + 1)")
    parser.add_argument("--cap", type=int, default=3, help="concurrency: the cap")
    parser.add_argument("--cap-tasks", type=int, default=150, help="concurrency: tasks per run")
    parser.add_argument("--cap-body-ms", type=float, default=200.0, help="concurrency: body time, milliseconds")
    parser.add_argument("--cap-nodes", type=int, default=3, help="concurrency: worker nodes (BullMQ processes)")
    parser.add_argument("--cap-procs", type=int, default=4, help="concurrency: -c of each node (BullMQ concurrency)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the limiters (a loaded host)")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario {', '.join(sorted(unknown))}: choose from {', '.join(SCENARIOS)}")
    chosen = {s: (args.limiters or DEFAULTS[s][2]).split(",") for s in scenarios}
    skip = bullmq_ready() if any(set(BULLMQ) & set(ls) for ls in chosen.values()) else None
    if skip:
        print(f"note: {skip}", flush=True)
        chosen = {s: [lim for lim in ls if lim not in BULLMQ] for s, ls in chosen.items()}
    host = f", {args.busy} busy loops beside" if args.busy else ""
    print(f"# peers, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} cores{host}, {load()}\n",
          flush=True)  # fmt: skip
    explicit_intervals, explicit_profiles = args.intervals, args.profiles
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp, busy(args.busy):
        bench = Bench(server, Path(tmp), args.broker_wait_below, args.burst, args.cap, args.pool, args.procs)
        for scenario in scenarios:
            args.intervals = explicit_intervals or DEFAULTS[scenario][0]
            args.profiles = explicit_profiles or DEFAULTS[scenario][1]
            run = {"spacing": spacing, "burst": burst, "concurrency": concurrency, "pools": spacing}[scenario]
            run(args, bench, chosen[scenario])


if __name__ == "__main__":
    main()
