"""The fair-share rule (rules.fair_push / rules.fair_next, start-time fair queuing) on the
reference lines: who gets the shared queue's next ticket."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from siq_celery import rules
from siq_celery.rules import DictFairLines, fair_next, fair_push

EXAMPLES = int(os.environ.get("SIQ_HYPOTHESIS_EXAMPLES", "500"))


def submit(lines: DictFairLines, key: str, count: int, weight: int = 1, cost: int = 1) -> None:
    for n in range(count):
        fair_push(lines, key, f"{key}{n}", cost, weight)


def take(lines: DictFairLines, count: int) -> list[str]:
    order = []
    for _ in range(count):
        got = fair_next(lines)
        assert got is not None
        order.append(got[1])
    return order


def test_a_small_tenant_behind_a_big_backlog_is_served_at_once_interleaved() -> None:
    lines = DictFairLines()
    submit(lines, "A", 1000)
    assert take(lines, 5) == ["A0", "A1", "A2", "A3", "A4"]
    submit(lines, "B", 10)
    order = take(lines, 20)
    assert [t for t in order if t.startswith("B")] == [f"B{n}" for n in range(10)], "B in its own order"
    assert [t for t in order if t.startswith("A")] == [f"A{n}" for n in range(5, 15)], "A in its own order"
    assert all(a[0] != b[0] for a, b in itertools.pairwise(order)), f"interleaved: {order}"
    assert take(lines, 3) == ["A15", "A16", "A17"], "B done, A alone again"


def test_weights_2_1_1_share_300_tickets_50_25_25() -> None:
    lines = DictFairLines()
    submit(lines, "gold", 400, weight=2)
    submit(lines, "silver", 400)
    submit(lines, "bronze", 400)
    shares = Counter(t.rstrip("0123456789") for t in take(lines, 300))
    assert shares == {"gold": 150, "silver": 75, "bronze": 75}


def test_an_idle_tenant_gets_no_credit_for_its_idle_time() -> None:
    lines = DictFairLines()
    submit(lines, "A", 100)
    submit(lines, "B", 1)
    take(lines, 2)  # A0 B0: B now idle while A runs on
    take(lines, 50)
    submit(lines, "B", 10)
    order = take(lines, 6)
    assert [t[0] for t in order] == ["A", "B", "A", "B", "A", "B"] or [t[0] for t in order] == [
        "B", "A", "B", "A", "B", "A",
    ], f"B alternates with A, it does not run its 10 first: {order}"  # fmt: skip


def test_a_tenant_that_empties_and_refills_does_not_jump_ahead() -> None:
    """Served at virtual time V, its finish tag is V + 1: refilled at once it waits for it,
    and a tenant with a smaller tag goes first."""
    lines = DictFairLines()
    submit(lines, "A", 5)
    submit(lines, "B", 1)
    assert take(lines, 2) == ["A0", "B0"]
    submit(lines, "B", 1)  # B empty a moment, back at once
    assert take(lines, 3) == ["A1", "B0", "A2"]


def test_cost_counts_like_weight() -> None:
    lines = DictFairLines()
    submit(lines, "heavy", 50, cost=3)
    submit(lines, "light", 150)
    counted = Counter()
    for t in take(lines, 120):
        counted[t.rstrip("0123456789")] += 3 if t.startswith("heavy") else 1
    assert counted == {"heavy": 90, "light": 90}, "equal cost units, not equal tasks"


def test_finish_tags_of_idle_tenants_are_forgotten() -> None:
    """10,000 tenants of one task each: once served, nothing of them stays."""
    lines = DictFairLines()
    for n in range(10_000):
        fair_push(lines, f"t{n}", "x", 1, 1)
    take(lines, 10_000)
    submit(lines, "A", 2)
    take(lines, 2)
    assert (lines.finishes, lines.heads, lines.lines) == ({}, {}, {}), "an idle queue keeps nothing"


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("ABCD"), st.integers(0, 4)),  # (key, tickets handed out after it)
        min_size=1,
        max_size=60,
    )
)
def test_order_within_a_key_and_the_fairness_bound(events: list[tuple[str, int]]) -> None:
    """Any interleaving of submissions and tickets: each key's tasks get tickets in their
    order, and over any stretch in which two keys both had work, their services over their
    weights differ by at most one task's worth each (start-time fair queuing's bound)."""
    lines = DictFairLines()
    weights = {k: 1 + "ABCD".index(k) % 3 for k in "ABCD"}
    sent: Counter[str] = Counter()
    served: list[str] = []
    backlogged: list[frozenset[str]] = []
    for key, after in events:
        fair_push(lines, key, f"{key}{sent[key]}", 1, weights[key])
        sent[key] += 1
        for _ in range(after):
            active = frozenset(k for k in "ABCD" if lines.waiting(k))
            got = fair_next(lines)
            if got is None:
                break
            served.append(got[1])
            backlogged.append(active)
    for key in "ABCD":
        mine = [int(t[1:]) for t in served if t[0] == key]
        assert mine == list(range(len(mine))), f"{key} in its order"
    for i in range(len(served)):
        both = backlogged[i]
        for j in range(i + 1, len(served) + 1):
            if j < len(served):
                both = both & backlogged[j]
            if len(both) < 2:
                break
            got = Counter(t[0] for t in served[i:j])
            for a in both:
                for b in both:
                    assert got[a] / weights[a] - got[b] / weights[b] <= 1 / weights[a] + 1 / weights[b] + 1e-9


def test_virtual_time_is_integral_for_every_weight_up_to_16() -> None:
    assert all(rules.FAIR_SCALE % w == 0 for w in range(1, 17))


def test_a_share_needs_a_cost_and_a_weight() -> None:
    lines = DictFairLines()
    for cost, weight in [(0, 1), (1, 0), (1, rules.MAX_FAIR_WEIGHT + 1)]:
        with pytest.raises(ValueError, match="fair share of 'A'"):
            fair_push(lines, "A", "A0", cost, weight)
    assert fair_next(lines) is None, "nothing half-written"


def test_one_keys_retries_joining_over_time_leave_another_key_its_share() -> None:
    """The rule the retries of a fair task follow (docs/design.md, "Fair shares"): each one
    joins its key's line when it is due, and every ticket of the queue is handed out by
    the lines (rules.fair_promote), so the lookahead bounds what is handed out ahead and a
    key beside another's 200 retries is served within it. Here A's retries come due two a
    slot while B's 20 wait, starting one a slot at 20 ms."""
    interval = 20_000
    state = rules.new_state(0, interval, "e")
    lines = DictFairLines()
    ahead = rules.fair_lookahead(interval)
    due = iter(f"A{n}" for n in range(200))
    handed: dict[int, str] = {}
    for n in range(20):
        fair_push(lines, "B", f"B{n}", 1, 1)
    started: list[str] = []
    now = 0
    while len(started) < 220:
        for task_id in itertools.islice(due, 2):  # the retries that came due: each joins A's line
            fair_push(lines, "A", task_id, 1, 1)
        handed.update((ticket, turn.task_id) for ticket, turn in rules.fair_promote(state, lines, now))
        assert state.ticket - state.current <= ahead, "the lookahead bounds the tickets ahead of the starts"
        ticket = state.current + 1
        decision = rules.start(state, ticket, "e", now)
        if not decision.authorized:  # its slot: then it starts
            now += decision.wait_us
            decision = rules.start(state, ticket, "e", now)
        assert decision.authorized, decision
        started.append(handed.pop(ticket))
    b = [i + 1 for i, t in enumerate(started) if t.startswith("B")]
    assert b[0] <= ahead and b[-1] <= 60, b
    assert [t for t in started if t.startswith("A")] == [f"A{n}" for n in range(200)]
