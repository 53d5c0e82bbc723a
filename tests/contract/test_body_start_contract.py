"""A start counts from when its body begins, on every store (pinned clock).

A start asked with ``reports`` leaves the queue waiting for its body's report (the last
step before the body: ``began``); the report places the start at the store's time when it
came, and only then may the next start be authorized, counted from there. A body that
never reports holds the queue for ``BEGIN_WAIT_US`` at most, and a report that comes after
a later start is refused (the body must not begin), unless the queue's burst has room for
it now: then it is charged as one more start. docs/design.md,
"The guarantees" (which clock each holds on).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

from siq_celery import IntervalQueue, Verdict
from siq_celery.client.body import body_may_begin, give_back_late_start, still_holds
from siq_celery.rules import BEGIN_WAIT_US
from siq_celery.types import Decision
from tests.conftest import Store

I = 100_000
MS = 1_000
S = 1_000_000


def queue(store: Store, **options: Any) -> IntervalQueue:
    return IntervalQueue("q", interval="100ms", backend=store.backend(), **options)


def test_the_next_start_waits_for_the_body_and_counts_from_it(store: Store) -> None:
    q = queue(store)
    first, second = q.claim(), q.claim()
    store.clock.advance(us=I)
    one = q.start(first, reports=True)
    assert one.authorized
    store.clock.now_us = one.now_us + I  # the second ticket's slot on the authorization's clock
    waiting = q.start(second, reports=True)
    assert waiting.verdict is Verdict.WAIT and 0 < waiting.wait_us <= 5 * MS  # a short poll: the body may report
    store.clock.now_us = one.now_us + 30 * MS  # the body began 30 ms after its authorization
    assert q.began(one, wait=True)
    store.clock.now_us = one.now_us + I
    held = q.start(second, reports=True)
    assert held.verdict is Verdict.WAIT and held.wait_us == 30 * MS  # one interval from the body's start
    store.clock.now_us = one.now_us + 30 * MS + I
    assert q.start(second, reports=True).authorized


def test_a_start_that_reports_is_authorized_for_its_slot_up_to_the_lead_ahead(store: Store) -> None:
    q, lead = queue(store), 5 * MS  # a quarter interval, 5 ms at most
    first, second, third = q.claim(), q.claim(), q.claim()
    store.clock.advance(us=I)
    one = q.start(first, reports=True)
    assert q.began(one, wait=True)
    slot = one.now_us + I
    store.clock.now_us = slot - lead - 1  # beyond the lead: it waits
    early = q.start(second, reports=True)
    assert early.verdict is Verdict.WAIT and early.wait_us == lead + 1
    store.clock.now_us = slot - lead
    ahead = q.start(second, reports=True)  # within the lead: authorized for its slot, its body held until then
    assert ahead.authorized and (ahead.now_us, ahead.wait_us, ahead.slot_us) == (slot, lead, slot)
    store.clock.now_us = slot - 1
    assert q.began(ahead, wait=True)  # a report that comes before the slot leaves the start at the slot
    store.clock.now_us = slot + I - 1
    assert q.start(third).verdict is Verdict.WAIT  # the line counts from the slot, not from the ask
    store.clock.now_us = slot + I
    assert q.start(third).authorized
    store.clock.now_us = slot + 2 * I - 1
    assert q.start(q.claim()).verdict is Verdict.WAIT  # a start that does not report is never ahead


def test_an_overtaken_start_under_a_burst_is_charged_as_one_more_start_while_the_burst_has_room(
    store: Store,
) -> None:
    """Its process stood still after its report, and a later start came (under a burst the
    next start need not wait a whole interval): asked, the store charges the body's start
    as one more start now, if the rate cap has room, and its place at its authorization
    stays charged; the bodies then hold the burst bound. No room: the body does not begin."""
    q = queue(store, burst=2)
    first, second, third = q.claim(), q.claim(), q.claim()
    store.clock.advance(us=3 * I)  # the line is two slots late: the burst lets it catch up
    t = store.clock.now_us
    one = q.start(first, reports=True)
    assert one.authorized and q.began(one)  # sent quickly, and placed
    store.clock.advance(us=200)
    assert q.start(second, reports=True).authorized  # the burst lets the next one come at once
    store.clock.advance(us=100)
    assert q.began(one, wait=True)  # overtaken, asked: charged now (the cap had room)
    assert q.status().state.last_start_us == t + 2 * I  # three starts charged: t, then T + I twice
    store.clock.now_us = t + I - 1
    assert not q.began(one, wait=True)  # the cap has no room for another until t + I
    waiting = q.start(third)
    assert waiting.verdict is Verdict.WAIT and waiting.slot_us == t + I  # the charge delays the next start
    store.clock.now_us = t + I
    assert q.began(one, wait=True)  # room again: charged once more
    assert q.status().state.last_start_us == t + 3 * I


def test_an_overtaken_start_without_a_burst_or_with_a_quota_is_not_charged(store: Store) -> None:
    for options in ({}, {"burst": 2, "quota": "10/1s"}):
        q = IntervalQueue(f"q{len(options)}", interval="100ms", backend=store.backend(), **options)  # type: ignore[arg-type]
        first, second = q.claim(), q.claim()
        store.clock.advance(us=I)
        one = q.start(first, reports=True)
        assert q.began(one)
        store.clock.advance(us=I)
        assert q.start(second, reports=True).authorized
        before = q.status().state
        assert not q.began(one, wait=True)  # the body must not begin: a quota's window would count it twice
        assert q.status().state.last_start_us == before.last_start_us


def test_a_body_that_never_reports_holds_the_queue_for_the_begin_wait_only(store: Store) -> None:
    q = queue(store)
    first, second = q.claim(), q.claim()
    store.clock.advance(us=I)
    one = q.start(first, reports=True)
    store.clock.now_us = one.now_us + BEGIN_WAIT_US - 1
    late = q.start(second)
    assert late.verdict is Verdict.WAIT and late.wait_us == 1
    store.clock.now_us = one.now_us + BEGIN_WAIT_US
    assert q.start(second).authorized  # its process died, or stood still: the line goes on
    assert not q.began(one, wait=True)  # and its body, were it to begin now, is told not to


def test_a_start_that_does_not_report_holds_nothing(store: Store) -> None:
    q = queue(store)
    first, second = q.claim(), q.claim()
    store.clock.advance(us=I)
    one = q.start(first)
    store.clock.now_us = one.now_us + I
    assert q.start(second).authorized
    assert not q.began(one, wait=True)  # nothing pending: a stray report moves nothing


def test_a_report_of_an_earlier_start_moves_nothing(store: Store) -> None:
    q = queue(store)
    tickets = [q.claim() for _ in range(3)]
    store.clock.advance(us=I)
    one = q.start(tickets[0], reports=True)
    assert q.began(one, wait=True)
    store.clock.advance(us=I)
    two = q.start(tickets[1], reports=True)
    assert two.authorized
    assert not q.began(one, wait=True)  # not the last start
    store.clock.advance(us=7 * MS)
    assert q.began(two, wait=True)
    status = q.status()
    assert status.state.last_start_us == two.now_us + 7 * MS


def test_the_window_counts_the_bodys_start(store: Store) -> None:
    q = queue(store, quota="2/1s")
    tickets = [q.claim() for _ in range(3)]
    store.clock.advance(us=I)
    one = q.start(tickets[0], reports=True)
    store.clock.advance(us=50 * MS)  # its body began 50 ms late
    assert q.began(one, wait=True)
    store.clock.advance(us=I)
    two = q.start(tickets[1], reports=True)
    assert two.authorized and q.began(two, wait=True)
    store.clock.now_us = one.now_us + S  # a window after the authorization, not after the body
    held = q.start(tickets[2], reports=True)
    assert held.verdict is Verdict.WAIT and held.wait_us == 50 * MS
    store.clock.now_us = one.now_us + 50 * MS + S
    assert q.start(tickets[2], reports=True).authorized


def test_a_start_whose_body_reports_after_a_window_is_counted_where_its_body_began(store: Store) -> None:
    """A start still awaiting its body's report stays in the window however old: the
    report places it there (found by the stateful test: it had left the window, its
    report moved nothing, and a quota of 2 admitted 3 bodies in one window)."""
    q = IntervalQueue("q", interval="10ms", quota="2/150ms", backend=store.backend())
    tickets = [q.claim() for _ in range(3)]
    store.clock.advance(us=10 * MS)
    one = q.start(tickets[0], reports=True)
    store.clock.now_us = one.now_us + 160 * MS  # a window later, its body has not begun yet
    assert q.start(tickets[1], reports=True).verdict is Verdict.WAIT  # the window is read meanwhile
    assert q.began(one, wait=True)  # the body begins now: one.now_us + 160 ms
    assert q.status().window_used == 1
    store.clock.now_us = one.now_us + 170 * MS
    two = q.start(tickets[1], reports=True)
    assert two.authorized and q.began(two, wait=True)
    store.clock.now_us = one.now_us + 180 * MS
    held = q.start(tickets[2], reports=True)
    assert held.verdict is Verdict.WAIT and held.wait_us == 130 * MS  # until the first body's start leaves
    store.clock.now_us = one.now_us + 321 * MS  # both bodies' starts left the window
    assert q.status().window_used == 0
    assert q.start(tickets[2], reports=True).authorized


def test_a_reset_keeps_the_pending_start(store: Store) -> None:
    q = queue(store)
    first = q.claim()
    store.clock.advance(us=I)
    one = q.start(first, reports=True)
    q.reset()
    store.clock.now_us = one.now_us + I
    fresh = q.claim()
    assert q.start(fresh).verdict is Verdict.WAIT  # the body of the old life's start still begins
    store.clock.advance(us=20 * MS)
    assert q.began(one, wait=True)
    assert q.start(fresh).verdict is Verdict.WAIT
    store.clock.advance(us=I)
    assert q.start(fresh).authorized


def bodies(store: Store, q: IntervalQueue, count: int, until_us: int, seed: int) -> list[int]:
    """``count`` tickets wait in line, the head asking when it was told to; an authorized
    start's body begins (and reports) after a delay drawn from a loaded host's: mostly under
    1 ms, at times 5-40 ms, now and then 150-700 ms (past half the start's wait: that body
    asks first, and does not begin if a later start came; it waits again). The bodies'
    start times."""
    rng = random.Random(seed)
    waiting = [q.claim() for _ in range(count)]
    began: list[int] = []
    pending: list[tuple[int, Decision]] = []
    while (waiting or pending) and store.clock.now_us <= until_us:
        now = store.clock.now_us
        for due, decision in [p for p in pending if p[0] <= now]:
            pending.remove((due, decision))
            late = due - decision.now_us > BEGIN_WAIT_US // 2
            if q.began(decision, wait=True) or not late:
                began.append(now)
            else:  # overtaken while it stood still: it waits again, with a fresh ticket
                waiting.append(q.claim())
        asked_again = until_us
        while waiting:
            d = q.start(waiting[0], reports=True)
            if not d.authorized:
                asked_again = now + max(d.wait_us, 1)
                break
            waiting.pop(0)
            r = rng.random()
            delay = (
                rng.randint(0, 900) if r < 0.8 else rng.randint(5, 40) * MS if r < 0.97 else rng.randint(150, 700) * MS
            )
            pending.append((now + delay, d))
        store.clock.now_us = min([asked_again, *(due for due, _ in pending)])
        if store.clock.now_us == now:
            store.clock.advance(us=1)
    return sorted(began)


def most_in_window(starts: list[int], width_us: int) -> int:
    return max(sum(1 for s in starts[i:] if s < a + width_us) for i, a in enumerate(starts))


def test_spacing_holds_between_the_bodies_starts(store: Store) -> None:
    q = IntervalQueue("q", interval="20ms", backend=store.backend())
    starts = bodies(store, q, 60, store.clock.now_us + 4 * S, seed=1)
    assert len(starts) >= 40
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 20 * MS, gaps


def test_a_window_quota_holds_between_the_bodies_starts(store: Store) -> None:
    q = IntervalQueue("q", interval="10ms", quota="8/200ms", backend=store.backend())
    starts = bodies(store, q, 60, store.clock.now_us + 4 * S, seed=2)
    assert len(starts) >= 40
    assert most_in_window(starts, 200 * MS) <= 8


def test_a_burst_bounds_the_bodies_and_lets_the_line_catch_up_after_a_late_one(store: Store) -> None:
    q = IntervalQueue("q", interval="10ms", burst=4, backend=store.backend())
    starts = bodies(store, q, 150, store.clock.now_us + 3 * S, seed=3)
    assert len(starts) >= 100
    for width in (1 * MS, 5 * MS, 10 * MS, 25 * MS, 100 * MS, 500 * MS):
        assert most_in_window(starts, width) <= math.ceil(width / (10 * MS)) + 4, width
    assert most_in_window(starts, 1 * MS) >= 3  # after a late body the line caught up, within the burst


def test_a_report_sent_again_moves_the_start_again_until_a_later_start_came(store: Store) -> None:
    q = queue(store)
    first, second = q.claim(), q.claim()
    store.clock.advance(us=I)
    one = q.start(first, reports=True)
    store.clock.advance(us=2 * MS)
    assert q.began(one, wait=True)  # the report; then the process stood still 3 ms before its body
    store.clock.advance(us=3 * MS)
    assert q.began(one, wait=True)
    assert q.status().state.last_start_us == one.now_us + 5 * MS
    store.clock.now_us = one.now_us + 5 * MS + I
    two = q.start(second, reports=True)
    assert two.authorized
    assert not q.began(one, wait=True)  # a later start came: the first one's report finds nothing


def process_line(store: Store) -> tuple[list[float], IntervalQueue]:
    """A line of this process whose monotonic clock the test moves (``now[0]``) and whose
    naps move the store's clock."""
    now = [100.0]
    q = IntervalQueue("q", interval="100ms", backend=store.backend(), monotonic=lambda: now[0],
                      sleep=lambda s: store.clock.advance(us=round(s * S)))  # fmt: skip
    return now, q


def test_a_body_that_stood_still_asks_first_and_does_not_begin_after_a_later_start(store: Store) -> None:
    now, q = process_line(store)
    other = queue(store)
    first, second = q.claim(), other.claim()
    store.clock.advance(us=I)
    one = q.wait_for_turn(first, reports=True)
    assert one.asked_at == 100.0
    now[0] += 0.1  # 100 ms later: sent without waiting, and it begins
    assert body_may_begin(q, one)
    three = q.wait_for_turn(q.claim(), reports=True)  # the next start, once its slot came (or just before)
    store.clock.now_us = three.now_us + BEGIN_WAIT_US  # then this process stands still past the start's wait
    assert other.start(second).authorized  # the line went on without its report
    now[0] += 0.3
    assert not body_may_begin(q, three)  # asked first: it must not begin now
    give_back_late_start(q, "its-task", three)


def test_a_body_that_stood_still_but_was_not_overtaken_begins(store: Store) -> None:
    now, q = process_line(store)
    one = q.wait_for_turn(q.claim(), reports=True)
    store.clock.now_us = one.now_us + 300 * MS
    now[0] += 0.3
    assert body_may_begin(q, one)  # asked and answered: still the last start, moved to now
    assert q.status().state.last_start_us == one.now_us + 300 * MS


def test_a_body_that_stood_still_after_its_report_while_a_later_start_came_does_not_begin(store: Store) -> None:
    """The report went quickly, then the process stood still (before the body) long enough
    for the next start to be authorized from it: asked, the store says the start no
    longer holds, and the body does not begin (without the question the two bodies would
    begin together). Not overtaken, it is placed where the body begins."""
    now, q = process_line(store)
    other = queue(store)
    first, second = q.claim(), other.claim()
    store.clock.advance(us=I)
    one = q.wait_for_turn(first, reports=True)
    assert body_may_begin(q, one)  # sent quickly
    store.clock.advance(us=I)  # this process stands still an interval before its body
    now[0] += 0.1
    assert other.start(second).authorized  # the next start, one interval after the report
    assert not still_holds(one)  # it must not begin now
    give_back_late_start(q, "its-task", one)
    three = q.wait_for_turn(q.claim(), reports=True)
    assert body_may_begin(q, three)
    store.clock.advance(us=30 * MS)  # stood still 30 ms: no later start could come
    now[0] += 0.03
    assert still_holds(three)
    assert q.status().state.last_start_us == three.now_us + 30 * MS  # placed where its body begins


def test_a_process_whose_body_reports_asks_ahead_of_its_slot_and_is_authorized_for_it(store: Store) -> None:
    _, q = process_line(store)
    first, second = q.claim(), q.claim()
    one = q.wait_for_turn(first, reports=True)
    assert body_may_begin(q, one)
    two = q.wait_for_turn(second, reports=True)  # asked three quarters of the lead (5 ms) ahead
    assert two.authorized and two.now_us == two.slot_us and 0 < two.wait_us <= 5 * MS
    assert store.clock.now_us < two.slot_us  # the body is held until the slot (body_may_begin)
    assert body_may_begin(q, two) and store.clock.now_us >= two.slot_us
