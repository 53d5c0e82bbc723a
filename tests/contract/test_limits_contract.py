"""Burst and window quota, alone and with the other rules, on every store (pinned clock).

Interval ``I`` = 100 ms unless said; a window quota of N per ``W`` counts cost units over a
sliding window on the store's clock; burst B lets B starts come closer than the interval
(docs/design.md, "The model": Burst, Window quota).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from siq_celery import CombinedQueue, ConfigurationError, IntervalQueue, Limit, Verdict
from siq_celery.observe.readings import drain_seconds
from siq_celery.types import Ticket
from tests.conftest import Store

I = 100_000
S = 1_000_000


def queue(store: Store, name: str = "q", interval: Any = "100ms", **options: Any) -> IntervalQueue:
    return IntervalQueue(name, interval=interval, backend=store.backend(), **options)


def at(store: Store, t_us: int) -> None:
    store.clock.now_us = t_us


def fill_window(store: Store, q: IntervalQueue, t0: int, tickets: list[Ticket], count: int = 3) -> None:
    """The first ``count`` tickets start one interval apart from ``t0``: a quota of ``count`` is full."""
    for n in range(count):
        at(store, t0 + (n + 1) * I)
        assert q.start(tickets[n]).authorized


def run_line(store: Store, q: IntervalQueue, tickets: list[Ticket], until_us: int, step_us: int) -> list[int]:
    """Every waiting ticket asks at every step, head first; the start times."""
    starts, waiting = [], list(tickets)
    while waiting and store.clock.now_us <= until_us:
        for ticket in list(waiting):
            if q.start(ticket).authorized:
                starts.append(store.clock.now_us)
                waiting.remove(ticket)
        store.clock.advance(us=step_us)
    return starts


def most_in_window(starts: list[int], width_us: int) -> int:
    """The most starts in any half-open window [x, x + width)."""
    starts = sorted(starts)
    return max(sum(1 for s in starts[i:] if s < a + width_us) for i, a in enumerate(starts))


# -- window quota ---------------------------------------------------------------------


def test_a_full_window_holds_the_head_until_its_oldest_start_leaves(store: Store) -> None:
    q = queue(store, quota="3/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    fill_window(store, q, t0, tickets)
    at(store, t0 + 4 * I)  # its interval slot: the window is full
    d = q.start(tickets[3])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + S and d.wait_us == t0 + I + S - store.clock.now_us
    at(store, t0 + I + S - 1)
    assert q.start(tickets[3]).verdict is Verdict.WAIT
    at(store, t0 + I + S)
    assert q.start(tickets[3]).authorized
    assert q.status().window_used == 3  # the first start left, the fourth came in


def test_the_line_behind_a_window_bound_head_waits_in_order(store: Store) -> None:
    q = queue(store, quota="3/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(6)
    fill_window(store, q, t0, tickets)
    at(store, t0 + I + S)  # ticket 4's window slot: ticket 5 must not take it
    d = q.start(tickets[4])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 2 * I + S
    assert q.start(tickets[3]).authorized
    at(store, t0 + 2 * I + S)
    assert q.start(tickets[5]).verdict is Verdict.WAIT  # behind ticket 5
    assert q.start(tickets[4]).authorized
    at(store, t0 + 3 * I + S)
    assert q.start(tickets[5]).authorized


def test_a_ticket_that_never_starts_costs_one_unit_of_the_window_and_no_more(store: Store) -> None:
    q = queue(store, quota="2/1s")
    t0 = q.ensure().last_start_us
    t1, t2, _lost, t4 = q.claim_many(4)
    at(store, t0 + I)
    assert q.start(t1).authorized
    at(store, t0 + 2 * I)
    assert q.start(t2).authorized
    at(store, t0 + I + S)  # the lost ticket's window slot: ticket 4 waits for its own
    d = q.start(t4)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 2 * I + S
    at(store, t0 + 2 * I + S)
    assert q.start(t4).authorized


def test_cost_counts_units_of_the_window(store: Store) -> None:
    q = queue(store, interval="1ms", quota="5/1s")
    t0 = q.ensure().last_start_us
    heavy = q.claim(cost=3)
    at(store, t0 + 1_000)
    assert q.start(heavy, cost=3).authorized
    light, heavier = q.claim(cost=2), q.claim(cost=3)
    at(store, t0 + 10_000)
    assert q.start(light, cost=2).authorized  # 3 + 2 = 5 units
    d = q.start(heavier, cost=3)  # 5 + 3 > 5: the first start's 3 units must leave
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 1_000 + S
    at(store, t0 + 1_000 + S)
    assert q.start(heavier, cost=3).authorized
    assert q.status().window_used == 5
    with pytest.raises(ConfigurationError, match="more than its quota"):
        q.claim(cost=6)


def test_a_quota_alone_has_no_spacing(store: Store) -> None:
    q = queue(store, interval=Limit(quota="3/1s"))
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(4)
    for n in range(3):  # back to back: "no spacing" is one microsecond
        at(store, t0 + 10 + n)
        assert q.start(tickets[n]).authorized
    d = q.start(tickets[3])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 10 + S


def test_claim_estimates_follow_the_window_pattern(store: Store) -> None:
    q = queue(store, quota="3/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(9)
    expected = [t0 + r * S + k * I for r in range(3) for k in (1, 2, 3)]
    assert [t.estimated_start_us for t in tickets] == expected
    assert [t.window_bound for t in tickets] == [False] * 3 + [True] * 6
    for ticket in tickets:  # each starts exactly at its estimate, not before
        at(store, ticket.estimated_start_us - 1)
        assert q.start(ticket).verdict is Verdict.WAIT
        at(store, ticket.estimated_start_us)
        assert q.start(ticket).authorized
    late = q.claim()  # claimed later, on a window kept: its estimate is the window's
    assert late.estimated_start_us == t0 + 3 * S + I


def test_a_head_the_window_holds_is_not_an_outage(store: Store) -> None:
    q = queue(store, quota="2/10s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    fill_window(store, q, t0, tickets, 2)
    at(store, t0 + 9 * S)  # the head's interval slot is 9 s past, but the window holds it
    d = q.start(tickets[2])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + 10 * S
    at(store, t0 + I + 10 * S)
    assert q.start(tickets[2]).authorized  # at the window's slot, not a settle later


def test_parked_tickets_are_released_by_their_window_slot(store: Store) -> None:
    q = queue(store, quota="2/1h")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    fill_window(store, q, t0, tickets, 2)
    assert tickets[2].estimated_start_us == t0 + I + 3600 * S
    from siq_celery.parked import ParkedTask

    assert q.backend.park(q.name, tickets[2].epoch, [ParkedTask(3, "t3", "{}")])
    horizon = 600 * S
    at(store, t0 + I + 3600 * S - horizon - 1)
    assert q.backend.release(q.name, horizon).tasks == []
    at(store, t0 + I + 3600 * S - horizon)
    released = q.backend.release(q.name, horizon).tasks
    assert [(p.ticket, eta) for p, eta in released] == [(3, t0 + I + 3600 * S)]


def test_pause_resume_and_reset_keep_the_window(store: Store) -> None:
    q = queue(store, quota="2/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(2)
    fill_window(store, q, t0, tickets, 2)
    q.pause()
    at(store, t0 + 5 * I)
    q.resume(grace=0)
    d = q.start(q.claim())
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + S
    state = q.reset()
    assert (state.quota, state.window_us) == (2, S)
    d = q.start(q.claim())
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + S
    assert q.status().window_used == 2


def test_a_quota_in_a_combined_start_is_atomic(store: Store) -> None:
    backend = store.backend()
    fast = IntervalQueue("{geo}per-second", interval="100ms", backend=backend)
    daily = IntervalQueue("{geo}per-day", interval=Limit(quota="2/d"), backend=backend)
    both = CombinedQueue([fast, daily])
    assert both.primary is daily  # the limit that binds: 2 a day
    t0 = fast.ensure().last_start_us
    daily.ensure()
    for n in range(2):
        at(store, t0 + (n + 1) * I)
        assert all(d.authorized for d in both.start(both.claim()))
    at(store, t0 + 3 * I)
    ticket = both.claim()
    decisions = both.start(ticket)
    assert [d.verdict for d in decisions] == [Verdict.WAIT, Verdict.WAIT]
    assert decisions[1].slot_us == t0 + I + 86_400 * S
    assert fast.status().state.started_us == t0 + 2 * I, "nothing recorded in the queue that would allow it"
    assert fast.start(fast.claim()).authorized  # the per-second queue alone goes on


def test_a_rate_with_a_long_period_among_several_limits_is_refused() -> None:
    from siq_celery.limits import check_not_a_quota

    with pytest.raises(ConfigurationError, match=r"Limit\(quota='10000/d'\)"):
        check_not_a_quota("10000/d", "task geo")
    check_not_a_quota("10/2s", "task geo")
    check_not_a_quota("1/d", "task geo")


# -- burst ----------------------------------------------------------------------------


@pytest.mark.parametrize("burst", [0, 2])
def test_a_burst_bounds_every_window_by_its_width_over_the_interval_plus_burst(store: Store, burst: int) -> None:
    q = queue(store, burst=burst)
    t0 = q.ensure().last_start_us
    at(store, t0 + 10 * S)  # idle
    starts = run_line(store, q, q.claim_many(20), t0 + 20 * S, 10_000)
    assert len(starts) == 20
    for width in (1, 50_000, I, 150_000, 2 * I, 250_000, 5 * I, 10 * I):
        assert most_in_window(starts, width) <= math.ceil(width / I) + burst
    assert starts[: burst + 1] == [t0 + 10 * S] * (burst + 1)  # after idleness, burst + 1 at once
    assert most_in_window(starts, 1) == burst + 1


def test_a_late_line_catches_up_by_at_most_the_burst(store: Store) -> None:
    for burst, caught_up in ((0, 0), (2, 2), (10, 5)):
        q = queue(store, f"late{burst}", burst=burst)
        q.ensure()
        tickets = q.claim_many(12)
        head_due = tickets[0].estimated_start_us
        at(store, head_due + 5 * I)  # the whole line is 5 intervals late
        starts = run_line(store, q, tickets, head_due + 20 * S, 10_000)
        by_end = sum(1 for s in starts if s <= head_due + 10 * I)  # slots due by then: 11
        assert by_end == 11 - 5 + caught_up, (burst, starts)
        assert most_in_window(starts, 1) == min(burst, 5) + 1


def test_a_new_state_and_a_back_off_leave_no_burst_credit(store: Store) -> None:
    q = queue(store, burst=3)
    t0 = store.clock.now_us
    q.ensure()
    tickets = q.claim_many(3)
    at(store, t0 + I - 1)
    assert q.start(tickets[0]).verdict is Verdict.WAIT  # a new state waits one interval
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized
    at(store, t0 + 10 * S)
    q.backoff(1.0)
    at(store, t0 + 11 * S - 1)
    assert q.start(tickets[1]).verdict is Verdict.WAIT
    at(store, t0 + 11 * S)
    assert q.start(tickets[1]).authorized
    assert q.start(tickets[2]).verdict is Verdict.WAIT  # the hold spent the credit


def test_burst_and_quota_together(store: Store) -> None:
    q = queue(store, burst=4, quota="6/1s")
    t0 = q.ensure().last_start_us
    at(store, t0 + 10 * S)
    starts = run_line(store, q, q.claim_many(14), t0 + 14 * S, 10_000)
    assert len(starts) == 14
    assert most_in_window(starts, 1) == 5  # burst + 1 at once
    assert most_in_window(starts, S) <= 6  # and never more than the quota in any second
    for width in (1, I, 3 * I, S):
        assert most_in_window(starts, width) <= math.ceil(width / I) + 4


def test_a_restamped_start_leaves_the_window_from_its_restamped_time(store: Store) -> None:
    q = queue(store, quota="1/1s")
    t0 = q.ensure().last_start_us
    first = q.claim()
    at(store, t0 + I)
    assert q.start(first).authorized
    at(store, t0 + I + 500)  # the body began half a millisecond later
    assert q.backend.restamp(q.name, first.epoch, t0 + I) == t0 + I + 500
    d = q.start(q.claim())
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + 500 + S


def test_a_late_body_under_a_burst_is_not_restamped_and_the_line_catches_up(store: Store) -> None:
    """With a burst the bound is on the store's clock; a late body is what the credit is
    for. Re-stamping it would move the line's grid forward and spend the credit."""
    q = queue(store, burst=2)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized
    at(store, t0 + I + 3 * I)  # the reply came back three intervals late
    assert q.backend.restamp(q.name, tickets[0].epoch, t0 + I) is None
    assert q.start(tickets[1]).authorized and q.start(tickets[2]).authorized  # caught up at once


def test_a_combined_start_creates_each_queue_with_its_own_limits(store: Store) -> None:
    backend = store.backend()
    slow = IntervalQueue("{g}slow", interval="1s", backend=backend)
    fast = IntervalQueue("{g}fast", interval="10ms", burst=3, quota="50/s", backend=backend)
    both = CombinedQueue([slow, fast])
    t0 = store.clock.now_us
    ticket = both.claim()  # a fresh store: the claim creates the primary, the start the secondary
    at(store, t0 + 10 * S)
    both.start(ticket)
    state = fast.status().state
    assert (state.burst, state.quota, state.window_us) == (3, 50, S)


def test_a_claim_retried_after_a_script_flush_keeps_the_limits(store: Store) -> None:
    if store.kind != "redis":
        pytest.skip("a pipelined claim, retried when the server lost its scripts, is a plain Redis path")
    import redis

    q = queue(store, burst=2, quota="5/1s")
    redis.Redis.from_url(store.url).script_flush()
    q.backend.claim_later(q.name, 1, I, "e1", limits=q.limits).result()
    state = q.status().state
    assert (state.burst, state.quota, state.window_us) == (2, 5, S)


def as_an_earlier_version_wrote_it(store: Store, q: IntervalQueue) -> None:
    """Rewrite a queue's window as the versions that did not number its units left it.
    Redis: the layout that numbered its starts one by one (member '<seq>:<cost>', the
    state's w_seq). SQLite: a database without siq_window_units and its triggers, the
    starts in siq_window only, opened again as a new process opens it."""
    if store.kind == "sqlite":
        import sqlite3

        conn = sqlite3.connect(store.url.removeprefix("sqlite:///"), isolation_level=None)
        for trigger in ("siq_window_count_in", "siq_window_count_out", "siq_window_count_moved"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP TABLE siq_window_units")
        conn.close()
        q.backend.close()
        return
    client = store.redis_client("the layout an earlier version wrote is Redis's")
    state, window = f"{store.prefix}:{{{q.name}}}:state", f"{store.prefix}:{{{q.name}}}:window"
    starts = client.zrange(window, 0, -1, withscores=True)
    client.delete(window)
    for seq, (member, t) in enumerate(starts, 1):
        client.zadd(window, {f"{seq}:{member.decode().split(':')[1]}": t})
    client.hdel(state, "w_cum")
    client.hset(state, "w_seq", len(starts))


def window_numbers(store: Store, q: IntervalQueue) -> list[tuple[int, int]]:
    """A SQLite queue's window starts, oldest first: (cost, units up to and including it)."""
    import sqlite3

    conn = sqlite3.connect(store.url.removeprefix("sqlite:///"))
    try:
        rows = conn.execute(
            "SELECT cost, cum FROM siq_window_units WHERE prefix=? AND queue=? ORDER BY t_us, cum",
            (store.prefix, q.name),
        ).fetchall()
    finally:
        conn.close()
    return [(int(c), int(n)) for c, n in rows]


@pytest.mark.parametrize("written_by", ["this version", "an earlier version"])
def test_starts_of_every_cost_leave_the_window_each_with_its_own_units(store: Store, written_by: str) -> None:
    """Mixed costs, counted and trimmed: a start of cost 2 holds two units until it leaves,
    and what is left of the window is the sum of the costs still in it. The same from a
    window an earlier version wrote (Redis: numbered anew at the first write that reads it)."""
    q = queue(store, interval="1ms", quota="6/1s")
    t0 = q.ensure().last_start_us
    costs = [1, 2, 1, 2]  # 6 units: the window is full
    tickets = q.claim_costs(costs)
    for n, (ticket, cost) in enumerate(zip(tickets, costs, strict=True)):
        at(store, t0 + (n + 1) * 10_000)
        assert q.start(ticket, cost=cost).authorized
    if written_by != "this version":
        as_an_earlier_version_wrote_it(store, q)
    assert q.status().window_used == 6
    one, two = q.claim(), q.claim(cost=2)
    d = q.start(one)  # the oldest start (cost 1) must leave
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 10_000 + S
    at(store, t0 + 10_000 + S)
    assert q.status().window_used == 5  # read only: the same again below
    assert q.status().window_used == 5
    assert q.start(one).authorized  # 5 + 1
    if written_by != "this version" and store.kind == "sqlite":  # numbered by units when opened
        assert window_numbers(store, q) == [(2, 3), (1, 4), (2, 6), (1, 7)]
    elif written_by != "this version":  # numbered by units once, by the first write that read it
        client = store.redis_client("the layout an earlier version wrote is Redis's")
        members = client.zrange(f"{store.prefix}:{{{q.name}}}:window", 0, -1)
        assert [m.decode().split(":")[1] for m in members] == ["2", "1", "2", "1"]
        assert all(len(m.decode().split(":")[0]) == 16 for m in members)
    d = q.start(two, cost=2)  # two units: the cost-2 start at t0 + 20 ms must leave
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 20_000 + S
    at(store, t0 + 20_000 + S - 1)
    assert q.start(two, cost=2).verdict is Verdict.WAIT
    at(store, t0 + 20_000 + S)
    assert q.status().window_used == 4  # the cost-2 start left with both its units
    assert q.start(two, cost=2).authorized
    assert q.status().window_used == 6
    at(store, t0 + 40_000 + S)  # the second cost-2 start leaves: the window holds the last two
    assert q.status().window_used == 3
    three = q.claim(cost=3)
    d = q.start(three, cost=3)
    assert d.verdict is Verdict.AUTHORIZED
    at(store, t0 + 50 * S)  # every start left
    assert q.status().window_used == 0
    assert q.start(q.claim(cost=6), cost=6).authorized
    assert q.status().window_used == 6


@pytest.mark.parametrize("seed", range(3))
def test_a_sqlite_window_beside_a_process_of_an_earlier_version_counts_as_the_model(tmp_path: Any, seed: int) -> None:
    """A process of an earlier version writes siq_window by its own statements (an INSERT
    naming no columns, its trim, its re-stamp), which number nothing: the starts it records,
    in time order or not, and the ones it moves are counted as the model's window counts
    them (rules.ListWindow), read by this version's numbers after each write."""
    import random
    import sqlite3

    from siq_celery.backends import backend_from_url
    from siq_celery.rules import ListWindow
    from siq_celery.testing import PinnedClock

    rng = random.Random(seed)
    backend = backend_from_url(f"sqlite:///{tmp_path}/siq.db", clock=PinnedClock())
    backend.warm()  # the tables and triggers this version makes
    earlier = sqlite3.connect(f"{tmp_path}/siq.db", isolation_level=None)
    model, key, times, newest = ListWindow(), ("siq", "q"), set(), 0

    def unused(low: int, high: int) -> int:  # two starts at one time: the model moves either
        while (t := rng.randrange(low, high)) in times:
            pass
        times.add(t)
        return t

    for _ in range(300):
        by_earlier, op = rng.random() < 0.5, rng.random()
        if op < 0.6:  # a start, one in four before the newest
            early = newest and rng.random() < 0.25
            t, cost = unused(newest - 5_000, newest) if early else unused(newest, newest + 1_000), rng.randint(1, 3)
            newest = max(newest, t)
            model.add(t, cost)
            if by_earlier:
                earlier.execute("INSERT INTO siq_window VALUES (?, ?, ?, ?)", (*key, t, cost))
        elif op < 0.8 and model.entries:  # a re-stamp moves a recent start later, past others or not
            from_us = rng.choice(model.entries[-5:])[0]
            to_us = unused(from_us + 1, from_us + 3_000)
            times.discard(from_us)
            newest = max(newest, to_us)
            model.move(from_us, to_us)
            if by_earlier:
                earlier.execute(
                    "UPDATE siq_window SET t_us=? WHERE rowid = (SELECT rowid FROM siq_window WHERE prefix=? AND "
                    "queue=? AND t_us=? ORDER BY rowid DESC LIMIT 1)",
                    (to_us, *key, from_us),
                )
        elif model.entries:  # the oldest leave
            cutoff = rng.choice(model.entries[: max(1, len(model.entries) // 4)])[0]
            times.difference_update(t for t, _ in model.entries if t <= cutoff)
            model.trim(cutoff)
            if by_earlier:
                earlier.execute("DELETE FROM siq_window WHERE prefix=? AND queue=? AND t_us <= ?", (*key, cutoff))
        else:
            continue
        with backend.transaction("q") as tx:  # type: ignore[attr-defined]
            window = tx.window()
            if not by_earlier:  # the same write by this version
                if op < 0.6:
                    window.add(t, cost)
                elif op < 0.8:
                    window.move(from_us, to_us)
                else:
                    window.trim(cutoff)
            assert window.used() == model.used()
            assert [window.unit_time(u) for u in range(1, model.used() + 1)] == [
                model.unit_time(u) for u in range(1, model.used() + 1)
            ]
            with pytest.raises(IndexError):
                window.unit_time(model.used() + 1)
    earlier.close()


def test_a_costly_start_beside_starts_an_earlier_version_recorded(store: Store) -> None:
    """Starts of cost 1 an earlier version recorded are read by rank, unnumbered; the first
    start of cost 2 beside them has them numbered first, so each is counted once."""
    q = queue(store, interval="1ms", quota="5/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    for n, ticket in enumerate(tickets):
        at(store, t0 + (n + 1) * 10_000)
        assert q.start(ticket).authorized
    as_an_earlier_version_wrote_it(store, q)
    at(store, t0 + 40_000)
    assert q.start(q.claim(cost=2), cost=2).authorized
    assert q.status().window_used == 5
    one = q.claim()
    d = q.start(one)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 10_000 + S
    at(store, t0 + 30_000 + S)  # three starts of cost 1 left
    assert q.status().window_used == 2
    assert q.start(one).authorized
    d = q.start(q.claim(cost=3), cost=3)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 40_000 + S  # the cost-2 start must leave


def test_a_start_costlier_than_a_quota_lowered_since_counts_all_its_units(store: Store) -> None:
    """A start of cost 2 under a quota of 2, then the quota lowered to 1 (an operator's
    override; a deploy's declaration does the same): the window holds 2 units, more than the
    new quota, and the next start waits until they leave. (Redis read every start kept as
    holding at most the quota in force, found none, and let the start in at once: found by
    the differential test, tests/test_differential.py.)"""
    q = queue(store, interval="10ms", quota="2/50ms")
    t0 = q.ensure().last_start_us
    heavy = q.claim(cost=2)
    at(store, t0 + 10_000)
    assert q.start(heavy, cost=2).authorized
    q.set_limits(quota="1/50ms")
    status = q.status()
    assert (status.window_used, status.window_next_us) == (2, t0 + 10_000 + 50_000)
    light = q.claim()
    at(store, t0 + 30_000)  # the spacing lets it in: the cost-2 start used its last slot at 20 ms
    d = q.start(light)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 60_000
    at(store, t0 + 60_000)
    assert q.start(light).authorized


def test_a_start_recorded_before_the_newest_counts_at_its_own_time(store: Store) -> None:
    """The store clock stepped back between two starts (a pinned clock here; Redis TIME after
    a step of the host's clock): the window counts each start from its own time."""
    q = queue(store, burst=3, quota="4/1s")  # a burst lets a start come before the last one
    t0 = q.ensure().last_start_us
    costs = [2, 1, 1]
    tickets = q.claim_costs(costs)
    for t, ticket, cost in zip((t0 + 5 * I, t0 + 4 * I, t0 + 6 * I), tickets, costs, strict=True):
        at(store, t)
        assert q.start(ticket, cost=cost).authorized
    assert q.status().window_used == 4
    late = q.claim(cost=2)
    d = q.start(late, cost=2)  # the start at 4 I leaves first (1 unit), then the cost-2 one at 5 I
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 5 * I + S
    at(store, t0 + 4 * I + S)
    assert q.status().window_used == 3
    at(store, t0 + 5 * I + S)
    assert q.start(late, cost=2).authorized
    assert q.status().window_used == 3


def test_a_costly_start_deep_in_the_window_places_the_line_by_units(store: Store) -> None:
    """The unit that lets the head in is found by units, not by starts: one start of cost 3
    among starts of cost 1 moves every later window slot by two starts."""
    q = queue(store, interval=Limit(quota="8/1s"))
    t0 = q.ensure().last_start_us
    costs = [1, 1, 3, 1, 1, 1]  # 8 units in 6 starts
    tickets = q.claim_costs(costs)
    for n, (ticket, cost) in enumerate(zip(tickets, costs, strict=True)):
        at(store, t0 + (n + 1) * I)
        assert q.start(ticket, cost=cost).authorized
    line = q.claim_many(4)
    at(store, t0 + 7 * I)
    assert [q.start(t).slot_us for t in line[:1]] == [t0 + I + S]
    status = q.status()
    assert status.window_used == 8 and status.next_start_us == t0 + I + S
    at(store, t0 + I + S)
    assert q.start(line[0]).authorized
    d = q.start(line[1])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 2 * I + S
    at(store, t0 + 2 * I + S)
    assert q.start(line[1]).authorized
    d = q.start(line[2])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 3 * I + S
    at(store, t0 + 3 * I + S)
    assert q.start(line[2]).authorized
    at(store, t0 + 3 * I + S + 1)  # the cost-3 start left 3 units: the next one a microsecond later
    assert q.start(line[3]).authorized
    assert q.status().window_used == 7  # 8 - 1 - 1 - 3 + 4, and one unit free


def fill_full_window_redis(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, costs: list[int]
) -> tuple[IntervalQueue, int]:
    """Starts of ``costs`` 10 us apart from t0 on a Redis store, made by the start script
    itself, its calls pipelined (one round trip each would take a minute on a busy
    machine): each is queued as the start would send it. The queue and t0."""
    import redis

    from siq_celery.backends import backend_from_url
    from siq_celery.testing import PinnedClock

    clock = PinnedClock()
    backend = backend_from_url(redis_url, clock=clock)
    q = IntervalQueue("full", interval=Limit(quota="20000/1d"), backend=backend)
    t0 = q.ensure().last_start_us
    tickets = q.claim_costs(costs)
    client = redis.Redis.from_url(redis_url)
    backend.warm()
    sha, pipe = backend._script("start").sha, client.pipeline(transaction=False)  # type: ignore[attr-defined]

    def queued(name: str, queue: str, keys: Any, args: Any) -> list[Any]:
        pipe.evalsha(sha, len(keys), *keys, clock(), *args)
        return [b"authorized", 0, 0, 0, 0, 0, b"", 0]

    with monkeypatch.context() as patch:
        patch.setattr(backend, "_run", queued)
        for n, (ticket, cost) in enumerate(zip(tickets, costs, strict=True)):
            clock.now_us = t0 + 10 * (n + 1)
            q.start(ticket, cost=cost)
            if len(pipe) == 1_000 or n == len(costs) - 1:
                assert {r[0] for r in pipe.execute()} == {b"authorized"}
    return q, t0


def fill_full_window_sqlite(path: str, costs: list[int]) -> tuple[IntervalQueue, int]:
    """Starts of ``costs`` 10 us apart from t0 in a SQLite store's window, written by the
    store's own window in one transaction (20,000 starts one by one take half a minute on
    a busy machine); the line holds no ticket. The queue and t0."""
    from siq_celery.backends import backend_from_url
    from siq_celery.testing import PinnedClock

    backend = backend_from_url(f"sqlite:///{path}", clock=PinnedClock())
    q = IntervalQueue("full", interval=Limit(quota="20000/1d"), backend=backend)
    t0 = q.ensure().last_start_us
    with backend.transaction(q.name) as tx:  # type: ignore[attr-defined]
        window = tx.window()
        for n, cost in enumerate(costs):
            window.add(t0 + 10 * (n + 1), cost)
    return q, t0


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_a_full_window_with_a_costly_start_is_not_scanned_on_every_decision(
    kind: str, request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision on a full window of 20,000 starts must not read them all because one of
    them cost 2. Redis: the store is by default the broker too (it took 63 ms of the
    server's time per decision, against 0.17 ms with every cost 1). SQLite: a decision
    holds the database's write lock (it took 125 ms)."""
    import statistics
    import time

    costs = [1] * 19_998 + [2]  # 20,000 units in 19,999 starts
    if kind == "redis":
        import redis

        redis_url = request.getfixturevalue("redis_url")
        q, t0 = fill_full_window_redis(redis_url, monkeypatch, costs)
        client = redis.Redis.from_url(redis_url)
    else:
        q, t0 = fill_full_window_sqlite(f"{tmp_path}/siq.db", costs)
    assert q.status().window_used == 20_000
    waiting = q.claim_many(2)
    if kind == "redis":
        client.config_resetstat()
    asks, took = 20, []
    for n in range(asks):
        q.backend.clock.now_us = t0 + 200_000 + n * 1_000  # type: ignore[attr-defined]
        began = time.perf_counter()
        d = q.start(waiting[n % 2])
        took.append(time.perf_counter() - began)
        assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 10 * (n % 2 + 1) + 24 * 3600 * S
    if kind == "redis":
        stats = client.info("commandstats")["cmdstat_evalsha"]
        assert stats["calls"] == asks
        print(f"server time per decision on a full window: {stats['usec_per_call']:.0f} us")
        assert stats["usec_per_call"] < 2_000
    else:
        median = statistics.median(took) * 1e6
        print(f"time per decision on a full window (median of {asks}): {median:.0f} us")
        assert median < 5_000


@pytest.mark.parametrize("read_status", [False, True])
def test_a_status_read_between_starts_changes_no_decision(store: Store, read_status: bool) -> None:
    q = queue(store, interval="50ms", quota="5/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(6)
    for n in range(5):
        at(store, t0 + (n + 1) * 50_000)
        assert q.start(tickets[n]).authorized
    at(store, t0 + 5 * 50_000 + 1_300_000)  # the window held the head until t0 + 1.05 s: not late
    if read_status:
        assert q.status().window_used == 0  # every start left the window
    d = q.start(tickets[5])
    assert (d.verdict, d.wait_us) == (Verdict.AUTHORIZED, 0)


def lose_state(store: Store, q: IntervalQueue) -> None:
    """The queue's state is lost (evicted, deleted by hand), its window's starts not."""
    if store.kind == "memory":
        q.backend.store.states.pop(q.name)  # type: ignore[attr-defined]
    elif store.kind == "sqlite":
        import sqlite3

        with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
            conn.execute("DELETE FROM siq_queues WHERE prefix=? AND queue=?", (store.prefix, q.name))
    else:
        from siq_celery.backends.redis import redis_client_from_url

        redis_client_from_url(store.url).delete(f"{store.prefix}:{{{q.name}}}:state")


def test_a_lost_state_forgets_its_window(store: Store) -> None:
    q = queue(store, quota="2/1s")
    t0 = q.ensure().last_start_us
    at(store, t0 + I)
    assert q.start(q.claim(cost=2), cost=2).authorized  # the quota is full
    lose_state(store, q)
    at(store, t0 + 3 * I)
    new = q.claim_many(3)  # a new life: it waits one interval, then may use a whole quota
    for n in range(2):
        at(store, t0 + (n + 4) * I)
        assert q.start(new[n]).authorized
    at(store, t0 + 6 * I)
    d = q.start(new[2])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 4 * I + S  # the new life's first start leaves
    assert q.status().window_used == 2


def test_a_window_whose_starts_vanished_counts_none(store: Store) -> None:
    client = store.redis_client("only Redis keeps the window apart from its count (w_used), in a key that can expire")
    q = queue(store, quota="2/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    fill_window(store, q, t0, tickets, 2)
    client.delete(f"{store.prefix}:{{{q.name}}}:window")  # expired before the state
    for n in range(2, 4):
        at(store, t0 + (n + 1) * I)
        assert q.start(tickets[n]).authorized
    at(store, t0 + 5 * I)
    d = q.start(tickets[4])
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 3 * I + S


# -- what the status says: the next start and the time to drain -----------------------


def test_the_status_next_start_is_when_the_full_window_lets_the_head_in(store: Store) -> None:
    """As a claim and a start compute it: the oldest start in the window must leave."""
    q = queue(store, quota="3/1s")
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    fill_window(store, q, t0, tickets)
    at(store, t0 + 4 * I)
    status = q.status()
    assert status.next_start_us == t0 + I + S  # not the head's interval slot, t0 + 4 I
    assert status.as_dict()["next_start"] == (t0 + I + S) / 1e6
    assert q.start(tickets[3]).slot_us == status.next_start_us
    # the last ticket claimed (5) is due when the second start leaves: the backlog drains then
    assert drain_seconds(status) == (t0 + 2 * I + S - (t0 + 4 * I)) / 1e6
    at(store, t0 + I + S)
    assert q.start(tickets[3]).authorized
    assert q.status().next_start_us == t0 + 2 * I + S  # ticket 5: the second start leaves then


def test_the_status_of_an_idle_window_bound_queue_agrees_with_a_claim(store: Store) -> None:
    q = queue(store, interval=Limit(quota="2/1s"))  # no spacing of its own
    t0 = q.ensure().last_start_us
    for n, ticket in enumerate(q.claim_many(2)):
        at(store, t0 + 10 + n)
        assert q.start(ticket).authorized
    at(store, t0 + 500_000)
    assert q.status().next_start_us == t0 + 10 + S
    assert q.claim().estimated_start_us == t0 + 10 + S


def test_the_status_next_start_and_drain_count_the_burst_credit(store: Store) -> None:
    """With burst credit the next start may come before the last start plus the interval,
    and a backlog drains faster than one per interval: as the claims' estimates say."""
    q = queue(store, burst=2)
    t0 = store.clock.now_us
    q.ensure()
    now = t0 + 10 * S
    at(store, now)  # idle: the credit is back
    tickets = q.claim_many(5)
    status = q.status()
    assert status.next_start_us == now == tickets[0].estimated_start_us
    assert [t.estimated_start_us for t in tickets] == [now, now, now, now + I, now + 2 * I]
    assert drain_seconds(status) == 2 * I / 1e6  # not one interval per ticket behind the head
    assert q.start(tickets[0]).authorized
    status = q.status()
    assert status.next_start_us == now  # not the last start plus the interval
    assert q.start(tickets[1]).authorized and q.start(tickets[2]).authorized
    status = q.status()
    assert status.next_start_us == now + I and drain_seconds(status) == 2 * I / 1e6
    assert q.start(tickets[3]).verdict is Verdict.WAIT
