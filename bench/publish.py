"""Publish cost: ``IntervalTask.apply_async`` against a plain task's ``apply_async``.

    python bench/publish.py                        # both, interleaved rounds, one table
    python bench/publish.py --only siq --url URL   # one kind, one process (for timing whole runs)

Tasks go to a queue no worker consumes, on a private Redis (or ``--url``'s, database 1
for the broker and 2 for the store; both are flushed). The IntervalTask claims its ticket
as it publishes (the claim is sent before the message and its reply read after), so the
difference is the price of the ticket. To time whole processes, run ``--only siq`` and
``--only plain`` against one server, in turn, with a large ``--count``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from siq_celery.embedded import EmbeddedRedis  # noqa: E402

SINK = "publish-sink"  # no worker consumes it


def run(url: str, only: str | None, count: int, rounds: int) -> None:
    os.environ.update({"SIQ_BENCH_BROKER": f"{url}/1", "SIQ_BENCH_STORE": f"{url}/2"})
    import redis

    from bench.peers_app import app

    for db in (1, 2):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    tasks = {"plain": app.tasks["peers.plain"], "siq": app.tasks["peers.siq_publish"]}
    kinds = [only] if only else list(tasks)
    for kind in kinds:  # connections and scripts warm
        for n in range(50):
            tasks[kind].apply_async((n,), queue=SINK)
    if only:
        t = time.perf_counter()
        for n in range(count):
            tasks[only].apply_async((n,), queue=SINK)
        print(f"{only}: {(time.perf_counter() - t) / count * 1e6:.0f} µs per publish ({count} publishes)")
        return
    per_round = max(count // rounds, 1)
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            t = time.perf_counter()
            for n in range(per_round):
                tasks[kind].apply_async((n,), queue=SINK)
            results[kind].append((time.perf_counter() - t) / per_round * 1e6)
    plain, siq = statistics.median(results["plain"]), statistics.median(results["siq"])
    print(f"# publish cost, {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, "
          f"{rounds} interleaved rounds of {per_round} (medians)\n")  # fmt: skip
    print("| publish | µs per call | ratio to plain |\n|---|---:|---:|")
    print(f"| plain `apply_async` | {plain:.0f} | 1.00 |")
    print(f"| `IntervalTask.apply_async` (claims a ticket) | {siq:.0f} | {siq / plain:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="redis://host:port of a server to use (default: a private one)")
    parser.add_argument("--only", choices=["plain", "siq"], help="publish only this kind, in one timed loop")
    parser.add_argument("--count", type=int, default=6000, help="publishes per kind")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (without --only)")
    args = parser.parse_args()
    if args.url:
        run(args.url.rstrip("/"), args.only, args.count, args.rounds)
        return
    with EmbeddedRedis() as server:
        run(f"redis://127.0.0.1:{server.port}", args.only, args.count, args.rounds)


if __name__ == "__main__":
    main()
