"""The problem and the fix side by side: the same API calls from several Celery workers,
limited by siq_celery and by Celery's own ``rate_limit``. See README.md beside this file."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from service import LimitedService

from siq_celery.embedded import EmbeddedRedis
from siq_celery.workers import WorkerProcess

HERE = Path(__file__).resolve().parent


def counts(service: LimitedService, caller: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{service.url}/stats", timeout=10) as reply:
        return dict(json.loads(reply.read()).get(caller, {}))


def run_batch(service: LimitedService, task: object, caller: str, calls: int) -> tuple[int, int, float]:
    """Submit ``calls`` tasks; wait until the service has answered them all."""
    started = time.monotonic()
    for n in range(calls):
        task.delay(n)  # type: ignore[attr-defined]
    deadline = started + 60 + calls
    while True:
        answered = counts(service, caller)
        if sum(answered.values()) >= calls:
            return answered.get("200", 0), answered.get("429", 0), time.monotonic() - started
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: the service answered {answered} of {calls} calls from {caller}")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="Redis for the broker and the state store (default: a private one)")
    parser.add_argument("--workers", type=int, default=2, help="worker nodes (default 2)")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per node (default 2)")
    parser.add_argument("--calls", type=int, default=30, help="calls with each limiter (default 30)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        broker = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        service = LimitedService().start_in_background()
        os.environ.update(EXAMPLE_BROKER=broker, EXAMPLE_API_URL=service.url)
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        from tasks import call_with_rate_limit, call_with_siq

        call_with_siq.siq_queue().ensure(reset=True)  # a fresh line for this run
        workers = [
            WorkerProcess("tasks", f"node{i}@example", Path(logs) / f"node{i}.log",
                          concurrency=args.concurrency, env=env, cwd=HERE)
            for i in range(args.workers)
        ]  # fmt: skip
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            print(f"pretend API: 1 request per 100 ms, 429 otherwise; {args.workers} workers x -c {args.concurrency}, "
                  f"{args.calls} calls with each limiter", flush=True)  # fmt: skip
            rejected_with_siq = -1
            for label, task, caller in (
                ("siq_celery IntervalTask, interval 100ms", call_with_siq, "siq_celery"),
                ('Celery rate_limit="10/s"', call_with_rate_limit, "celery_rate_limit"),
            ):
                time.sleep(0.2)  # the API's window is clear before each batch
                ok, rejected, took = run_batch(service, task, caller, args.calls)
                if task is call_with_siq:
                    rejected_with_siq = rejected
                print(f"{label:<42} {ok:3d} x 200  {rejected:3d} x 429  in {took:4.1f} s", flush=True)
        finally:
            for w in workers:
                w.stop(timeout=10)
            service.shutdown()
    ok = rejected_with_siq == 0
    print("OK: siq_celery kept the API's limit" if ok else f"FAILED: {rejected_with_siq} x 429 with siq_celery")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
