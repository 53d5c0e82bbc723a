"""Exact checks the benchmarks run on recorded start (and end) times.

Times are integer microseconds: the store's clock gives them so (``Decision.now_us``), and
host times in seconds are rounded to them first, so the arithmetic below is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Excess:
    """The most starts a half-open window holds beyond ``ceil(W / I)``, and one window
    that does: ``[starts[first], starts[last]]`` (indexes into the sorted starts), which a
    window of length just over ``starts[last] - starts[first]`` holds whole."""

    excess: int
    first: int = 0
    last: int = 0


def burst_excess(starts_us: Iterable[int], interval_us: int) -> Excess:
    """max over half-open windows ``[a, a + W)``, ``W > 0``, of (starts in it) - ceil(W / I).

    The burst bound is ``burst_excess(...).excess <= B``: in any half-open window of
    length W at most ceil(W / I) + B starts (B = 0: no two starts closer than I).

    Why it is computed so. Sort the starts: t_0 <= t_1 <= ... A window holding t_i and t_j
    (i <= j) holds every start between them, so only windows holding a run i..j matter,
    and such a window needs ``a <= t_i`` and ``a + W > t_j``: W > d = t_j - t_i. ceil(W / I)
    never falls as W grows, so its least value over W > d is floor(d / I) + 1 (when d is a
    multiple of I, W must pass it: a half-open window of length exactly d misses t_j).
    The window's excess is then (j - i + 1) - (floor(d / I) + 1) = (j - i) - floor(d / I).
    With b_k = k x I - t_k, and n - floor(x) = ceil(n - x) for a whole n, that is
    ceil((b_j - b_i) / I), which grows with b_j - b_i: the maximum over i <= j is the
    ceil of the largest rise of b over I, one pass with a running minimum. i = j gives 0,
    so any start at all gives an excess of at least 0; no starts, 0.
    """
    if interval_us <= 0:
        raise ValueError(f"interval_us must be positive, not {interval_us}")
    times = sorted(starts_us)
    best, low, low_at, first, last = 0, 0, 0, 0, 0
    for k, t in enumerate(times):
        b = k * interval_us - t
        if k == 0 or b < low:
            low, low_at = b, k
        rise = b - low
        if -(-rise // interval_us) > best:  # ceil for integers
            best, first, last = -(-rise // interval_us), low_at, k
    return Excess(best, first, last)


def most_at_once(spans: Iterable[tuple[int, int]]) -> int:
    """The most half-open spans ``[start, end)`` that overlap at one instant (a span that
    ends as another starts does not overlap it)."""
    events = sorted(e for start, end in spans for e in ((start, 1), (end, -1)))  # -1 sorts first at a tie
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def to_us(seconds: Sequence[float]) -> list[int]:
    """Host times in seconds as whole microseconds."""
    return [round(s * 1_000_000) for s in seconds]
