"""Four processes, one 200 ms interval, no Celery: see README.md beside this file."""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import tempfile
import time

from siq_celery import IntervalQueue

INTERVAL = "200ms"


def worker(url: str, calls: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    api = IntervalQueue("pretend-api", url=url, interval=INTERVAL)

    @api.limited
    def call_api(n: int) -> float:
        return time.time()  # a real program would make its HTTP request here

    for n in range(calls):
        results.put((os.getpid(), call_api(n)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="state store URL (default: SQLite in a temporary folder)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{tmp}/siq.db"
        IntervalQueue("pretend-api", url=url, interval=INTERVAL).ensure(reset=True)
        results: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        procs = [mp.Process(target=worker, args=(url, args.calls, results)) for _ in range(args.processes)]
        for p in procs:
            p.start()
        starts = sorted(results.get(timeout=60) for _ in range(args.processes * args.calls))
        for p in procs:
            p.join()
    starts.sort(key=lambda s: s[1])
    first = starts[0][1]
    for pid, t in starts:
        print(f"process {pid}  +{(t - first) * 1000:8.1f} ms")
    smallest = min(b[1] - a[1] for a, b in itertools.pairwise(starts)) * 1000
    ok = smallest >= 190  # the store's cap is exact; the host adds scheduling noise
    print(f"{'OK' if ok else 'FAILED'}: {len(starts)} calls, smallest gap {smallest:.1f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
