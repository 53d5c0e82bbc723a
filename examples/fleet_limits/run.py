"""Per-key queues, a weighted task, two limits on one task and a back-off on 429, on one
worker (-c 4) and a private Redis. See README.md beside this file."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

from siq_celery.embedded import EmbeddedRedis
from siq_celery.workers import WorkerProcess

HERE = Path(__file__).resolve().parent


class Api(BaseHTTPRequestHandler):
    """Answers 429 with Retry-After: 1 to its 5th call, 200 otherwise."""

    calls = 0

    def do_GET(self) -> None:
        Api.calls += 1
        self.send_response(429 if Api.calls == 5 else 200)
        if Api.calls == 5:
            self.send_header("Retry-After", "1")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def gaps_ms(times: list[float]) -> list[float]:
    """Gaps between bodies, on this host's clock (seconds in, ms out)."""
    return [(b - a) * 1000 for a, b in itertools.pairwise(sorted(times))]


def store_gaps_ms(rows: list[dict[str, Any]]) -> list[float]:
    """Gaps between authorized starts, on the store's clock (exact microseconds): what
    the limits guarantee."""
    return [(b - a) / 1000 for a, b in itertools.pairwise(sorted(r["authorized_us"] for r in rows))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="Redis for the broker and the state store (default: a private one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        broker = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        os.environ["EXAMPLE_BROKER"] = broker
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        from tasks import STARTS, build_report, call_api, geocode, search, sync_orders

        records = redis.Redis.from_url(broker)
        records.delete(STARTS)
        worker = WorkerProcess("tasks", "limits@example", Path(logs) / "worker.log", concurrency=4, env=env, cwd=HERE)
        stack.callback(worker.stop, 10)
        worker.start().wait_ready()
        api = ThreadingHTTPServer(("127.0.0.1", 0), Api)
        stack.callback(api.server_close)
        stack.callback(api.shutdown)
        threading.Thread(target=api.serve_forever, daemon=True).start()

        def started(task: str, count: int) -> list[dict[str, Any]]:
            deadline = time.monotonic() + 60
            while True:
                rows = [json.loads(r) for r in records.lrange(STARTS, 0, -1)]
                rows = [r for r in rows if r["task"] == task]
                if len(rows) >= count:
                    return rows
                if time.monotonic() > deadline:
                    raise SystemExit(f"{len(rows)} of {count} {task} started; worker log:\n{worker.log()[-2000:]}")
                time.sleep(0.05)

        sync_orders.apply_many([((), {"shop": f"shop-{n % 100}"}) for n in range(300)])
        by_shop: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in started("sync_orders", 300):
            by_shop[row["shop"]].append(row)
        smallest = min(min(store_gaps_ms(rows)) for rows in by_shop.values())
        bodies = min(min(gaps_ms([r["t"] for r in rows])) for rows in by_shop.values())
        status = subprocess.run([sys.executable, "-m", "celery", "-A", "tasks", "siq", "status", "shop:*"],
                                cwd=HERE, env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
        print(
            f"per-key:     300 calls over {len(by_shop)} shops at 200 ms each: smallest gap within a shop "
            f"{smallest:.3f} ms between authorized starts (store clock; {bodies:.1f} ms between bodies, host "
            f"clock); `celery -A tasks siq status 'shop:*'` lists {len(status.splitlines()) - 1}"
        )

        for n, points in enumerate([3, 1, 3, 1]):
            search.delay(n, points=points)
        rows = sorted(started("search", 4), key=lambda r: r["authorized_us"])
        spaced = [(b["authorized_us"] - a["authorized_us"]) / 1000 for a, b in itertools.pairwise(rows)]
        weighted_ok = all(gap >= 50 * a["points"] for gap, a in zip(spaced, rows, strict=False))
        after = [f"{gap:.0f} ms after cost {a['points']}" for gap, a in zip(spaced, rows, strict=False)]
        print(f"weighted:    50 ms a point: {', '.join(after)} (store clock)")

        for n in range(12):
            geocode.delay(n)
        rows = started("geocode", 12)
        authorized = [r["authorized_us"] for r in rows]
        most = max(sum(1 for t in authorized if a <= t < a + 2_000_000) for a in authorized)
        print(
            f"two limits:  100 ms and 5 per 2 s: smallest gap {min(store_gaps_ms(rows)):.0f} ms, "
            f"at most {most} starts in any 2 s (store clock)"
        )

        url = f"http://127.0.0.1:{api.server_address[1]}/"
        for n in range(10):
            call_api.delay(n, url)
        longest = max(store_gaps_ms(started("call_api", 10)))
        print(
            f"back-off:    a 429 with Retry-After: 1 on the 5th call: longest gap {longest:.0f} ms (store clock), "
            f"{Api.calls} calls for 10 tasks, no retry used"
        )

        for n in range(100):
            build_report.delay(n, tenant="big")
        for n in range(5):
            build_report.delay(n, tenant="small")
        rows = sorted(started("build_report", 40), key=lambda r: r["authorized_us"])
        small_at = [i for i, r in enumerate(rows) if r["tenant"] == "small"]
        big = [r["n"] for r in rows if r["tenant"] == "big"]
        fair_ok = len(small_at) == 5 and small_at[-1] < 20 and big == sorted(big)
        print(
            f"fair shares: 5 calls of a tenant behind another's 100 started {', '.join(map(str, small_at))} of "
            f"the first 40 (big's in order: {big == sorted(big)}); smallest gap {min(store_gaps_ms(rows)):.0f} ms"
        )

        # The limits hold between authorized starts on the store's clock, exactly; bodies,
        # timed on this host, start a round trip later, so their gaps vary by that much.
        ok = smallest >= 200 and weighted_ok and most <= 5 and longest >= 1000 and Api.calls == 11 and fair_ok
        print("OK: every limit held" if ok else "FAILED: a limit did not hold")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
