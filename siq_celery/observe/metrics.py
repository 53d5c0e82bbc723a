"""Prometheus metrics of interval queues, read from the state store (``siq exporter``).

Leaderless and read-only: the collector reads each queue's status when it is scraped
(one pipelined read of many queues) and writes nothing. Any number may run, and none is
needed for the queues to work. Gauges come from the queue state at scrape time; counters
and the lateness histogram from the counters the store keeps itself, incremented in the
same atomic step as each start (rules.start_counts). So every exporter reads the same
values, a restarted one carries on where the others are, nothing reads a ledger, and a
trimmed ledger lowers nothing.

Serving it (the HTTP server, one scrape as text) is observe/metrics_http.py; the readings derived
from a status that siq top shows too are observe/readings.py.

Labels are bounded: one ``queue`` label, and at most ``max_queues`` queues exported (by
name; the others are counted in ``siq_queues_left_out``); a fair queue's keys with the most
waiting add a ``key`` label, at most ``fair_top`` per queue (a key that drops out of them,
or whose line empties, drops out of the next scrape). A queue whose state expired
(an idle per-key queue) drops out of the next scrape. An unreachable store makes
``siq_up`` 0 and logs a line; a queue whose state cannot be read counts an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends import Backend
from ..errors import SiqError
from ..parked import FairBacklog
from ..rules import LATENESS_BUCKETS_US
from ..types import QueueStatus
from .readings import drain_seconds, held_until

log = logging.getLogger("siq_celery.metrics")

US = 1_000_000
#: The lateness histogram's bounds in seconds (the store counts in rules.LATENESS_BUCKETS_US).
LATENESS_BUCKETS = tuple(bound / US for bound in LATENESS_BUCKETS_US)
DEFAULT_MAX_QUEUES = 1000
#: Keys of each fair queue exported with their backlog (siq_fair_key_waiting): those with the most waiting.
DEFAULT_FAIR_TOP = 10


@dataclass
class Scrape:
    """One reading of the store: the statuses of the queues exported, and what failed."""

    statuses: list[QueueStatus]
    up: bool
    left_out: int
    seconds: float
    #: per queue with tasks waiting in fair lines, who waits (Backend.fair_backlog)
    fair: dict[str, FairBacklog] = field(default_factory=dict)

    def fair_of(self, st: QueueStatus) -> FairBacklog:
        """The queue's fair backlog: as read, else the status's counts (none waiting, or a
        read that failed)."""
        return self.fair.get(st.queue) or FairBacklog(st.fair_keys, st.fair_tasks)


class StoreCollector:
    """A ``prometheus_client`` collector of every queue matching ``patterns``."""

    def __init__(
        self,
        backend: Backend,
        patterns: Sequence[str] = ("*",),
        max_queues: int = DEFAULT_MAX_QUEUES,
        clock: Callable[[], float] = time.monotonic,
        fair_top: int = DEFAULT_FAIR_TOP,
    ) -> None:
        if max_queues < 1:
            raise ValueError(f"max_queues must be at least 1, not {max_queues}")
        if fair_top < 0:
            raise ValueError(f"fair_top must be 0 or more, not {fair_top}")
        #: Glob patterns or names of the queues exported; none: no queue (never all of them).
        self.patterns = tuple(patterns)
        self.backend, self.max_queues, self._clock = backend, max_queues, clock
        #: Keys of each fair queue exported with their backlog, the most waiting first.
        self.fair_top = fair_top
        self._errors: dict[str, int] = {}
        self._left_out_total = 0
        self._lock = threading.Lock()

    def scrape(self) -> Scrape:
        """Read the store once: the status (state and counters) of each queue exported."""
        started = self._clock()
        try:
            names = sorted({q for p in self.patterns for q in self._names(p)})
        except SiqError as exc:  # unreachable, or refused (a permission): nothing read
            log.warning("siq exporter: %s", exc)
            return Scrape([], False, 0, self._clock() - started)
        kept, left_out = names[: self.max_queues], max(0, len(names) - self.max_queues)
        self._left_out_total += left_out
        for gone in set(self._errors) - set(kept):  # expired or deleted: its series goes with it
            del self._errors[gone]
        statuses: list[QueueStatus] = []
        try:
            read = self.backend.statuses(kept)
        except SiqError as exc:
            log.warning("siq exporter: %s", exc)
            return Scrape([], False, left_out, self._clock() - started)
        for name, st in zip(kept, read, strict=True):
            if st is None:  # expired since it was listed (an idle per-key queue)
                continue
            if isinstance(st, SiqError):  # a corrupt state: counted, and the other queues go on
                log.warning("siq exporter: queue %r: %s", name, st)
                self._errors[name] = self._errors.get(name, 0) + 1
                continue
            statuses.append(st)
        return Scrape(statuses, True, left_out, self._clock() - started, self._fair(statuses))

    def _fair(self, statuses: Sequence[QueueStatus]) -> dict[str, FairBacklog]:
        """Who waits most in the fair lines of the queues that have tasks waiting there (a
        read per such queue; the others cost nothing). A read that fails leaves the status's
        counts, with no keys."""
        fair: dict[str, FairBacklog] = {}
        for st in statuses:
            if st.fair_tasks:
                try:
                    fair[st.queue] = self.backend.fair_backlog(st.queue, self.fair_top)
                except SiqError as exc:
                    log.warning("siq exporter: queue %r: fair backlog: %s", st.queue, exc)
        return fair

    def _names(self, pattern: str) -> list[str]:
        return self.backend.queues(pattern) if any(c in pattern for c in "*?[") else [pattern]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            s = self.scrape()

            def gauge(name: str, doc: str, values: Iterable[tuple[str, float]]) -> GaugeMetricFamily:
                g = GaugeMetricFamily(name, doc, labels=["queue"])
                for queue, value in values:
                    g.add_metric([queue], value)
                return g

            def counter(name: str, doc: str, values: Iterable[tuple[str, float]]) -> CounterMetricFamily:
                c = CounterMetricFamily(name, doc, labels=["queue"])
                for queue, value in values:
                    c.add_metric([queue], value)
                return c

            yield GaugeMetricFamily("siq_up", "1 if the state store answered the last scrape, else 0", value=int(s.up))
            yield GaugeMetricFamily("siq_scrape_duration_seconds", "Time to read the store for this scrape",
                                    value=s.seconds)  # fmt: skip
            yield GaugeMetricFamily("siq_queues", "Interval queues exported", value=len(s.statuses))
            yield GaugeMetricFamily("siq_queues_left_out", "Queues matched but not exported (over --max-queues)",
                                    value=s.left_out)  # fmt: skip
            sts = s.statuses
            yield gauge("siq_queue_interval_seconds", "Effective start interval",
                        ((st.queue, st.state.interval_us / US) for st in sts))  # fmt: skip
            yield gauge("siq_queue_declared_interval_seconds", "Interval the code declares (where one is declared)",
                        ((st.queue, st.sources.declared_us / US) for st in sts if st.sources.declared_us))  # fmt: skip
            yield gauge("siq_queue_backlog_tickets", "Tickets claimed and not yet passed",
                        ((st.queue, st.state.backlog) for st in sts))  # fmt: skip
            yield gauge("siq_queue_parked_tasks", "Tasks parked in the store beyond the horizon",
                        ((st.queue, st.parked) for st in sts))  # fmt: skip
            yield gauge(
                "siq_queue_paused", "1 while the queue is paused", ((st.queue, int(st.state.paused)) for st in sts)
            )
            yield gauge("siq_queue_next_slot_seconds", "Seconds until the next start could be authorized",
                        ((st.queue, max(0, st.next_start_us - st.now_us) / US) for st in sts))  # fmt: skip
            yield gauge("siq_queue_backed_off_until_timestamp_seconds",
                        "Unix time the queue is held until by a back-off (0: not held)",
                        ((st.queue, held_until(st) / US) for st in sts))  # fmt: skip
            yield gauge("siq_in_flight", "Bodies running now under a concurrency cap (its live leases)",
                        ((st.queue, st.in_flight) for st in sts if st.state.concurrency))  # fmt: skip
            yield gauge("siq_queue_concurrency", "The queue's concurrency cap (where it has one)",
                        ((st.queue, st.state.concurrency) for st in sts if st.state.concurrency))  # fmt: skip
            yield gauge("siq_queue_drain_seconds", "Estimated seconds until the backlog has started",
                        ((st.queue, drain_seconds(st)) for st in sts))  # fmt: skip
            yield gauge("siq_queue_quota_units", "A window quota's cost units per window (queues with a quota)",
                        ((st.queue, st.state.quota) for st in sts if st.state.quota))  # fmt: skip
            yield gauge("siq_queue_quota_window_seconds", "A window quota's window (queues with a quota)",
                        ((st.queue, st.state.window_us / US) for st in sts if st.state.quota))  # fmt: skip
            yield gauge("siq_queue_quota_used_units", "Cost units started in the window ending now",
                        ((st.queue, st.window_used) for st in sts if st.state.quota))  # fmt: skip
            yield gauge("siq_queue_burst", "Starts that may come closer than the interval (queues with a burst)",
                        ((st.queue, st.state.burst) for st in sts if st.state.burst))  # fmt: skip
            yield gauge("siq_fair_keys_waiting", "Fairness keys with tasks waiting in their lines (fair shares)",
                        ((st.queue, s.fair_of(st).keys_waiting) for st in sts))  # fmt: skip
            yield gauge("siq_fair_tasks_waiting", "Tasks waiting in fair lines, with no ticket yet (fair shares)",
                        ((st.queue, s.fair_of(st).tasks_waiting) for st in sts))  # fmt: skip
            keys = GaugeMetricFamily("siq_fair_key_waiting", "Tasks waiting in the line of each of the fairness "
                                     "keys with the most waiting (at most --fair-top per queue)",
                                     labels=["queue", "key"])  # fmt: skip
            for st in sts:
                for key, waiting, _ in s.fair_of(st).top:
                    keys.add_metric([st.queue, key], waiting)
            yield keys
            epochs = GaugeMetricFamily("siq_queue_epoch_info", "The queue's current epoch", labels=["queue", "epoch"])
            for st in sts:
                epochs.add_metric([st.queue, st.state.epoch], 1)
            yield epochs
            yield counter("siq_starts_total", "Authorized starts, counted by the store",
                          ((st.queue, st.counts.starts) for st in sts))  # fmt: skip
            yield counter("siq_deferrals_total", "Times started tasks were sent back to wait before they started",
                          ((st.queue, st.counts.deferrals) for st in sts))  # fmt: skip
            yield counter("siq_gaps_below_interval_total",
                          "Starts less than the interval (minus 1 ms) after the one before: expected 0",
                          ((st.queue, st.counts.gaps_below_interval) for st in sts))  # fmt: skip
            yield counter("siq_duplicates_refused_total",
                          "Starts refused because the task id had already finished (a redelivered copy)",
                          ((st.queue, st.duplicates_refused) for st in sts))  # fmt: skip
            yield counter("siq_reclaims_total", "Starts answered reclaim: their ticket's epoch was gone",
                          ((st.queue, st.reclaims) for st in sts))  # fmt: skip
            yield counter("siq_queue_errors_total", "Scrapes that could not read the queue's state",
                          sorted(self._errors.items()))  # fmt: skip
            yield CounterMetricFamily("siq_queues_left_out_total", "Queue readings skipped over --max-queues",
                                      value=self._left_out_total)  # fmt: skip
            late = HistogramMetricFamily("siq_start_lateness_seconds", "Authorized starts' lateness against their slot",
                                         labels=["queue"])  # fmt: skip
            for st in sts:
                running, buckets = 0, []
                for bound, n in zip((*map(str, LATENESS_BUCKETS), "+Inf"), st.counts.lateness_buckets, strict=True):
                    running += n
                    buckets.append((bound, running))
                late.add_metric([st.queue], buckets, st.counts.lateness_sum_us / US)
            yield late
