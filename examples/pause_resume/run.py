"""Pause and resume a live interval queue, from Python and from the command line.
See README.md beside this file."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from siq_celery.embedded import EmbeddedRedis
from siq_celery.workers import WorkerProcess

HERE = Path(__file__).resolve().parent
PAUSE_S = 1.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="Redis for the broker and the state store (default: a private one)")
    parser.add_argument("--tasks", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        broker = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        os.environ["EXAMPLE_BROKER"] = broker
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        from tasks import STARTS, send_report

        records = redis.Redis.from_url(broker)
        records.delete(STARTS)
        queue = send_report.siq_queue()  # the IntervalQueue behind the task
        queue.ensure(reset=True)
        worker = WorkerProcess("tasks", "reports@example", Path(logs) / "worker.log", concurrency=2, env=env, cwd=HERE)
        stack.callback(worker.stop, 10)
        worker.start().wait_ready()

        def celery_siq(*words: str) -> None:
            command = ["celery", "-A", "tasks", "siq", *words]
            print(f"  $ {' '.join(command)}")
            out = subprocess.run([sys.executable, "-m", *command], cwd=HERE, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stdout + out.stderr)
            print("    " + out.stdout.strip().replace("\n", "\n    "))

        def started() -> list[dict[str, float]]:
            return [json.loads(r) for r in records.lrange(STARTS, 0, -1)]

        def wait_until(count: int) -> None:
            deadline = time.monotonic() + 60
            while len(started()) < count:
                if time.monotonic() > deadline:
                    log = worker.log()[-2000:]
                    raise SystemExit(f"only {len(started())} of {count} tasks started; worker log:\n{log}")
                time.sleep(0.02)

        first = time.time()
        print(f"{args.tasks} tasks in queue 'reports' at 200 ms")
        for n in range(args.tasks):
            send_report.delay(n)
        pauses = []

        wait_until(args.tasks // 4)
        print(f"+{time.time() - first:5.2f} s  paused from Python: send_report.siq_queue().pause()")
        queue.pause()
        paused_at = time.time()
        time.sleep(PAUSE_S)
        print(f"+{time.time() - first:5.2f} s  resumed from the command line:")
        celery_siq("resume", "reports")
        pauses.append((paused_at, time.time()))

        wait_until(args.tasks // 2)
        print(f"+{time.time() - first:5.2f} s  paused from the command line:")
        celery_siq("pause", "reports")
        paused_at = time.time()  # when the command returned, the pause had landed
        celery_siq("status", "reports")
        time.sleep(PAUSE_S)
        print(f"+{time.time() - first:5.2f} s  resumed from Python: send_report.siq_queue().resume()")
        queue.resume()
        pauses.append((paused_at, time.time()))

        wait_until(args.tasks)
        starts = sorted(started(), key=lambda r: r["t"])
    print("starts: " + " ".join(f"{r['t'] - first:.2f}" for r in starts))
    # A start may be authorized an instant before the pause lands: allow 0.2 s after it.
    during = [r for r in starts for begin, end in pauses if begin + 0.2 < r["t"] < end]
    order = [int(r["n"]) for r in starts]
    ok = not during and order == sorted(order) and len(order) == args.tasks
    print(f"{'OK' if ok else 'FAILED'}: {len(starts)} tasks, {len(during)} started while paused, "
          f"{'in' if order == sorted(order) else 'NOT in'} submission order")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
