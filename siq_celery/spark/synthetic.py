"""Synthetic ledgers with known faults, to check ``siq audit`` (tests) and time it (bench).

Two queues (20 ms and 50 ms) unless told otherwise, one start per slot plus up to 0.2 ms
of jitter, and, at positions at least 4 rows apart from each other:

* ``violations``: a start moved to half an interval after the one before it;
* ``inversions``: two neighbouring starts with their tickets swapped;
* ``duplicates``: a start carrying the task id of the start before it;
* ``missing``: a ticket removed (claimed, never started).

Each injection changes exactly one of the audit's counts by exactly one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

QUEUES = (("synthetic:fast", 20_000), ("synthetic:slow", 50_000))
T0_US = 1_790_000_000_000_000  # 2026-09-21


@dataclass(frozen=True)
class Injected:
    rows: int
    violations: int
    inversions: int
    duplicates: int
    missing: int


def write_synthetic_ledger(
    path: str,
    rows: int,
    *,
    violations: int = 0,
    inversions: int = 0,
    duplicates: int = 0,
    missing: int = 0,
    seed: int = 7,
    queues: Sequence[tuple[str, int]] = QUEUES,
) -> Injected:
    """Write ``rows`` ledger rows (Parquet) with the given faults, spread evenly over
    ``queues`` (name, interval in microseconds)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ..ledger import SCHEMA_VERSION, arrow_schema

    rng = np.random.default_rng(seed)
    faults = {"violations": violations, "inversions": inversions, "duplicates": duplicates, "missing": missing}
    with pq.ParquetWriter(path, arrow_schema()) as writer:
        nq = len(queues)
        for i, (queue, interval) in enumerate(queues):
            share = {k: v // nq + (1 if i < v % nq else 0) for k, v in faults.items()}
            kept = rows // nq + (1 if i < rows % nq else 0)
            n = kept + share["missing"]  # rows before the missing ones are removed
            k = np.arange(n, dtype=np.int64)
            slot = T0_US + (k + 1) * interval
            start = slot + rng.integers(0, 200, n)
            ticket = k + 1
            task = k.copy()
            spots = rng.permutation(np.arange(8, n - 8, 4))  # 4 apart: injections never touch
            need = sum(share.values())
            if need > len(spots):
                raise ValueError(f"{need} faults do not fit in {rows} rows")
            chosen, at = {}, 0
            for name in faults:
                chosen[name], at = np.sort(spots[at : at + share[name]]), at + share[name]
            v = chosen["violations"]
            start[v] = start[v - 1] + interval // 2
            s = chosen["inversions"]
            ticket[s], ticket[s + 1] = ticket[s + 1].copy(), ticket[s].copy()
            d = chosen["duplicates"]
            task[d] = task[d - 1]
            keep = np.ones(n, dtype=bool)
            keep[chosen["missing"]] = False
            k, slot, start, ticket, task = k[keep], slot[keep], start[keep], ticket[keep], task[keep]
            count = len(k)
            ids = pc.binary_join_element_wise(pa.scalar(f"{queue}-"), pa.array(task).cast(pa.string()), "")
            hosts = np.array([f"node{h}@worker-{h}" for h in range(4)])[k % 4]
            columns: dict[str, Any] = {
                "queue": pa.array(np.full(count, queue)), "epoch": pa.array(np.full(count, "e1")),
                "ticket": ticket, "task_id": ids, "task_name": pa.array(np.full(count, "synthetic.call")),
                "slot_us": slot, "start_us": start, "interval_us": np.full(count, interval, dtype=np.int64),
                "finish_us": start + 5_000, "outcome": pa.array(np.full(count, "SUCCESS")),
                "deferrals": np.zeros(count, dtype=np.int32), "host": pa.array(hosts),
                "pid": (1000 + k % 8).astype(np.int32), "cost": np.ones(count, dtype=np.int32),
                "burst": np.zeros(count, dtype=np.int32), "quota": np.zeros(count, dtype=np.int64),
                "window_us": np.zeros(count, dtype=np.int64), "concurrency": np.zeros(count, dtype=np.int32),
                "lease_us": np.zeros(count, dtype=np.int64), "lease_returned": pa.nulls(count, pa.bool_()),
                "v": np.full(count, SCHEMA_VERSION, dtype=np.int16),
            }  # fmt: skip
            writer.write_table(pa.table(columns, schema=arrow_schema()))
    return Injected(rows, violations, inversions, duplicates, missing)
