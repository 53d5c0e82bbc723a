"""What one deferral costs a worker process in CPU: a delivery whose slot is too far to
sleep for goes back to the broker and ends with Celery's ``Ignore``.

    python bench/deferral_cost.py [--deliveries 2000] [--runs 3]

Each delivery runs through Celery's own tracer (``build_tracer``, as a prefork child runs
it), on an app with the memory broker and a memory store: the task's ticket is 10 s from
its slot, so ``before_start`` defers it (a re-publish with an ETA) and ends the delivery;
what the tracer returns is pickled as a pool child pickles it for its parent. Prints the
median over runs of the CPU time (``time.process_time``) a delivery takes, and the size of
the pickled result: most of it is Celery listing and formatting the Ignore's traceback.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
import uuid

from celery import Celery
from celery.app.trace import build_tracer

from siq_celery import IntervalTask
from siq_celery.messages import ticket_headers


def run(deliveries: int) -> tuple[float, int]:
    app = Celery("deferral-cost", broker="memory://", set_as_current=False)
    app.conf.update(siq_url=f"memory://deferral-cost-{uuid.uuid4().hex[:8]}", task_acks_late=True)

    @app.task(base=IntervalTask, interval="10s", interval_queue="deferral-cost")
    def work(n: int) -> None: ...

    queue = work.siq_queue()
    queue.claim()  # its slot now: every later ticket's is 10 s out or more
    tracer = build_tracer(work.name, work, app=app, eager=False, propagate=False)
    spent: list[float] = []
    size = 0
    for n in range(deliveries):
        headers = ticket_headers(queue.claim())
        request = {
            "id": f"d{n}", "headers": headers, "hostname": "bench@host", "is_eager": False,
            "delivery_info": {"exchange": "", "routing_key": "celery"}, "retries": 0,
        }  # fmt: skip
        began = time.process_time()
        result = tracer(f"d{n}", [n], {}, request)
        size = len(pickle.dumps((1, result[0], 0.0), protocol=pickle.HIGHEST_PROTOCOL))
        spent.append(time.process_time() - began)
        if n % 500 == 499:
            print(f"  {n + 1} deliveries", flush=True)
    app.close()
    return statistics.median(spent) * 1e3, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    medians, sizes = [], []
    for r in range(args.runs):
        median, size = run(args.deliveries)
        print(f"run {r + 1}: {median:.3f} ms of CPU a deferred delivery (median), result pickled {size} bytes")
        medians.append(median)
        sizes.append(size)
    print(f"SUMMARY deferral: {statistics.median(medians):.3f} ms of CPU a deferred delivery "
          f"({min(medians):.3f}-{max(medians):.3f}), result pickled {statistics.median(sizes):.0f} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
