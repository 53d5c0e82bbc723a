"""Synthetic ledgers with known faults, to check ``siq audit`` (tests) and time it (bench).

Two queues (20 ms and 50 ms) unless told otherwise. A queue without limits beyond its
interval has one start per slot plus up to 0.2 ms of jitter, and, at positions at least
4 rows apart from each other:

* ``violations``: a start moved to half an interval after the one before it (its body
  still began an interval after the body before it);
* ``inversions``: two neighbouring starts with their tickets swapped;
* ``duplicates``: a start carrying the task id of the start before it;
* ``missing``: a ticket removed (claimed, never started);
* ``body_violations``: on time on the store's clock, but the body's report came half an
  interval late (after the next start was authorized), and the next body began less than
  an interval after it: one violation on the bodies' clock, none on the authorizations';
* ``unreported``: a start with no report recorded (``began_us`` null).

Every other body reports :data:`BEGAN_AFTER_US` after its authorization.

A queue given one limit (``(name, interval_us, Limits(...))``) follows that limit to the
edge, and takes the faults of its kind:

* a **window quota** Q per W: batches of Q starts one interval apart, each start just over
  W after the start Q places before it. ``window_overruns``: the first start of a batch
  moved to 1 µs less than W after the start Q places before it (one unit too many in that
  window, and in no other);
* a **concurrency cap** N: one start per slot, each body ending up to a quarter interval
  before (or exactly at) the start N places after its own, so N are always in flight;
  some bodies never finish (their lease expires exactly then) and some finish after their
  lease expired (they count until the expiry). ``concurrency_overruns``: a body that ends
  half an interval after that start (the start N places on has N others in flight);
* a **burst** B: groups of B + 1 starts within microseconds, each group after GCRA gave
  the whole credit back (a spacing check without burst would count B violations a group).
  ``burst_overruns``: a group of B + 2 (its last start is beyond the allowance; its body
  began an interval and 1 ms after the group's first, within the allowance).
  ``body_burst_overruns``: on time on the store's clock, but the last body of a group
  began with the next group (its report came late): that group holds B + 2 bodies, its
  last beyond the allowance on the bodies' clock.

Each injection changes exactly one of the audit's counts by exactly one; for the kinds of
the limits, ``Injected.expected`` names the task ids of the starts the audit must report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..types import NO_LIMITS, Limits

QUEUES: tuple[tuple[str, int], ...] = (("synthetic:fast", 20_000), ("synthetic:slow", 50_000))
#: One queue of each limit, for the audit of the limits (tests, bench).
LIMIT_QUEUES: tuple[tuple[str, int, Limits], ...] = (
    ("synthetic:window", 20_000, Limits(quota=50, window_us=2_000_000)),
    ("synthetic:concurrent", 20_000, Limits(concurrency=4)),
    ("synthetic:burst", 20_000, Limits(burst=3)),
)
T0_US = 1_790_000_000_000_000  # 2026-09-21
#: The lease time to live of the synthetic concurrency queue's bodies that finish in time.
LEASE_US = 60_000_000

_PLAIN_FAULTS = ("violations", "inversions", "duplicates", "missing", "body_violations", "unreported")
_LIMIT_FAULTS = {"window_overruns": "quota", "concurrency_overruns": "concurrency", "burst_overruns": "burst",
                 "body_burst_overruns": "burst"}  # fmt: skip


@dataclass(frozen=True)
class Injected:
    rows: int
    violations: int
    inversions: int
    duplicates: int
    missing: int
    window_overruns: int = 0
    concurrency_overruns: int = 0
    burst_overruns: int = 0
    body_violations: int = 0
    unreported: int = 0
    body_burst_overruns: int = 0
    #: per kind (``window``, ``concurrency``, ``burst``, ``body_burst``), the task ids the audit must report
    expected: dict[str, tuple[str, ...]] = field(default_factory=dict)


def write_synthetic_ledger(
    path: str,
    rows: int,
    *,
    violations: int = 0,
    inversions: int = 0,
    duplicates: int = 0,
    missing: int = 0,
    window_overruns: int = 0,
    concurrency_overruns: int = 0,
    burst_overruns: int = 0,
    body_violations: int = 0,
    unreported: int = 0,
    body_burst_overruns: int = 0,
    seed: int = 7,
    queues: Sequence[tuple[str, int] | tuple[str, int, Limits]] = QUEUES,
) -> Injected:
    """Write ``rows`` ledger rows (Parquet) with the given faults, spread evenly over
    ``queues`` (name, interval in microseconds, and at most one limit), each kind of fault
    over the queues that take it (see the module docstring)."""
    import numpy as np
    import pyarrow.parquet as pq

    from ..ledger import arrow_schema

    rng = np.random.default_rng(seed)
    specs = [(q[0], q[1], q[2] if len(q) > 2 else NO_LIMITS) for q in queues]
    faults = {"violations": violations, "inversions": inversions, "duplicates": duplicates, "missing": missing,
              "window_overruns": window_overruns, "concurrency_overruns": concurrency_overruns,
              "burst_overruns": burst_overruns, "body_violations": body_violations,
              "unreported": unreported, "body_burst_overruns": body_burst_overruns}  # fmt: skip
    takers = {kind: [i for i, s in enumerate(specs) if _kind_of(s[2]) == _LIMIT_FAULTS.get(kind)] for kind in faults}
    for kind, n in faults.items():
        if n and not takers[kind]:
            raise ValueError(f"{n} {kind}: no queue of that kind among {[s[0] for s in specs]}")
    expected: dict[str, list[str]] = {"window": [], "concurrency": [], "burst": [], "body_burst": []}
    with pq.ParquetWriter(path, arrow_schema()) as writer:
        nq = len(specs)
        for i, (queue, interval, limits) in enumerate(specs):
            share = {}
            for kind, n in faults.items():
                mine = takers[kind]
                at = mine.index(i) if i in mine else None
                share[kind] = 0 if at is None else n // len(mine) + (1 if at < n % len(mine) else 0)
            kept = rows // nq + (1 if i < rows % nq else 0)
            limit = _kind_of(limits)
            if limit is None:
                columns = _plain(rng, queue, interval, kept, share)
            elif limit == "quota":
                columns = _windowed(rng, queue, interval, limits, kept, share["window_overruns"], expected["window"])
            elif limit == "concurrency":
                columns = _capped(rng, queue, interval, limits, kept, share["concurrency_overruns"],
                                  expected["concurrency"])  # fmt: skip
            else:
                columns = _bursting(rng, queue, interval, limits, kept, share["burst_overruns"], expected["burst"],
                                    share["body_burst_overruns"], expected["body_burst"])  # fmt: skip
            writer.write_table(_table(queue, interval, limits, columns))
    return Injected(rows, violations, inversions, duplicates, missing, window_overruns, concurrency_overruns,
                    burst_overruns, body_violations, unreported, body_burst_overruns,
                    {k: tuple(v) for k, v in expected.items()})  # fmt: skip


def _kind_of(limits: Limits) -> str | None:
    kinds = [k for k in ("quota", "concurrency", "burst") if getattr(limits, k)]
    if len(kinds) > 1:
        raise ValueError(f"a synthetic queue takes one limit, not {limits}")
    return kinds[0] if kinds else None


def _spots(rng: Any, candidates: Any, need: int, what: str) -> Any:
    import numpy as np

    if need > len(candidates):
        raise ValueError(f"{need} {what} do not fit in the rows given")
    return np.sort(rng.permutation(candidates)[:need])


def _plain(rng: Any, queue: str, interval: int, kept: int, share: dict[str, int]) -> dict[str, Any]:
    """One start per slot, with the faults of a queue without limits."""
    import numpy as np

    n = kept + share["missing"]  # rows before the missing ones are removed
    k = np.arange(n, dtype=np.int64)
    slot = T0_US + (k + 1) * interval
    start = slot + rng.integers(0, 200, n)
    ticket = k + 1
    task = k.copy()
    spots = rng.permutation(np.arange(8, n - 8, 4))  # 4 apart: injections never touch
    need = sum(share[f] for f in _PLAIN_FAULTS)
    if need > len(spots):
        raise ValueError(f"{need} faults do not fit in {kept} rows")
    chosen, at = {}, 0
    for name in _PLAIN_FAULTS:
        chosen[name], at = np.sort(spots[at : at + share[name]]), at + share[name]
    v = chosen["violations"]
    start[v] = start[v - 1] + interval // 2
    s = chosen["inversions"]
    ticket[s], ticket[s + 1] = ticket[s + 1].copy(), ticket[s].copy()
    d = chosen["duplicates"]
    task[d] = task[d - 1]
    began = start + BEGAN_AFTER_US
    began[v] = began[v - 1] + interval  # its body waited for the body before it: no violation on the bodies' clock
    b = chosen["body_violations"]
    began[b - 1] = start[b - 1] + interval // 2  # reported late: the next body began half an interval after
    unreported = np.zeros(n, dtype=bool)
    unreported[chosen["unreported"]] = True
    keep = np.ones(n, dtype=bool)
    keep[chosen["missing"]] = False
    return {"k": k[keep], "slot": slot[keep], "start": start[keep], "ticket": ticket[keep], "task": task[keep],
            "finish": start[keep] + 5_000, "began": began[keep], "unreported": unreported[keep]}  # fmt: skip


def _windowed(rng: Any, queue: str, interval: int, limits: Limits, n: int, overruns: int, out: list[str]) -> Any:
    """Batches of ``quota`` starts one interval apart, each just over a window after the
    start ``quota`` places before it; an overrun moves a batch's first start 1 µs inside."""
    import numpy as np

    q, w = limits.quota, limits.window_us
    if w < (q + 1) * interval + 2_000:
        raise ValueError(f"a synthetic window of {w} µs must exceed {q + 1} intervals by 2 ms")
    k = np.arange(n, dtype=np.int64)
    slot = T0_US + (k // q) * (w + 1_000) + (k % q) * interval
    start = slot + rng.integers(0, 200, n)
    # the first start of every other batch (consecutive ones would hide each other)
    spots = _spots(rng, np.arange(q, n, 2 * q), overruns, "window overruns")
    start[spots] = start[spots - q] + w - 1
    slot[spots] = start[spots]
    out.extend(f"{queue}-{x}" for x in spots)
    return {"k": k, "slot": slot, "start": start, "ticket": k + 1, "task": k.copy(), "finish": start + 5_000}


def _capped(rng: Any, queue: str, interval: int, limits: Limits, n: int, overruns: int, out: list[str]) -> Any:
    """One start per slot, N bodies in flight at each start: body k ends up to a quarter
    interval before (every tenth exactly at) start k + N. Every 50th never finishes (its
    lease expires at start k + N), every 50th from the 25th finishes after its lease expired
    there; an overrun ends half an interval after start k + N."""
    import numpy as np

    cap = limits.concurrency
    k = np.arange(n, dtype=np.int64)
    slot = T0_US + (k + 1) * interval
    start = slot + rng.integers(0, 200, n)
    nxt = np.concatenate([start[cap:], start[-cap:] + cap * interval]) if n > cap else start + cap * interval
    early = rng.integers(0, interval // 4, n)
    early[k % 10 == 0] = 0
    finish = nxt - early
    lease_us = np.full(n, LEASE_US, dtype=np.int64)
    returned = np.ones(n, dtype=bool)
    lost, late = k % 50 == 49, k % 50 == 24  # no finish; a finish after the lease expired
    lease_us[lost | late] = (nxt - start)[lost | late]
    returned[late] = False
    finish[late] = start[late] + 10 * cap * interval
    regular = np.flatnonzero(~(lost | late) & (k >= 8) & (k < n - cap - 8) & (k % 4 == 0))
    spots = _spots(rng, regular, overruns, "concurrency overruns")
    finish[spots] = nxt[spots] + interval // 2
    out.extend(f"{queue}-{x}" for x in spots + cap)
    return {"k": k, "slot": slot, "start": start, "ticket": k + 1, "task": k.copy(), "finish": finish,
            "lost": lost, "lease_us": lease_us, "returned": returned}  # fmt: skip


def _bursting(
    rng: Any, queue: str, interval: int, limits: Limits, n: int, overruns: int, out: list[str],
    body_overruns: int = 0, body_out: list[str] | None = None,
) -> Any:  # fmt: skip
    """Groups of B + 1 starts a few microseconds apart, each after GCRA gave the whole
    credit back (B + 4 intervals after the group before: one more than the most a group
    needs); an overrun is a group of B + 2, whose last body began an interval and 1 ms
    after the group's first; a body overrun, the last body of a group beginning with the
    next group's second."""
    import numpy as np

    b = limits.burst
    sizes = np.full(n // (b + 1) + 1, b + 1, dtype=np.int64)
    # groups that stay whole however many others grow: every other one, well before the end
    big = _spots(rng, np.arange(1, n // (b + 2) - 2, 2), overruns, "burst overruns")
    sizes[big] = b + 2
    ends = np.cumsum(sizes)
    sizes = sizes[ends - sizes < n]
    sizes[-1] -= ends[len(sizes) - 1] - n
    group_start = T0_US + np.concatenate([[0], np.cumsum((sizes[:-1] + 3) * interval)])
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    k = np.arange(n, dtype=np.int64)
    g = np.repeat(np.arange(len(sizes)), sizes)
    j = k - first[g]
    start = group_start[g] + j * 7 + rng.integers(0, 5, n)
    began = start + BEGAN_AFTER_US
    grown = np.flatnonzero(sizes == b + 2)
    began[first[grown] + b + 1] = began[first[grown]] + interval + 1_000
    out.extend(f"{queue}-{first[x] + sizes[x] - 1}" for x in grown)
    # whole groups of b + 1 whose neighbours are too, away from the ends
    whole = np.flatnonzero((sizes[1:-2] == b + 1) & (sizes[:-3] == b + 1) & (sizes[2:-1] == b + 1)) + 1
    late = _spots(rng, whole[whole % 3 == 0], body_overruns, "body burst overruns")
    began[first[late] + b] = began[first[late + 1]] + 1  # with the next group's first body
    if body_out is not None:
        body_out.extend(f"{queue}-{first[x + 1] + b}" for x in late)
    return {"k": k, "slot": start.copy(), "start": start, "ticket": k + 1, "task": k.copy(), "finish": start + 5_000,
            "began": began}  # fmt: skip


#: Each synthetic body reports this long after its authorization (every start moves by the
#: same: the gaps between the bodies are those between the authorizations).
BEGAN_AFTER_US = 400


def _table(queue: str, interval: int, limits: Limits, c: dict[str, Any]) -> Any:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..ledger import SCHEMA_VERSION, arrow_schema

    k, count = c["k"], len(c["k"])
    ids = pc.binary_join_element_wise(pa.scalar(f"{queue}-"), pa.array(c["task"]).cast(pa.string()), "")
    hosts = np.array([f"node{h}@worker-{h}" for h in range(4)])[k % 4]
    lost = c.get("lost", np.zeros(count, dtype=bool))
    leased = limits.concurrency > 0
    lease_us = c.get("lease_us", np.zeros(count, dtype=np.int64))
    returned = pa.array(c.get("returned", np.ones(count, dtype=bool)), mask=lost | (not leased))
    columns: dict[str, Any] = {
        "queue": pa.array(np.full(count, queue)), "epoch": pa.array(np.full(count, "e1")),
        "ticket": c["ticket"], "task_id": ids, "task_name": pa.array(np.full(count, "synthetic.call")),
        "slot_us": c["slot"], "start_us": c["start"], "interval_us": np.full(count, interval, dtype=np.int64),
        "finish_us": pa.array(c["finish"], mask=lost), "outcome": pa.array(np.full(count, "SUCCESS"), mask=lost),
        "deferrals": np.zeros(count, dtype=np.int32), "host": pa.array(hosts),
        "pid": (1000 + k % 8).astype(np.int32), "cost": np.ones(count, dtype=np.int32),
        "burst": np.full(count, limits.burst, dtype=np.int32), "quota": np.full(count, limits.quota, dtype=np.int64),
        "window_us": np.full(count, limits.window_us, dtype=np.int64),
        "concurrency": np.full(count, limits.concurrency, dtype=np.int32),
        "lease_us": lease_us if leased else np.zeros(count, dtype=np.int64), "lease_returned": returned,
        "fair_key": pa.array(np.full(count, "")), "fair_tag": np.full(count, -1, dtype=np.int64),
        "fair_weight": np.zeros(count, dtype=np.int32),
        "began_us": pa.array(c.get("began", c["start"] + BEGAN_AFTER_US), mask=c.get("unreported")),
        "v": np.full(count, SCHEMA_VERSION, dtype=np.int16),
    }  # fmt: skip
    return pa.table(columns, schema=arrow_schema())
