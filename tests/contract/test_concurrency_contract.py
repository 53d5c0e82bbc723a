"""The concurrency cap, alone and with the other rules, on every store (pinned clock).

A start takes a lease (one per running body, whatever its cost) in the same atomic step as its
authorization, only while fewer than N live leases exist; the finish gives it back in its own
step; a lease not renewed expires ``lease_timeout_us`` after the start or its last renewal
(docs/design.md, "The model": Concurrency cap).
"""

from __future__ import annotations

from typing import Any

import pytest

from siq_celery import CombinedQueue, IntervalQueue, Limit, Verdict
from siq_celery.rules import LEASE_GRACE_US, LEASE_POLL_US
from siq_celery.types import Decision
from tests.conftest import Store

I = 100_000
S = 1_000_000
TIMEOUT = 3 * S


def queue(
    store: Store, name: str = "q", interval: Any = None, *, timeout: int = TIMEOUT, **options: Any
) -> IntervalQueue:
    return IntervalQueue(name, interval=interval, backend=store.backend(lease_timeout_us=timeout), **options)


def at(store: Store, t_us: int) -> None:
    store.clock.now_us = t_us


def later(store: Store, us: int = 1) -> Store:
    """A start without spacing still comes 1 µs after the one before (the cap of no spacing)."""
    store.clock.advance(us=us)
    return store


def in_flight(q: IntervalQueue) -> int:
    return q.status().in_flight


def test_a_full_cap_holds_a_start_whose_slot_came_and_the_finish_gives_the_lease_back(store: Store) -> None:
    q = queue(store, concurrency=2)  # no spacing of its own: only the cap binds
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 10)
    first = q.start(tickets[0], task_id="a")
    second = q.start(tickets[1], task_id="b") if later(store) else None
    assert second is not None and first.authorized and second.authorized and first.lease and second.lease != first.lease
    assert in_flight(q) == 2 and q.status().as_dict()["in_flight"] == 2
    held = q.start(tickets[2], task_id="c") if later(store) else None
    assert held is not None and held.verdict is Verdict.WAIT and held.full and held.wait_us == LEASE_POLL_US
    assert not held.lease
    q.finish("a", lease=first.lease)
    assert in_flight(q) == 1
    third = q.start(tickets[2], task_id="c")
    assert third.authorized and third.lease
    assert in_flight(q) == 2


def test_a_finish_gives_back_its_own_lease_only(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(2)
    at(store, t0 + 10)
    assert q.start(tickets[0], task_id="a").lease == "a"  # a run's lease is named by its task id
    q.finish("a", lease="a:not-this-one")
    assert in_flight(q) == 1
    assert later(store) and q.start(tickets[1]).full
    q.finish("a")  # no lease named: the run's own
    assert in_flight(q) == 0


def test_a_lease_not_renewed_expires_after_the_lease_timeout(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(2)
    at(store, t0 + 10)
    assert q.start(tickets[0], task_id="a").authorized  # its process dies: no finish ever comes
    at(store, t0 + 10 + TIMEOUT - 4_000)
    d = q.start(tickets[1])
    assert d.full and d.wait_us == 4_000  # asks again at the expiry, not a poll later
    at(store, t0 + 10 + TIMEOUT - 1)
    assert q.start(tickets[1]).full
    at(store, t0 + 10 + TIMEOUT)
    assert in_flight(q) == 0
    assert q.start(tickets[1]).authorized


def test_renewing_a_lease_keeps_it_while_its_body_runs(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(2)
    at(store, t0 + 10)
    d = q.start(tickets[0], task_id="a")
    at(store, t0 + 2 * S)
    assert q.renew_leases([d.lease, "gone:member"]) == 1  # a member not held is not taken
    at(store, t0 + 10 + TIMEOUT)
    assert q.start(tickets[1]).full  # renewed: not expired
    at(store, t0 + 2 * S + TIMEOUT - 1)
    assert q.start(tickets[1]).full
    at(store, t0 + 2 * S + TIMEOUT)
    assert q.renew_leases([d.lease]) == 0  # expired: a renewal does not bring it back
    assert q.start(tickets[1]).authorized
    assert in_flight(q) == 1


def test_the_line_keeps_its_order_when_a_lease_frees(store: Store) -> None:
    q = queue(store, interval="100ms", concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + I)
    d = q.start(tickets[0])
    assert d.authorized
    at(store, t0 + 5 * I)  # the slots of tickets 2 and 3 passed while the cap was full
    assert q.start(tickets[2]).full and q.start(tickets[1]).full
    at(store, t0 + 6 * I)
    q.finish("x", lease=d.lease)  # the release: the head (ticket 2) is due now, ticket 3 an interval on
    late = q.start(tickets[2])
    assert late.verdict is Verdict.WAIT and not late.full and late.slot_us == t0 + 7 * I
    second = q.start(tickets[1])
    assert second.authorized and second.slot_us == t0 + 6 * I
    q.finish("y", lease=second.lease)
    at(store, t0 + 7 * I)
    assert q.start(tickets[2]).authorized


def test_a_freed_lease_goes_to_the_head_of_the_line_not_to_the_first_to_ask(store: Store) -> None:
    """A cap alone (no spacing of its own): the tickets behind the head do not take the lease
    that frees while the head, which polls the full cap every LEASE_POLL_US, has yet to ask."""
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 10)
    first = q.start(tickets[0], task_id="a")
    assert first.authorized
    at(store, t0 + 1_000)
    assert q.start(tickets[1], task_id="b").full and q.start(tickets[2], task_id="c").full
    at(store, t0 + 500_000)
    q.finish("a", lease=first.lease)
    at(store, t0 + 501_000)  # ticket 3 asks first, 1 ms after the release
    third = q.start(tickets[2], task_id="c")
    assert third.verdict is Verdict.WAIT and third.full and not third.lease and 0 < third.wait_us <= LEASE_POLL_US
    assert in_flight(q) == 0
    at(store, t0 + 509_000)  # the head's poll
    second = q.start(tickets[1], task_id="b")
    assert second.authorized and second.lease
    assert later(store) and q.start(tickets[2], task_id="c").full
    q.finish("b", lease=second.lease)
    assert q.start(tickets[2], task_id="c").authorized  # now the head


def test_leases_freed_together_go_to_the_first_tickets_in_line(store: Store) -> None:
    q = queue(store, concurrency=2)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    at(store, t0 + 10)
    a = q.start(tickets[0], task_id="a")
    b = q.start(tickets[1], task_id="b") if later(store) else a
    at(store, t0 + 1_000)
    assert all(q.start(t).full for t in tickets[2:])
    at(store, t0 + 500_000)
    q.finish("a", lease=a.lease)
    q.finish("b", lease=b.lease)
    at(store, t0 + 501_000)
    assert q.start(tickets[4]).full  # tickets 3 and 4 are ahead of it: the two leases are theirs
    assert q.start(tickets[3]).authorized  # only ticket 3 is ahead of it: one of the two is its own
    assert later(store) and q.start(tickets[2]).authorized
    assert in_flight(q) == 2 and later(store) and q.start(tickets[4]).full


def test_a_head_that_never_asks_keeps_a_freed_lease_for_the_grace_only(store: Store) -> None:
    """The head's claim on a freed lease lapses LEASE_GRACE_US after its slot (the release):
    a ticket that never starts costs that much of the lease, no more."""
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 10)
    first = q.start(tickets[0], task_id="a")
    release = t0 + 500_000
    at(store, release)
    q.finish("a", lease=first.lease)
    at(store, release + 5_000)
    waiting = q.start(tickets[2])
    assert waiting.full and waiting.wait_us == LEASE_POLL_US
    at(store, release + LEASE_GRACE_US - 3_000)
    assert q.start(tickets[2]).wait_us == 3_000  # asks again when the head's claim lapses
    at(store, release + LEASE_GRACE_US)
    third = q.start(tickets[2])
    assert third.authorized  # ticket 2 never came: passed over
    q.finish("c", lease=third.lease)
    assert later(store) and q.start(tickets[1]).authorized  # it takes the next free lease when it comes


def test_a_spacing_longer_than_the_grace_orders_the_line_as_before(store: Store) -> None:
    """With an interval of at least LEASE_GRACE_US the tickets behind the head are due
    after the head's claim lapses anyway: the claim adds no wait."""
    q = queue(store, interval="50ms", concurrency=2)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 50_000)
    assert q.start(tickets[0]).authorized
    at(store, t0 + 150_000)  # ticket 2 (due at 100 ms) never asks; ticket 3 is due now
    assert q.start(tickets[2]).authorized


def test_an_expiry_frees_the_line_from_the_expiry(store: Store) -> None:
    q = queue(store, interval="100ms", concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized  # never finishes
    expiry = t0 + I + TIMEOUT
    at(store, expiry + I // 2)  # no one asked between the expiry and now
    d = q.start(tickets[2])
    assert d.verdict is Verdict.WAIT and d.slot_us == expiry + I  # due an interval behind the head
    assert q.start(tickets[1]).authorized


def test_a_head_the_cap_holds_for_long_is_not_an_outage(store: Store) -> None:
    q = queue(store, interval="100ms", concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(2)
    at(store, t0 + I)
    d = q.start(tickets[0])
    for step in range(1, 21):  # the head asks for 2 s while the body runs (an outage is 1 s)
        at(store, t0 + I + step * I)
        assert q.start(tickets[1]).full
    q.finish("a", lease=d.lease)
    assert q.start(tickets[1]).authorized  # at once: no settle after an outage


def test_a_start_of_any_cost_takes_one_lease(store: Store) -> None:
    q = queue(store, interval="10ms", concurrency=2)
    t0 = q.ensure().last_start_us
    heavy, light = q.claim_costs([3, 1])
    at(store, t0 + 10_000)
    assert q.start(heavy, cost=3).authorized
    assert in_flight(q) == 1
    at(store, t0 + 40_000)
    assert q.start(light).authorized
    assert in_flight(q) == 2


def test_a_combined_start_takes_its_leases_only_when_every_queue_authorizes(store: Store) -> None:
    backend = store.backend(lease_timeout_us=TIMEOUT)
    pace = IntervalQueue("{api}pace", interval="100ms", backend=backend)
    cap = IntervalQueue("{api}cap", interval=Limit(concurrency=1), backend=backend)
    pace.ensure()
    t0 = cap.ensure().last_start_us
    both = CombinedQueue([pace, cap])
    assert both.primary is pace
    first, second, third = both.claim(), both.claim(), both.claim()
    at(store, t0 + I)
    d1 = _one(both.start(first, task_id="a"))
    assert d1.authorized and d1.lease and in_flight(cap) == 1
    at(store, t0 + 2 * I)
    held = both.start(second, task_id="b")  # the pace says yes, the cap says wait: neither records it
    assert [d.verdict for d in held] == [Verdict.WAIT, Verdict.WAIT] and held[0].wait_us == 0 and held[1].full
    assert pace.status().state.current == 1
    both.finish("a", lease=d1.lease)
    d2 = _one(both.start(second, task_id="b"))
    assert d2.authorized and in_flight(cap) == 1
    both.finish("b", lease=d2.lease)
    early = both.start(third, task_id="c")  # the cap is free, the pace is not: no lease taken
    assert early[0].verdict is Verdict.WAIT and early[0].wait_us > 0 and in_flight(cap) == 0


def _one(decisions: list[Decision]) -> Decision:
    assert len({d.verdict for d in decisions}) == 1
    leases = {d.lease for d in decisions if d.lease}
    assert len(leases) <= 1
    return decisions[0] if not leases else next(d for d in decisions if d.lease)


def test_a_reset_keeps_the_leases_of_the_bodies_still_running(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    (ticket,) = q.claim_many(1)
    at(store, t0 + 10)
    d = q.start(ticket)
    q.reset()
    assert in_flight(q) == 1
    (fresh,) = q.claim_many(1)
    at(store, t0 + 20)
    assert q.start(fresh).full
    q.finish("x", lease=d.lease)
    assert q.start(fresh).authorized


def test_a_paused_queue_answers_paused_whatever_its_leases(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 10)
    d = q.start(tickets[0])
    q.pause()
    assert q.start(tickets[1]).verdict is Verdict.PAUSED
    q.finish("x", lease=d.lease)
    assert q.start(tickets[1]).verdict is Verdict.PAUSED
    q.resume(grace=0)
    assert later(store) and q.start(tickets[1]).authorized
    assert later(store) and q.start(tickets[2]).full


def test_a_smaller_cap_declared_takes_no_lease_away(store: Store) -> None:
    q = queue(store, concurrency=2)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 10)
    a = q.start(tickets[0])
    b = q.start(tickets[1]) if later(store) else a
    smaller = queue(store, concurrency=1)
    smaller.declare()
    assert q.status().state.concurrency == 1 and in_flight(q) == 2
    q.finish("a", lease=a.lease)
    assert later(store) and q.start(tickets[2]).full  # one still runs: a cap of one is full
    q.finish("b", lease=b.lease)
    assert q.start(tickets[2]).authorized


def test_slot_takes_and_gives_back_a_lease(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    at(store, t0 + 10)
    with q.slot() as d:
        assert d.lease and in_flight(q) == 1
    assert in_flight(q) == 0 and later(store)
    with pytest.raises(RuntimeError), q.slot():
        raise RuntimeError("the body failed")
    assert in_flight(q) == 0


def test_a_queue_without_a_cap_takes_no_lease(store: Store) -> None:
    q = queue(store, interval="10ms")
    t0 = q.ensure().last_start_us
    (ticket,) = q.claim_many(1)
    at(store, t0 + 10_000)
    d = q.start(ticket)
    assert d.authorized and not d.lease and in_flight(q) == 0
    assert q.status().as_dict()["in_flight"] is None


def test_a_lost_state_forgets_its_leases(store: Store) -> None:
    q = queue(store, concurrency=1)
    t0 = q.ensure().last_start_us
    (ticket,) = q.claim_many(1)
    at(store, t0 + 10)
    assert q.start(ticket).authorized
    q.delete()
    t1 = q.ensure().last_start_us
    (fresh,) = q.claim_many(1)
    at(store, t1 + 10)
    assert q.start(fresh).authorized  # documented: the bodies of a lost state are not counted
