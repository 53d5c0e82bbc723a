"""A window quota under real workers, on the bodies' clock: what a provider that counts
requests per window sees.

    python bench/window_workers.py [--runs 10] [--tasks 120] [--busy 2]

3 nodes x ``-c 2`` (prefork) on a private Redis (broker and store), one queue at 50 ms with
a quota of 50 in any 10 s (``fid.window`` in bench/fidelity_app.py); ``--tasks`` calls
published at once. Per run, on the bodies' clock (the ``time.time()`` each body records
first) and on the store's (the authorizations): the most starts in any half-open window of
10 s (bound 50), the smallest gap between starts (bound 50 ms), and how long after the first
start the last came (120 tasks: 50 in the first window, 50 in the second, 20 in the third, so
about 20 s). ``--busy 2`` runs two busy loops beside the workers (a loaded host,
bench/load.py). Prints one Markdown table row per run, then a summary line.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fidelity import bench_env, collect, three_nodes  # noqa: E402
from bench.load import busy  # noqa: E402
from siq_celery.backends import backend_from_url  # noqa: E402
from siq_celery.embedded import EmbeddedRedis  # noqa: E402

KEY = "fid:window"
WINDOW_S, QUOTA, INTERVAL_S = 10.0, 50, 0.05


def most_in_window(times: list[float], window: float) -> int:
    """The most of ``times`` (sorted) in any half-open window ``[t, t + window)``."""
    return max(bisect.bisect_left(times, t + window) - i for i, t in enumerate(times))


def window_handoffs(times: list[float]) -> list[float]:
    """For each start that waited for the window (the start ``QUOTA`` before it left the
    window after the interval since the start before it had passed: the window, not the
    spacing, held it) and came less than half an interval after: how long after the window
    freed, ms. A start the spacing held is not counted: it was allowed an interval after
    the start before it, which may itself have come late."""
    out = []
    for j in range(QUOTA, len(times)):
        freed = times[j - QUOTA] + WINDOW_S
        if freed >= times[j - 1] + INTERVAL_S and times[j] - freed < INTERVAL_S / 2:
            out.append((times[j] - freed) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=120)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the workers (a loaded host)")
    args = parser.parse_args()
    host = f"{args.busy} busy loops beside" if args.busy else "idle"
    print(f"# window quota, 3 nodes x -c 2 (prefork), 50 ms and {QUOTA}/{WINDOW_S:.0f}s, {args.tasks} tasks, "
          f"Redis broker and store, {host}, {time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print(f"| run | most in 10 s: bodies / store | tightest {QUOTA + 1} starts: bodies / store "
          "| smallest gap: bodies / store | first to last start: bodies "
          "| after the window freed: bodies, most |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|", flush=True)
    failed = 0
    freed: list[float] = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp, busy(args.busy):
        env = bench_env(server.port)
        from bench.fidelity_app import app

        record = redis.Redis.from_url(env["SIQ_BENCH_RECORD"])
        store = backend_from_url(env["SIQ_BENCH_STORE"])
        task = app.tasks["fid.window"]
        for run in range(1, args.runs + 1):
            try:
                with three_nodes(f"window{run}-", "fid-window", Path(tmp), env):
                    for n in range(args.tasks):
                        task.delay(n)
                    rows = collect(record, KEY, args.tasks, timeout=60 + args.tasks)
            finally:
                store.delete("window")
                record.delete(KEY)
            if len(rows) < args.tasks:
                raise SystemExit(f"run {run}: {len(rows)} of {args.tasks} tasks started within the timeout")
            if os.environ.get("SIQ_BENCH_DUMP"):  # every body's record, for a closer look
                with open(os.environ["SIQ_BENCH_DUMP"], "a") as dump:
                    dump.write(json.dumps({"run": run, "rows": rows}) + "\n")
            bodies = sorted(r["t"] for r in rows)
            store_times = sorted(r["start_us"] / 1e6 for r in rows)
            most = most_in_window(bodies, WINDOW_S), most_in_window(store_times, WINDOW_S)
            gaps = [min(b - a for a, b in itertools.pairwise(ts)) * 1e3 for ts in (bodies, store_times)]
            tightest = [min(b - a for a, b in zip(ts, ts[QUOTA:], strict=False)) for ts in (bodies, store_times)]
            span = bodies[-1] - bodies[0]
            failed += most[0] > QUOTA or gaps[0] < 0.99 * INTERVAL_S * 1e3
            late = window_handoffs(bodies)
            freed += late
            print(f"| {run} | {most[0]} / {most[1]} | {tightest[0]:.4f} / {tightest[1]:.4f} s | {gaps[0]:.2f} / "
                  f"{gaps[1]:.2f} ms | {span:.2f} s | {max(late, default=float('nan')):.2f} ms |",
                  flush=True)  # fmt: skip
        store.close()
    print(f"\nSUMMARY window {host}: {args.runs - failed} of {args.runs} runs with at most {QUOTA} bodies in any "
          f"{WINDOW_S:.0f} s and no two closer than {0.99 * INTERVAL_S * 1e3:.1f} ms")  # fmt: skip
    if freed:
        ordered = sorted(freed)
        p50, p99 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(
            f"SUMMARY window {host}: a start that waited for the window began {p50:.2f} ms (p50), {p99:.2f} ms "
            f"(p99) after the start {QUOTA} before it left the window ({len(ordered)} starts, bodies' clock)"
        )


if __name__ == "__main__":
    main()
