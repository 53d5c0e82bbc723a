"""A long-lived process that sees 100,000 keys of a per-key queue keeps bounded caches:
its memory after 100,000 keys is within 20 MB of its memory after 1,000."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The per-key path of a publish and a worker, minus the store round trips: the task's
# queue for the call's key (SiqState), the store client's idle expiry of it (Backend), the
# release throttle's note of it (parking), the pool process's renewals of its declaration
# (PerKeyDeclarations); and what watches the keys come and go: the exporter's errors per
# queue (StoreCollector, whose store here lists one key at a time, its state unreadable)
# and siq top's readings for the rate and the lateness (QueueRates, RecentLateness). Each
# used to keep every key for ever.
SCRIPT = textwrap.dedent("""
    import gc, logging, sys
    from celery import Celery
    from siq_celery import IntervalTask
    from siq_celery.tasks.declarations import PerKeyDeclarations
    from siq_celery.errors import CorruptStateError
    from siq_celery.observe.metrics import StoreCollector
    from siq_celery.tasks.parking import _RELEASE_THROTTLE
    from siq_celery.client.queue import IntervalQueue
    from siq_celery.observe.top import QueueRates, RecentLateness
    from siq_celery.types import Declared, IntervalSources, QueueState, QueueStatus

    IntervalQueue.declare = lambda self, **_: Declared(True, 0, 0, 0, 0)  # the store's side is not measured
    logging.disable(logging.WARNING)  # the exporter's line per unreadable queue

    class Store:  # lists the one key of the moment, whose state cannot be read
        name = ""
        def queues(self, pattern):
            return [self.name]
        def statuses(self, names):
            return [CorruptStateError(n, "", "interval_us", "fast") for n in names]
        def starts_since(self, since):
            return {}

    app = Celery("keys", set_as_current=False)
    app.conf.update(siq_url="memory://key-memory")

    @app.task(base=IntervalTask, interval="100ms", shared=False,
              interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}")
    def call(shop): ...

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    declarations, store, rates, recent = PerKeyDeclarations(30.0), Store(), QueueRates(), RecentLateness()
    collector = StoreCollector(store, ("shop:*",))
    marks = {}
    for n in range(100_000):
        queue = call.siq_queue([], {"shop": n})
        queue.backend.idle_expiry_us(queue.name)
        _RELEASE_THROTTLE.due(queue.name)
        declarations.on_use(queue, "node@host")
        store.name = queue.name
        collector.scrape()
        shown = [QueueStatus(queue.name, QueueState("e", 100_000, 0, 0, 0, 0, False), n, 0, 0, IntervalSources())]
        rates.rate(queue.name, n, 0)
        rates.keep_only([queue.name])
        recent.read(store, shown)
        if n + 1 in (1_000, 100_000):
            gc.collect()
            marks[n + 1] = rss_kib()
    print(marks[1_000], marks[100_000])
""")


def test_a_hundred_thousand_keys_cost_no_more_than_a_thousand() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    at_1k, at_100k = (int(v) for v in result.stdout.split())
    print(f"\nRSS after 1,000 keys {at_1k / 1024:.1f} MB, after 100,000 keys {at_100k / 1024:.1f} MB")
    assert at_100k - at_1k < 20 * 1024


def test_a_key_in_use_keeps_its_idle_expiry_whatever_the_client_forgot() -> None:
    from celery import Celery

    from siq_celery import IntervalTask
    from siq_celery.backends.base import IDLE_EXPIRY_REMEMBERED

    app = Celery("keys-in-use", set_as_current=False)
    app.conf.update(siq_url="memory://keys-in-use", siq_key_idle_expiry=3600)

    @app.task(base=IntervalTask, interval="100ms", shared=False,
              interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}")  # fmt: skip
    def call(shop: str) -> None: ...

    queue = call.siq_queue([], {"shop": "a"})
    backend = queue.backend
    assert backend.idle_expiry_us("shop:a") == 3_600_000_000
    for n in range(IDLE_EXPIRY_REMEMBERED):  # other keys push it out of the client's memory
        backend.expire_when_idle(f"other:{n}", 1_000_000)
    assert backend.idle_expiry_us("shop:a") == 0
    assert call.siq_queue([], {"shop": "a"}) is queue  # the same cached queue, and again expiring
    assert backend.idle_expiry_us("shop:a") == 3_600_000_000
