"""Interval tasks in a real Flower: see README.md beside this file."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from siq_celery.embedded import EmbeddedRedis, free_port
from siq_celery.workers import FlowerProcess, WorkerProcess

HERE = Path(__file__).resolve().parent


def flower_api(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f"{t % 1:.3f}"[1:]


def wait_for_success(url: str, ids: list[str], timeout: float = 60) -> dict[str, Any]:
    """What Flower's API says of each task, once all succeeded (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        tasks = {t: flower_api(f"{url}/api/task/info/{t}") for t in ids}
        if all(info["state"] == "SUCCESS" for info in tasks.values()) or time.monotonic() > deadline:
            return tasks
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="Redis for broker, results and state store (default: a private one)")
    parser.add_argument("--port", type=int, help="Flower's port (default: a free one)")
    parser.add_argument("--keep-open", action="store_true", help="leave Flower running until Ctrl-C")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        broker = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        os.environ["EXAMPLE_BROKER"] = broker
        env = {
            **os.environ,
            "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "FLOWER_UNAUTHENTICATED_API": "true",  # lets this script use Flower's HTTP API; not for production
        }
        from tasks import geocode

        queue = geocode.siq_queue()
        queue.ensure(reset=True)
        flower = FlowerProcess("tasks", args.port or free_port(), Path(logs) / "flower.log", env=env, cwd=HERE)
        stack.callback(flower.stop, 10)
        flower.start().wait_ready()
        worker = WorkerProcess("tasks", "geo@example", Path(logs) / "worker.log", concurrency=2, env=env, cwd=HERE)
        stack.callback(worker.stop, 10)
        worker.start().wait_ready()
        print(f"Flower on {flower.url}, one worker (-c 2), interval queue 'geocoder' at 200 ms")

        ids = [geocode.delay(f"street {n}").id for n in range(4)]
        ids += [
            flower_api(f"{flower.url}/api/task/async-apply/tasks.geocode", {"args": [f"via Flower {n}"], "timeout": 0})[
                "task-id"
            ]
            for n in range(2)
        ]
        wait_for_success(flower.url, ids)
        queue.pause()
        paused = geocode.delay("while paused").id
        time.sleep(1.5)
        paused_state = flower_api(f"{flower.url}/api/task/info/{paused}")["state"]
        queue.resume(grace=0.5)
        ids.append(paused)
        tasks = wait_for_success(flower.url, ids)
        print(f"{'task':<16} {'state':<8} {'ETA (slot - 20 ms)':<19} {'started':<12}")
        for info in tasks.values():
            eta = clock(datetime.fromisoformat(info["eta"]).timestamp()) if info["eta"] else "-"
            print(f"{info['args'].strip('()[],')[1:-1]:<16} {info['state']:<8} {eta:<19} {clock(info['started'])}")
        print(f"the paused task, 1.5 s into the pause: {paused_state}")
        ok = all(info["state"] == "SUCCESS" for info in tasks.values()) and paused_state == "DEFERRED"
        print("OK: every task SUCCESS, the paused one DEFERRED meanwhile" if ok else "FAILED")
        if args.keep_open:
            print(f"open {flower.url} (Ctrl-C to stop)")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
