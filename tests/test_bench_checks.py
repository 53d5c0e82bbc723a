"""The benchmarks' exact checks (bench/checks.py): the burst bound's excess over every
half-open window, and the most spans at once, on hand-made sequences and against a
brute force over every window on a grid."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.checks import Excess, burst_excess, most_at_once, to_us

I = 10


@pytest.mark.parametrize(
    ("starts", "excess"),
    [
        ([], 0),
        ([5], 0),
        ([0, 10, 20, 30], 0),  # exact spacing: a window of 10 holds one start, of 10.5 two
        ([0, 11, 30, 45], 0),
        ([0, 9], 1),  # [0, 9.5) holds 2, ceil(9.5 / 10) = 1
        ([0, 10, 10], 1),  # two at once at 10: [10, 10.5) holds 2
        ([0, 0, 0, 0, 0], 4),  # five at once after idleness: burst 4
        ([0, 0, 0, 0, 0, 0], 5),
        ([0, 0, 0, 0, 0, 10, 20, 30], 4),  # a burst of 4, then the grid: the bound, exactly
        ([0, 0, 0, 0, 0, 9, 20, 30], 5),  # the same with one start 1 µs early
        ([0, 25, 30, 35, 40], 2),  # late, then catching up: [25, 40.5) holds 4, ceil(15.5/10) = 2
        ([40, 0, 35, 25, 30], 2),  # order does not matter
        ([0, 19, 20, 39, 40], 1),  # [19, 20.5) holds 2, and so does [39, 40.5); [19, 40.5) 4 in 21.5
        ([0, 30, 31, 32, 33, 34, 100], 4),
    ],
)
def test_burst_excess_of_hand_made_sequences(starts: list[int], excess: int) -> None:
    assert burst_excess(starts, I).excess == excess


def test_the_window_it_names_holds_that_excess() -> None:
    starts = [0, 100, 125, 130, 135, 140, 300]
    found = burst_excess(starts, I)
    assert found == Excess(2, 2, 5)  # [125, 140]: 4 starts, a window of 15.5 needs ceil 2
    d = starts[found.last] - starts[found.first]
    assert (found.last - found.first + 1) - (d // I + 1) == found.excess


def test_a_window_of_exactly_k_intervals_does_not_hold_its_last_start() -> None:
    # [0, 20) holds 0 and 10: 2 = ceil(20 / 10). 20 is outside it; a window holding it
    # is longer than 20, and ceil of that is 3: no excess at the multiple.
    assert burst_excess([0, 10, 20], I).excess == 0
    assert burst_excess([0, 10, 19], I).excess == 1


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        burst_excess([0, 1], 0)


def brute_force(starts: list[int], interval: int) -> int:
    """Every half-open window [a, a + W) with a and W on a grid of half units (times and
    interval doubled to stay whole): starts in it minus ceil(W / I)."""
    doubled, step = [2 * t for t in starts], 2 * interval
    lo, hi = min(doubled) - 2, max(doubled) + 2
    best = 0
    for a in range(lo, hi + 1):
        for w in range(1, hi - lo + 2):
            held = sum(a <= t < a + w for t in doubled)
            best = max(best, held - -(-w // step))
    return best


@given(st.lists(st.integers(0, 60), min_size=1, max_size=9), st.integers(1, 12))
def test_burst_excess_matches_every_window_on_a_grid(starts: list[int], interval: int) -> None:
    assert burst_excess(starts, interval).excess == brute_force(starts, interval)


@given(st.integers(0, 6), st.lists(st.integers(0, 40), min_size=1, max_size=40), st.integers(1, 10))
def test_a_gcra_line_with_burst_b_never_exceeds_b(burst: int, arrivals: list[int], interval: int) -> None:
    """Starts a GCRA of that burst lets through (each arrival starts as soon as the rate
    allows, in order) stay within the bound; after idleness it uses all of it."""
    t_at, starts, now = 0, [], 0  # theoretical arrival time
    for gap in arrivals:
        now = max(now + gap, t_at - burst * interval)
        starts.append(now)
        t_at = max(t_at, now) + interval
    assert burst_excess(starts, interval).excess <= burst
    backlog = [0] * (burst + 1) + [interval * k for k in range(1, 6)]  # idle, then a backlog at once
    assert burst_excess(backlog, interval).excess == burst


@pytest.mark.parametrize(
    ("spans", "most"),
    [
        ([], 0),
        ([(0, 10)], 1),
        ([(0, 10), (10, 20), (20, 30)], 1),  # an end and a start at one instant: one running
        ([(0, 10), (9, 20), (19, 30)], 2),
        ([(0, 10), (1, 11), (2, 12), (10, 20)], 3),
        ([(0, 100), (10, 20), (20, 30), (25, 35)], 3),
    ],
)
def test_most_at_once(spans: list[tuple[int, int]], most: int) -> None:
    assert most_at_once(spans) == most


def test_to_us_rounds_host_seconds_to_whole_microseconds() -> None:
    assert to_us([1.0000004, 2.0000006]) == [1_000_000, 2_000_001]


def test_the_hand_off_is_measured_only_where_a_full_cap_gave_a_lease_back() -> None:
    from bench.peers import handoff_ms

    rows = [
        {"t": 0.0, "end": 1.0}, {"t": 0.1, "end": 1.5},  # cap 2, full until 1.0
        {"t": 1.002, "end": 2.0},  # took the lease given back at 1.0: 2 ms
        {"t": 3.0, "end": 3.5},  # nothing was full before it: no hand-off
    ]  # fmt: skip
    assert [round(h, 3) for h in handoff_ms(rows, 2)] == [2.0]
