"""Fair shares under real workers: how soon a tenant behind a backlog starts, the shares
by weight, and how late starts come after their slot.

    python bench/fair_workers.py [--runs 3] [--backlog 1000] [--b-after 0] [--busy 0]

3 nodes x ``-c 2`` (prefork) on a private Redis (broker and store), one queue at 50 ms
(``fid.fair`` in bench/fidelity_app.py; tenant "gold" weighs 2). Per run:

* backlog: tenant A publishes ``--backlog`` calls (1,000), then, ``--b-after`` seconds
  later, B publishes 10: the tickets handed out when B began publishing, the last of B's
  tickets, and how many slots B's 10 took;
* shares: gold, B and C publish 200 calls each, interleaved: the shares of the first 300
  starts, and how late those starts came after their slot (store clock).

Each row gives the smallest gap between starts on the store's clock (the authorizations)
and on the bodies' clock (the ``time.time()`` each body records first), and how long after
its authorization a body began. ``--busy 2`` runs two busy loops beside the workers (a
loaded host, bench/load.py). Prints one Markdown table row per run and scenario.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fidelity import bench_env, three_nodes  # noqa: E402
from bench.load import busy, percentiles  # noqa: E402
from siq_celery.backends import backend_from_url  # noqa: E402
from siq_celery.embedded import EmbeddedRedis  # noqa: E402

KEY = "fid:fair"


def wait(record: redis.Redis, done: Any, timeout: float = 120) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = [json.loads(r) for r in record.lrange(KEY, 0, -1)]
        if done(rows):
            return sorted(rows, key=lambda r: r["start_us"])
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out with {len(rows)} starts")
        time.sleep(0.05)


def explain(rows: list[dict[str, Any]], store: Any, late_ms: float = 20.0) -> None:
    """The bodies that began more than ``late_ms`` after their authorization: whether each
    was its process's first, and when its report reached the store (the ledger's began_us)."""
    began = {r.start_us: r.began_us for r in store.ledger("fair")}
    seen: Counter[int] = Counter()
    for r in sorted(rows, key=lambda r: r["t"]):
        seen[r["pid"]] += 1
        after = r["t"] * 1000 - r["start_us"] / 1000
        if after > late_ms:
            b = began.get(r["start_us"])
            report = "no report" if b is None else f"report {(b - r['start_us']) / 1000:.2f} ms after"
            print(
                f"  ticket {r['ticket']} pid {r['pid']} body #{seen[r['pid']]} of its process: "
                f"{after:.2f} ms after its authorization, {report}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=1000, help="tenant A's calls before B's 10")
    parser.add_argument("--b-after", type=float, default=0.0, help="seconds between A's calls and B's")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the workers (a loaded host)")
    parser.add_argument("--scenarios", default="backlog,shares")
    parser.add_argument("--explain", action="store_true", help="list the bodies that began late, with the ledger")
    args = parser.parse_args()
    host = f"{args.busy} busy loops beside" if args.busy else "idle"
    print(f"# fair shares, 3 nodes x -c 2 (prefork), 50 ms, Redis broker and store, {host}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print("| run | scenario | result | smallest gap: store clock / bodies' clock | after the slot: median / p99 / "
          "most | body after its authorization: median / p99 / most |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|", flush=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp, busy(args.busy):
        env = bench_env(server.port)
        from bench.fidelity_app import app

        record = redis.Redis.from_url(env["SIQ_BENCH_RECORD"])
        store = backend_from_url(env["SIQ_BENCH_STORE"])
        fair = app.tasks["fid.fair"]
        for run, scenario in itertools.product(range(1, args.runs + 1), args.scenarios.split(",")):
            try:
                with three_nodes(f"{scenario}{run}-", "fid-fair", Path(tmp), env):
                    if scenario == "backlog":
                        for n in range(args.backlog):
                            fair.delay("A", n)
                        time.sleep(args.b_after)
                        status = store.status("fair")
                        handed = status.state.ticket if status else 0
                        for n in range(10):
                            fair.delay("B", n)
                        rows = wait(record, lambda rs: sum(r["tenant"] == "B" for r in rs) == 10)
                        everything = wait(record, lambda rs: len(rs) == args.backlog + 10)  # the gaps of every start
                        b = sorted(r["ticket"] for r in rows if r["tenant"] == "B")
                        a = [r["n"] for r in sorted(rows, key=lambda r: r["start_us"]) if r["tenant"] == "A"]
                        result = (f"{handed} handed out when B published; B's 10 on tickets {b[0]}-{b[-1]}: within "
                                  f"{b[-1] - handed} slots; A's {len(a)} in order: {a == sorted(a)}")  # fmt: skip
                        rows = everything
                    else:
                        for n in range(200):
                            for tenant in ("gold", "B", "C"):
                                fair.delay(tenant, n)
                        rows = wait(record, lambda rs: len(rs) >= 300)[:300]
                        shares = Counter(r["tenant"] for r in rows)
                        result = f"first 300 starts: gold {shares['gold']}, B {shares['B']}, C {shares['C']}"
                    gaps = [(b["start_us"] - a["start_us"]) / 1000 for a, b in itertools.pairwise(rows)]
                    bodies = sorted(r["t"] for r in rows)
                    body_gaps = [(b - a) * 1000 for a, b in itertools.pairwise(bodies)]
                    late = percentiles([(r["start_us"] - r["slot_us"]) / 1000 for r in rows])
                    after = percentiles([r["t"] * 1000 - r["start_us"] / 1000 for r in rows])
                    print(f"| {run} | {scenario} | {result} | {min(gaps):.3f} / {min(body_gaps):.3f} ms | "
                          f"{' / '.join(f'{x:.2f}' for x in late)} ms | {' / '.join(f'{x:.2f}' for x in after)} ms |",
                          flush=True)  # fmt: skip
                    if args.explain:
                        explain(rows, store)
            finally:
                store.delete("fair")
                record.delete(KEY)
        store.close()


if __name__ == "__main__":
    main()
