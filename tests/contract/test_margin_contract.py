"""The margin, on every store: added to the spacing and to the quota's window
(docs/design.md, "Margin"), declared like the other kinds (the largest live declaration
holds in a rolling deploy), overridden at runtime, and never added twice by a reset, a
declaration or a change of the interval. Pinned store clock, nothing sleeps."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from siq_celery import IntervalQueue, Limit, Verdict
from siq_celery.errors import ConfigurationError
from siq_celery.types import Limits
from tests.conftest import Store

MS = 1_000
S = 1_000_000


def queue(store: Store, interval: Any = "100ms", name: str = "q", **limits: Any) -> IntervalQueue:
    return IntervalQueue(name, interval=interval, backend=store.backend(), **limits)


def starts(store: Store, q: IntervalQueue, count: int, step_us: int = 100) -> list[int]:
    """The store times at which ``count`` tickets, all claimed at once, were authorized,
    asking every ``step_us`` from the first ticket's estimate."""
    tickets = q.claim_many(count)
    done: list[int] = []
    for ticket in tickets:
        while True:
            d = q.start(ticket)
            if d.authorized:
                done.append(d.now_us)
                break
            assert d.verdict is Verdict.WAIT, d
            store.clock.advance(us=max(min(d.wait_us, 1_000_000), step_us))
    return done


def test_the_margin_is_added_to_the_spacing_and_shown_apart(store: Store) -> None:
    q = queue(store, margin="5ms")
    state = q.ensure()
    assert (state.interval_us, state.declared_interval_us, state.margin_us) == (105 * MS, 100 * MS, 5 * MS)
    assert state.limits == Limits(margin_us=5 * MS)
    times = starts(store, q, 6)
    assert min(b - a for a, b in itertools.pairwise(times)) == 105 * MS
    status = q.status().as_dict()
    assert (status["interval_s"], status["margin_s"]) == (0.1, 0.005)
    q.ensure()  # the same code again: nothing differs, nothing is refused


def test_a_window_quota_counts_its_window_and_the_margin(store: Store) -> None:
    """3 in any 1 s with a margin of 50 ms: the 4th start waits for the 1st to be 1.05 s old."""
    q = queue(store, interval="10ms", quota="3/1s", margin="50ms")
    t0 = q.ensure().last_start_us
    times = starts(store, q, 4)
    assert times[3] - times[0] >= S + 50 * MS
    assert q.status().state.window_us == S + 50 * MS and q.status().state.limits.window_us == S
    assert t0 <= times[0]


def test_a_start_of_cost_two_holds_the_next_two_intervals_and_margins(store: Store) -> None:
    q = queue(store, margin="5ms")
    q.ensure()
    first, second = q.claim(2), q.claim()
    while not (d := q.start(first, cost=2)).authorized:
        store.clock.advance(us=d.wait_us)
    while not (e := q.start(second)).authorized:
        store.clock.advance(us=max(e.wait_us, 1))
    assert e.now_us - d.now_us == 2 * 105 * MS


def test_a_rolling_deploy_runs_at_the_largest_live_margin_and_an_override_wins_until_a_deploy_changes_it(
    store: Store,
) -> None:
    old, new = queue(store, margin="2ms"), queue(store, margin="7ms")
    old.declare(node="old@a", ttl=30.0)
    new.declare(node="new@b", ttl=30.0)
    assert q_margin(new) == 7 * MS and new.status().state.interval_us == 107 * MS
    new.set_limits(margin="1ms")
    assert q_margin(new) == 1 * MS and new.status().state.interval_us == 101 * MS
    new.declare(node="new@b", ttl=30.0, announce=False)  # a renewal keeps the override
    assert q_margin(new) == 1 * MS
    changed = queue(store, margin="9ms")
    changed.declare(node="new@b", ttl=30.0)  # a deploy that changes the margin replaces its override
    assert q_margin(new) == 9 * MS and new.status().state.interval_us == 109 * MS
    new.set_limits(margin="none")
    assert q_margin(new) == 0 and new.status().state.interval_us == 100 * MS
    new.set_limits(clear=True)
    assert q_margin(new) == 9 * MS


def q_margin(q: IntervalQueue) -> int:
    return q.status().state.margin_us


def test_a_new_interval_or_a_reset_keeps_the_margin_once(store: Store) -> None:
    q = queue(store, margin="5ms")
    q.declare()
    assert q.set_interval("200ms").interval_us == 205 * MS
    assert q.set_interval(None).interval_us == 105 * MS
    state = q.reset()
    assert (state.interval_us, state.margin_us) == (105 * MS, 5 * MS)
    assert q.ensure(reset=True).interval_us == 105 * MS


def test_a_limit_of_several_queues_takes_a_margin_each(store: Store) -> None:
    from siq_celery import CombinedQueue

    backend = store.backend()
    fast = IntervalQueue("{geo}fast", interval=Limit(interval="100ms", margin="3ms"), backend=backend)
    day = IntervalQueue("{geo}day", interval=Limit(quota="5/1s", margin="10ms"), backend=backend)
    both = CombinedQueue([fast, day])
    ticket = both.claim()
    while True:
        decisions = both.start(ticket)
        if all(d.authorized for d in decisions):
            break
        store.clock.advance(us=max(max(d.wait_us for d in decisions), 1))
    assert fast.status().state.interval_us == 103 * MS and day.status().state.window_us == S + 10 * MS


@pytest.mark.parametrize("bad", ["-1ms", "61s", "soon", True, [5]])
def test_a_margin_that_is_not_a_duration_from_0_to_60_s_is_one_line(store: Store, bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"margin .*: a duration from 0 to 60 s"):
        queue(store, margin=bad)
