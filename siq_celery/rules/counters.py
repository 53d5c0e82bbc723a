"""The counters the store keeps of authorized starts (the exporter reads them): starts,
deferrals, gaps below the interval and lateness against the slot by bucket, added in the
start's own atomic step.

Twin: ``counters.lua`` beside this module. Times in integer microseconds."""

from __future__ import annotations

from ..types import StartCounts

#: Upper bounds (µs) of the lateness buckets of authorized starts against their slot: fine
#: below 10 ms, where the product's figures live, and on to seconds for a queue that falls
#: behind. The Lua scripts hold the same list (counters.lua: SIQ_LATENESS_BUCKETS).
LATENESS_BUCKETS_US = (
    500, 1_000, 2_000, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000,
)  # fmt: skip


#: A start closer than the interval less this to the one before counts as a gap (``siq
#: audit`` counts it the same way); none is expected.
GAP_TOLERANCE_US = 1000


#: Where the store keeps the time of the last start it counted (set, not added).
LAST_COUNTED = "last_us"


def lateness_bucket(late_us: int) -> int:
    """The bucket of a start ``late_us`` after its slot (len(LATENESS_BUCKETS_US): past the last)."""
    for i, bound in enumerate(LATENESS_BUCKETS_US):
        if late_us <= bound:
            return i
    return len(LATENESS_BUCKETS_US)


def start_counts(
    last_counted_us: int | None, now_us: int, slot_us: int, interval_us: int, deferrals: int = 0
) -> dict[str, int]:
    """What one authorized start adds to its queue's counters, kept by the store in the
    same atomic step as the start: ``starts``, ``deferrals`` (the task's, before it
    started), ``gaps`` (closer than ``interval_us`` less :data:`GAP_TOLERANCE_US` to the
    last start counted, at ``last_counted_us``), ``late_us`` (lateness against the slot)
    and ``late:<bucket>``. The store then sets :data:`LAST_COUNTED` to ``now_us``."""
    late = max(0, now_us - slot_us)
    added = {"starts": 1, "late_us": late, f"late:{lateness_bucket(late)}": 1}
    if deferrals > 0:
        added["deferrals"] = deferrals
    if last_counted_us is not None and now_us - last_counted_us < interval_us - GAP_TOLERANCE_US:
        added["gaps"] = 1
    return added


def counts_from_fields(fields: dict[str, int]) -> StartCounts:
    """The counters as a store keeps them (field -> number; missing fields are 0)."""
    return StartCounts(
        starts=fields.get("starts", 0),
        deferrals=fields.get("deferrals", 0),
        gaps_below_interval=fields.get("gaps", 0),
        lateness_sum_us=fields.get("late_us", 0),
        lateness_buckets=tuple(fields.get(f"late:{i}", 0) for i in range(len(LATENESS_BUCKETS_US) + 1)),
    )
