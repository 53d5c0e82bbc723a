"""The Celery app the integration tests run in real workers.

Configured by environment, so the test process (publisher) and the worker subprocesses
build the same app: ``SIQ_TEST_BROKER``, ``SIQ_TEST_STORE`` (siq_url),
``SIQ_TEST_RECORD`` (Redis URL where bodies record their starts), ``SIQ_TEST_INTERVAL``,
``SIQ_TEST_TRANSPORT`` (JSON broker transport options), ``SIQ_TEST_QUEUE`` (the broker queue),
``SIQ_TEST_HORIZON`` and ``SIQ_TEST_RELEASE_EVERY`` (parking), ``SIQ_TEST_MAX_SLEEP``,
``SIQ_TEST_MARGIN`` (siq_countdown_margin), ``SIQ_TEST_LIMIT_MARGIN`` (siq_default_margin),
``SIQ_TEST_KEY_PREFIX``, ``SIQ_TEST_DECL_TTL``, ``SIQ_TEST_LEASE_TIMEOUT`` and
``SIQ_TEST_STORE_REPLICAS`` (the siq settings of those names), ``SIQ_TEST_CONCURRENCY`` (the cap of ``geo.capped``), and
``SIQ_TEST_CLOCK_JUMP``: ``"+180@3"`` moves this process's wall clock 180 s
ahead 3 s after the app is imported (a host clock jump; see :func:`jump_clock`), and
``SIQ_TEST_REFUSE_REPUBLISHES``: ``"3@30"`` refuses 3 re-publishes of deferrals after 30
(:func:`refuse_republishes`; ``"0@0"`` counts them), ``SIQ_TEST_DEBUG_SIQ`` logs siq_celery at
DEBUG (a line per deferral).
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, signals

from siq_celery import IntervalTask

STARTS = "siq-test:starts"
FINISHES = "siq-test:finishes"
PRERUNS = "siq-test:preruns"  # a task entered its trace (before_start: it may still be waiting)
REPUBLISHES = "siq-test:republishes"  # deferrals and back-offs sent again (SIQ_TEST_REFUSE_REPUBLISHES)
REFUSED = "siq-test:refused"  # ... and those refused
#: The real wall clock, for the records (jump_clock patches time.time, the worker's own).
real_time = time.time


def make_app(env: Mapping[str, str], *, this_process: bool = False) -> Celery:
    """The app ``env`` configures. With ``this_process`` (the module's own app, the one a
    worker imports with ``-A tests.apps.geo``) the faults that patch the whole process are
    installed too: built by the test process as a publisher, the app must never patch it
    (a kombu or Celery patch outlives the test and the records' Redis it reports to)."""
    app = Celery("geo", broker=env.get("SIQ_TEST_BROKER", "redis://127.0.0.1:6379/15"), set_as_current=False)
    app.conf.update(
        siq_url=env.get("SIQ_TEST_STORE"),
        siq_paused_poll=float(env.get("SIQ_TEST_PAUSED_POLL", "0.5")),
        siq_horizon=float(env.get("SIQ_TEST_HORIZON", "600")),
        siq_release_every=float(env.get("SIQ_TEST_RELEASE_EVERY", "1.0")),
        siq_max_sleep=float(env.get("SIQ_TEST_MAX_SLEEP", "0.1")),
        siq_countdown_margin=float(env.get("SIQ_TEST_MARGIN", "0.02")),
        siq_key_prefix=env.get("SIQ_TEST_KEY_PREFIX", "siq"),
        siq_key_idle_expiry=float(env.get("SIQ_TEST_KEY_IDLE", "86400")),
        siq_declaration_ttl=float(env.get("SIQ_TEST_DECL_TTL", "30")),
        broker_transport_options=json.loads(env.get("SIQ_TEST_TRANSPORT", "{}")),
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_serializer="json",
        accept_content=["json"],  # nothing else is ever deserialized
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=int(env.get("SIQ_TEST_PREFETCH", "4")),
        result_backend=env.get("SIQ_TEST_RESULTS") or None,
        task_default_queue=env.get("SIQ_TEST_QUEUE", "celery"),
        siq_metrics_port=int(env["SIQ_TEST_METRICS_PORT"]) if env.get("SIQ_TEST_METRICS_PORT") else None,
        **({"siq_lease_timeout": float(env["SIQ_TEST_LEASE_TIMEOUT"])} if env.get("SIQ_TEST_LEASE_TIMEOUT") else {}),
        siq_store_replicas=int(env.get("SIQ_TEST_STORE_REPLICAS", "0")),
        **({"siq_default_margin": env["SIQ_TEST_LIMIT_MARGIN"]} if env.get("SIQ_TEST_LIMIT_MARGIN") else {}),
    )
    if env.get("SIQ_TEST_CELERY_DEFAULTS"):  # an app that says nothing about durability
        for key in ("task_acks_late", "task_reject_on_worker_lost"):
            del app.conf[key]
    interval = env.get("SIQ_TEST_INTERVAL", "20ms")
    record_url = env.get("SIQ_TEST_RECORD", "redis://127.0.0.1:6379/14")
    clients: dict[int, redis.Redis] = {}

    def recorder() -> redis.Redis:
        pid = os.getpid()  # one client per process: prefork children must not share a socket
        if pid not in clients:
            clients[pid] = redis.Redis.from_url(record_url)
        return clients[pid]

    def note(task: Any, n: int, t: float) -> None:
        headers = task.request.headers or {}
        decision = getattr(task.request, "siq_decision", None)
        recorder().rpush(STARTS, json.dumps({
            "n": n, "t": t, "task_id": task.request.id, "ticket": decision.ticket if decision else None,
            "header_ticket": headers.get("siq_ticket"), "store_start_us": decision.now_us if decision else None,
            "slot_us": decision.slot_us if decision else None, "pid": os.getpid(),
            "node": task.request.hostname, "host": socket.gethostname(), "retries": task.request.retries,
            "queue": task.siq_queue(task.request.args, task.request.kwargs).name,
        }))  # fmt: skip

    def finished(task: Any, n: int) -> None:
        recorder().rpush(FINISHES, json.dumps({"n": n, "t": real_time(), "node": task.request.hostname}))

    if this_process and env.get("SIQ_TEST_DIE_IN_TRANSIT"):
        die_in_transit(int(env["SIQ_TEST_DIE_IN_TRANSIT"]))

    if this_process and env.get("SIQ_TEST_DEBUG_SIQ"):  # each deferral's DEBUG line, for the tests that count them
        logging.getLogger("siq_celery").setLevel(logging.DEBUG)

    if this_process and env.get("SIQ_TEST_REFUSE_REPUBLISHES"):
        refuse_republishes(env["SIQ_TEST_REFUSE_REPUBLISHES"], recorder)

    if this_process and env.get("SIQ_TEST_TRACE_PRERUN"):

        def prerun(sender: Any = None, task_id: str | None = None, args: Any = None, **_: Any) -> None:
            if getattr(sender, "app", None) is app:
                recorder().rpush(PRERUNS, json.dumps({
                    "n": args[0] if args else None, "t": real_time(), "task_id": task_id, "pid": os.getpid(),
                    "node": sender.request.hostname,
                }))  # fmt: skip

        signals.task_prerun.connect(prerun, weak=False)

    @app.task(shared=False, name="geo.record", base=IntervalTask, interval=interval, interval_queue="geo", bind=True)
    def record(self: Any, n: int, work: float = 0.0) -> int:
        t = real_time()
        note(self, n, t)
        if work:
            time.sleep(work)
        recorder().rpush(FINISHES, json.dumps({"n": n, "t": real_time(), "node": self.request.hostname}))
        return n

    @app.task(
        shared=False,
        name="geo.no_retries",
        base=IntervalTask,
        interval=interval,
        interval_queue="geo",
        bind=True,
        max_retries=0,
    )
    def no_retries(self: Any, n: int) -> int:
        note(self, n, real_time())
        return n

    @app.task(shared=False, name="geo.crash", base=IntervalTask, interval=interval, interval_queue="geo", bind=True)
    def crash(self: Any, n: int) -> None:
        """A poison message: its body kills the pool process running it (as running out of
        memory or a segfault in a C extension would), every time it is delivered."""
        note(self, n, real_time())
        os._exit(1)

    @app.task(shared=False, name="geo.total", base=IntervalTask, interval=interval, interval_queue="geo", bind=True)
    def total(self: Any, numbers: list[int]) -> int:
        """A chord's callback: an interval task too, recorded with n = the sum."""
        n = sum(numbers)
        note(self, n, real_time())
        finished(self, n)
        return n

    @app.task(
        shared=False, name="geo.retry_once", base=IntervalTask, interval=interval, interval_queue="geo", bind=True
    )
    def retry_once(self: Any, n: int) -> int:
        note(self, n, real_time())
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return n

    @app.task(shared=False, name="geo.per_key", base=IntervalTask, interval=interval, bind=True,
              interval_queue=lambda args, kwargs: f"shop:{kwargs['shop']}")  # fmt: skip
    def per_key(self: Any, n: int, shop: str, work: float = 0.0) -> int:
        note(self, n, real_time())
        if work:
            time.sleep(work)
        finished(self, n)
        return n

    @app.task(shared=False, name="geo.weighted", base=IntervalTask, interval=interval, interval_queue="geo",
              bind=True, cost=lambda args, kwargs: kwargs.get("cost", 1))  # fmt: skip
    def weighted(self: Any, n: int, cost: int = 1) -> int:
        note(self, n, real_time())
        finished(self, n)
        return n

    @app.task(shared=False, name="geo.call_api", base=IntervalTask, interval=interval, interval_queue="geo",
              bind=True, max_retries=0)  # fmt: skip
    def call_api(self: Any, n: int, url: str) -> int:
        """Calls a rate-limited service; on 429 the whole queue backs off by Retry-After."""
        note(self, n, real_time())
        try:
            with urllib.request.urlopen(f"{url}/call?n={n}", timeout=5) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 429:
                self.siq_backoff(float(exc.headers["Retry-After"]))
            raise
        finished(self, n)
        return n

    # Two limits on one task: 100 ms and "10 per 2 s" (the names share a hash tag, so
    # the pair also works on Redis Cluster); and a task with the first limit alone.
    @app.task(shared=False, name="geo.two_limits", base=IntervalTask, bind=True,
              interval_queue={"{geo}per-second": "100ms", "{geo}per-2s": "10/2s"})  # fmt: skip
    def two_limits(self: Any, n: int) -> int:
        note(self, n, real_time())
        finished(self, n)
        return n

    # Fair shares among tenants of one queue (tenant "gold" weighs 2, others 1); n says
    # the tenant: 100,000 x its index in SIQ_TEST_TENANTS ("A,B,C") + its own count.
    tenants = env.get("SIQ_TEST_TENANTS", "A,B,C").split(",")

    @app.task(shared=False, name="geo.fair", base=IntervalTask, interval=interval, interval_queue="geo", bind=True,
              fair_key=lambda args, kwargs: tenants[args[0] // 100_000],
              fair_weight=lambda key: 2 if key == "gold" else 1)  # fmt: skip
    def fair(self: Any, n: int, work: float = 0.0) -> int:
        note(self, n, real_time())
        if work:
            time.sleep(work)
        finished(self, n)
        return n

    # The limits page's "10 a second and 10,000 a day", scaled: one start per 50 ms and at most 50
    # starts in any 10 s window (SIQ_TEST_QUOTA).
    @app.task(shared=False, name="geo.windowed", base=IntervalTask, bind=True, interval="50ms",
              quota=env.get("SIQ_TEST_QUOTA", "50/10s"), interval_queue="{geo}windowed")  # fmt: skip
    def windowed(self: Any, n: int) -> int:
        note(self, n, real_time())
        finished(self, n)
        return n

    # "No more than 3 concurrent requests" (SIQ_TEST_CONCURRENCY): no spacing of its own.
    @app.task(shared=False, name="geo.capped", base=IntervalTask, bind=True,
              concurrency=int(env.get("SIQ_TEST_CONCURRENCY", "3")), interval_queue="{geo}capped")  # fmt: skip
    def capped(self: Any, n: int, work: float = 0.0) -> int:
        note(self, n, real_time())
        if work:
            time.sleep(work)
        finished(self, n)
        return n

    @app.task(shared=False, name="geo.one_limit", base=IntervalTask, bind=True,
              interval_queue="{geo}per-second", interval="100ms")  # fmt: skip
    def one_limit(self: Any, n: int) -> int:
        note(self, n, real_time())
        finished(self, n)
        return n

    return app


def die_in_transit(n: int) -> None:
    """The node (its whole process group) SIGKILLs itself when it has taken task ``n``'s
    message from the Redis broker (BRPOP's reply read) and is about to hold it in the
    unacked hash: the window in which kombu alone loses a message (broker/transit.py)."""
    from kombu.transport import redis as transport

    from siq_celery.broker.transit import guard_transit

    guard_transit()
    hold = transport.QoS.append

    def append(self: Any, message: Any, delivery_tag: str) -> None:
        raw = message._raw
        try:
            encoded = raw["properties"]["body_encoding"] == "base64"
            args = json.loads(base64.b64decode(raw["body"]))[0] if encoded else []
        except (ValueError, KeyError, TypeError, IndexError):
            args = []
        if args and args[0] == n:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        hold(self, message, delivery_tag)

    transport.QoS.append = append


def refuse_republishes(spec: str, recorder: Any) -> None:
    """``"3@30"``: of the re-publishes of deferrals and back-offs (counted across every
    process in the records' Redis), the 31st to the 33rd raise kombu's OperationalError, as
    a broker that refuses a publish (after kombu's own retries) makes them."""
    from celery.canvas import Signature
    from kombu.exceptions import OperationalError

    from siq_celery.messages import KEEP_TICKET

    count_text, _, after_text = spec.partition("@")
    first, last = int(after_text) + 1, int(after_text) + int(count_text)
    apply_async = Signature.apply_async

    def refusing(self: Signature, *args: Any, **options: Any) -> Any:
        if options.get(KEEP_TICKET):
            n = recorder().incr(REPUBLISHES)
            if first <= n <= last:
                recorder().rpush(REFUSED, json.dumps({"n": n, "task_id": self.options.get("task_id")}))
                raise OperationalError(f"re-publish {n} refused by the broker (test)")
        return apply_async(self, *args, **options)

    Signature.apply_async = refusing  # type: ignore[method-assign]


def jump_clock(spec: str) -> None:
    """Patch this process's wall-clock sources so that, ``after`` seconds from now, they
    read ``offset`` seconds off the real time (``spec``: ``"+180@3"``, ``"-120@2"``): what
    a host sees when NTP or an operator steps its clock. Patched: ``time.time`` (and
    ``time_ns``), kombu's timer (Celery's ETA scheduling) and Celery's ``app.now``
    (monotonic clocks do not jump, as on a real host)."""
    import kombu.asynchronous.timer as kombu_timer
    from celery.app import base as celery_base

    offset_text, _, after_text = spec.partition("@")
    offset, after = float(offset_text), float(after_text or 0)
    real_time_ns, since = time.time_ns, time.monotonic()

    def skew() -> float:
        return offset if time.monotonic() - since >= after else 0.0

    time.time = lambda: real_time() + skew()
    time.time_ns = lambda: real_time_ns() + int(skew() * 1e9)
    kombu_timer._time = time.time  # imported by name into kombu's timer: patch it there too
    real_now = celery_base.Celery.now

    def now(self: Celery) -> Any:
        return real_now(self) + datetime.timedelta(seconds=skew())

    celery_base.Celery.now = now  # type: ignore[method-assign]


if os.environ.get("SIQ_TEST_CLOCK_JUMP"):
    jump_clock(os.environ["SIQ_TEST_CLOCK_JUMP"])
if os.environ.get("SIQ_TEST_KOMBU_LACKS"):  # "Class.attribute" of kombu's Redis transport, deleted
    from kombu.transport import redis as _transport

    _owner, _attribute = os.environ["SIQ_TEST_KOMBU_LACKS"].split(".")
    delattr(getattr(_transport, _owner), _attribute)
app = make_app(os.environ, this_process=True)
