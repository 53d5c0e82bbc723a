"""Run many OS processes through one interval queue and measure what happened.

Used by the many-process tests, ``make bench`` and the standalone demo. Each process
makes ``calls`` ``with queue.slot()`` calls and records, inside the body, its wall time;
the store's authorized start time and slot come from the decision.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from typing import Any

from .client.queue import IntervalQueue

ARRIVAL_SPREAD_S = 0.002


@dataclass(frozen=True)
class StartRecord:
    process: int
    call: int
    ticket: int
    store_start_us: int  #: authorized start, store clock
    slot_us: int  #: the slot it was measured against, store clock
    body_time: float  #: time.time() at the top of the body, this host's clock


def _worker(index: int, url: str, queue: str, interval: str, calls: int, line: Any, out: Any) -> None:
    q = IntervalQueue(queue, url=url, interval=interval)
    q.status()  # connected and imported before the start line
    records = []
    line.wait()  # everyone starts together...
    # ...arriving a little apart, as real workers do: eight interpreters leaving one
    # barrier in the same millisecond on two cores delay the first reply by milliseconds.
    time.sleep(index * ARRIVAL_SPREAD_S)
    for call in range(calls):
        with q.slot() as d:
            body_time = time.time()
        records.append(StartRecord(index, call, d.ticket, d.now_us, d.slot_us, body_time))
    line.wait()  # ...and nobody exits (interpreter teardown takes CPU) while others still start
    q.close()
    out.put(records)


def run_slot_processes(
    url: str, queue: str, interval: str, *, processes: int = 8, calls: int = 50, timeout: float = 300.0
) -> list[StartRecord]:
    """Start ``processes`` processes, release them together, return every start record."""
    IntervalQueue(queue, url=url, interval=interval).ensure(reset=True)
    ctx = mp.get_context("spawn")  # no inherited connections or locks
    line, out = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(i, url, queue, interval, calls, line, out)) for i in range(processes)]
    for w in workers:
        w.start()
    records: list[StartRecord] = []
    deadline = time.monotonic() + timeout
    for _ in workers:
        records += out.get(timeout=max(deadline - time.monotonic(), 1.0))
    for w in workers:
        w.join(10)
    return records


@dataclass(frozen=True)
class Summary:
    starts: int
    span_s: float
    achieved_pct: float  #: achieved rate as a percentage of 1/interval
    min_store_gap_ms: float
    min_body_gap_ms: float
    store_gaps_below_interval: int
    lateness_p50_ms: float
    lateness_p99_ms: float
    order_inversions: int  #: starts whose ticket is lower than an earlier start's


def summarize(records: list[StartRecord], interval_us: int) -> Summary:
    by_store = sorted(records, key=lambda r: r.store_start_us)
    store = [r.store_start_us for r in by_store]
    body = sorted(r.body_time for r in records)
    store_gaps = [b - a for a, b in itertools.pairwise(store)]
    body_gaps = [b - a for a, b in itertools.pairwise(body)]
    lateness = sorted((r.store_start_us - r.slot_us) / 1000 for r in records)
    span_us = store[-1] - store[0]
    highest, inversions = 0, 0
    for r in by_store:
        if r.ticket < highest:
            inversions += 1
        highest = max(highest, r.ticket)
    return Summary(
        starts=len(records),
        span_s=span_us / 1e6,
        achieved_pct=100.0 * (len(records) - 1) * interval_us / span_us if span_us else 0.0,
        min_store_gap_ms=min(store_gaps) / 1000,
        min_body_gap_ms=min(body_gaps) * 1000,
        store_gaps_below_interval=sum(g < interval_us for g in store_gaps),
        lateness_p50_ms=statistics.median(lateness),
        lateness_p99_ms=lateness[min(len(lateness) - 1, int(len(lateness) * 0.99))],
        order_inversions=inversions,
    )
