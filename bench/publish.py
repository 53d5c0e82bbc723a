"""Publish cost: ``IntervalTask.apply_async`` against a plain task's ``apply_async``.

    make bench-publish                               # every kind, interleaved rounds, one table
    python bench/publish.py [--kinds plain,siq,quota]
    python bench/publish.py --only quota --url URL   # one kind, one process (for timing whole runs)

Kinds: ``plain``, a plain Celery task; ``siq``, an IntervalTask at 1 ms; ``quota``, an
IntervalTask with an interval and a window quota (5 ms, ``quota="1000/10s"``: the window
sets the slot of every ticket past the first 1,000, so each claim computes the window's
estimates; bench/peers_app.py says why those figures). Tasks go to a queue no worker
consumes, on a private Redis (or ``--url``'s, database 1 for the broker and 2 for the
store; both are flushed). An IntervalTask claims its ticket as it publishes (the claim is
sent before the message and its reply read after), so the difference is the price of
the ticket. To time whole processes, run ``--only quota`` (or ``siq``) and ``--only
plain`` against one server, in turn, with a large ``--count`` (10,000 stays within the
quota kind's path; start-up alone is ``--count 1``).
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
KINDS = ("plain", "siq", "quota")
LABELS = {
    "plain": "plain `apply_async`",
    "siq": "`IntervalTask.apply_async`, interval 1 ms (claims a ticket)",
    "quota": '`IntervalTask.apply_async`, interval 5 ms, `quota="1000/10s"` (the window binds)',
}


def run(url: str, only: str | None, count: int, rounds: int, kinds: list[str]) -> None:
    os.environ.update({"SIQ_BENCH_BROKER": f"{url}/1", "SIQ_BENCH_STORE": f"{url}/2"})
    import redis

    from bench.peers_app import app

    for db in (1, 2):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    tasks = {"plain": app.tasks["peers.plain"], "siq": app.tasks["peers.siq_publish"],
             "quota": app.tasks["peers.quota_publish"]}  # fmt: skip
    kinds = [only] if only else list(dict.fromkeys(["plain", *kinds]))
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
    medians = {kind: statistics.median(results[kind]) for kind in kinds}
    plain = medians["plain"]
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"# publish cost, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} cores, "
          f"{rounds} interleaved rounds of {per_round} (medians), load average {load}\n")  # fmt: skip
    print("| publish | µs per call | ratio to plain |\n|---|---:|---:|")
    for kind in kinds:
        print(f"| {LABELS[kind]} | {medians[kind]:.0f} | {medians[kind] / plain:.2f} |")
    print()
    for kind in kinds:
        print(f"SUMMARY publish {kind}: {medians[kind]:.0f} µs per call, {medians[kind] / plain:.2f} x plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="redis://host:port of a server to use (default: a private one)")
    parser.add_argument("--only", choices=KINDS, help="publish only this kind, in one timed loop")
    parser.add_argument("--kinds", default=",".join(KINDS), help="kinds in the table (plain is always one)")
    parser.add_argument("--count", type=int, default=6000, help="publishes per kind")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (without --only)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        parser.error(f"--kinds: choose from {', '.join(KINDS)}")
    if args.url:
        run(args.url.rstrip("/"), args.only, args.count, args.rounds, kinds)
        return
    with EmbeddedRedis() as server:
        run(f"redis://127.0.0.1:{server.port}", args.only, args.count, args.rounds, kinds)


if __name__ == "__main__":
    main()
