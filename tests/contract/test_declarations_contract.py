"""Where the interval comes from, on every store: the code's declarations, an operator's
override, and live workers side by side (rules/declarations.py: declare, override, effective_interval).

Pinned store clock, nothing sleeps. Node declarations count ``TTL`` unless renewed.
"""

from __future__ import annotations

import logging
import sqlite3

import pytest

from siq_celery import IntervalQueue, Verdict
from siq_celery.backends.redis import redis_client_from_url
from siq_celery.client.combined import CombinedQueue
from siq_celery.types import Limits
from tests.conftest import Store

TTL = 30.0
TTL_US = 30_000_000
MS = 1_000


def at(store: Store, t_us: int) -> None:
    store.clock.now_us = t_us


def test_a_deploy_that_changes_the_declaration_takes_effect_at_once(store: Store) -> None:
    old = store.queue(interval="5ms")
    created = old.declare(node="w1@a", ttl=TTL)
    assert created.created and created.interval_us == 5 * MS and created.declared_us == 5 * MS
    ticket = old.claim()
    t0 = store.clock.now_us
    at(store, t0 + 5 * MS)
    assert old.start(ticket).authorized
    # The fleet is restarted with interval=0.1: the old node's declaration is still live
    # (it was killed, not stopped), and the slower new one wins at once.
    new = store.queue(interval="100ms")
    done = new.declare(node="w2@a", ttl=TTL)
    assert (done.old_declared_us, done.declared_us) == (5 * MS, 100 * MS)
    assert (done.old_interval_us, done.interval_us) == (5 * MS, 100 * MS)
    assert not done.created and done.declaration_changed
    d = new.start(new.claim())
    assert d.verdict is Verdict.WAIT and d.wait_us == 100 * MS - 0 and d.interval_us == 100 * MS
    status = new.status()
    assert status.state.interval_us == 100 * MS and status.sources.declared_us == 100 * MS
    assert "w2@a" in status.sources.declared_by


def test_rolling_deploy_runs_at_the_slowest_live_declaration_until_the_old_node_goes(store: Store) -> None:
    old, new = store.queue(interval="100ms"), store.queue(interval="50ms")
    old.declare(node="old@a", ttl=TTL)
    done = new.declare(node="new@b", ttl=TTL)
    assert done.declared_us == 50 * MS and done.interval_us == 100 * MS  # declared, but the old node still runs
    # renewals from both sides never flip the declaration back
    assert old.declare(node="old@a", ttl=TTL, announce=False).declared_us == 50 * MS
    assert new.declare(node="new@b", ttl=TTL, announce=False).interval_us == 100 * MS
    assert new.status().state.interval_us == 100 * MS
    # the old node stops and withdraws its declaration: the new one holds at once
    gone = old.declare(node="old@a", ttl=0, announce=False)
    assert gone.interval_us == 50 * MS and gone.declared_us == 50 * MS


def test_a_dead_nodes_declaration_stops_counting_after_its_ttl(store: Store) -> None:
    old, new = store.queue(interval="100ms"), store.queue(interval="50ms")
    t0 = store.clock.now_us
    old.declare(node="old@a", ttl=TTL)  # then killed: never renewed, never withdrawn
    new.declare(node="new@b", ttl=TTL)
    at(store, t0 + TTL_US - 1)
    assert new.declare(node="new@b", ttl=TTL, announce=False).interval_us == 100 * MS
    at(store, t0 + TTL_US)
    renewed = new.declare(node="new@b", ttl=TTL, announce=False)
    assert renewed.old_interval_us == 100 * MS and renewed.interval_us == 50 * MS
    assert [n.node for n in new.status().sources.live(store.clock.now_us)] == ["new@b"]


def test_an_override_holds_across_restarts_with_the_same_code_and_clear_returns(store: Store) -> None:
    q = store.queue(interval="100ms")
    q.declare(node="w1@a", ttl=TTL)
    operator = store.queue(interval=None)
    state = operator.set_interval("200ms", origin="alice@ops pid 7")
    assert state.interval_us == 200 * MS
    src = q.status().sources
    assert (src.override_us, src.override_by, src.override_at_us) == (200 * MS, "alice@ops pid 7", store.clock.now_us)
    # the worker restarts with the same code: its announcement keeps the override
    again = q.declare(node="w1@a", ttl=TTL)
    assert not again.declaration_changed and again.interval_us == 200 * MS and not again.replaced_override_us
    assert q.declare(node="w1@a", ttl=TTL, announce=False).interval_us == 200 * MS
    cleared = operator.set_interval(None)
    assert cleared.interval_us == 100 * MS and not q.status().sources.override_us


def test_a_deploy_with_a_new_declaration_replaces_the_override_and_says_so(store: Store) -> None:
    store.queue(interval="100ms").declare(node="w1@a", ttl=TTL)
    store.queue(interval=None).set_interval("200ms", origin="alice@ops")
    deploy = store.queue(interval="50ms")
    done = deploy.declare(node="w1@a", ttl=TTL)  # the same node, restarted with new code
    assert (done.replaced_override_us, done.replaced_override_by) == (200 * MS, "alice@ops")
    assert done.interval_us == 50 * MS and deploy.status().sources.override_us == 0


def test_an_override_wins_over_live_declarations_faster_or_slower(store: Store) -> None:
    q = store.queue(interval="100ms")
    q.declare(node="w1@a", ttl=TTL)
    assert store.queue(interval=None).set_interval("20ms").interval_us == 20 * MS
    assert q.declare(node="w2@b", ttl=TTL, announce=False).interval_us == 20 * MS


def test_a_script_declaration_registers_no_node(store: Store) -> None:
    q = store.queue(interval="100ms")
    done = q.declare(origin="siq sync")
    assert done.created and q.status().sources.nodes == ()
    assert store.queue(interval="300ms").declare(origin="siq sync").interval_us == 300 * MS


def test_a_producer_claim_never_rewrites_the_interval(store: Store) -> None:
    store.queue(interval="100ms").declare(node="w1@a", ttl=TTL)
    producer = store.queue(interval="5ms")
    producer.claim()
    assert producer.status().state.interval_us == 100 * MS
    assert producer.status().sources.declared_us == 100 * MS


def test_reset_and_delete_keep_or_drop_the_sources_with_the_queue(store: Store) -> None:
    q = store.queue(interval="100ms")
    q.declare(node="w1@a", ttl=TTL)
    q.set_interval("200ms")
    q.backend.reset(q.name, None, "e1")  # `siq reset` without --interval: a new life, not a new interval
    assert q.status().sources.override_us == 200 * MS and q.status().state.interval_us == 200 * MS
    q.reset()  # this object's interval, 100 ms, is what the declarations give: the override goes
    assert q.status().sources.override_us == 0 and q.status().state.interval_us == 100 * MS
    assert q.delete()
    q.ensure()
    assert q.status().sources.declared_us == 0 and q.status().sources.nodes == ()


def test_a_reset_with_an_interval_pins_it_against_the_renewals(store: Store) -> None:
    worker = store.queue(interval="20ms")
    worker.declare(node="w1@a", ttl=TTL)
    operator = store.queue(interval="10ms")
    assert operator.ensure(reset=True).interval_us == 10 * MS
    assert operator.status().sources.override_us == 10 * MS  # not undone by the next renewal:
    assert worker.declare(node="w1@a", ttl=TTL, announce=False).interval_us == 10 * MS
    operator.ensure("20ms", reset=True)  # what the declarations give anyway: no override
    assert operator.status().sources.override_us == 0
    assert worker.declare(node="w1@a", ttl=TTL, announce=False).interval_us == 20 * MS
    fresh = store.queue("fresh", interval="30ms")
    fresh.ensure(reset=True)  # nothing declared yet: the reset's interval is the declaration
    src = fresh.status().sources
    assert (src.declared_us, src.override_us) == (30 * MS, 0)


def test_a_killed_slower_nodes_declaration_stops_counting_at_its_ttl_though_nobody_declares(store: Store) -> None:
    """The effective interval follows the expiry of declarations, not the next renewal: at
    the killed node's TTL, with no declaration since, status, claims and starts already run
    at the live node's faster interval."""
    new, old = store.queue(interval="50ms"), store.queue(interval="100ms")
    t0 = store.clock.now_us
    new.declare(node="new@b", ttl=3 * TTL)  # renews later than the killed node's TTL
    old.declare(node="old@a", ttl=TTL)  # then killed: never renewed, never withdrawn
    at(store, t0 + TTL_US - 1)
    assert new.status().state.interval_us == 100 * MS
    first = new.claim()
    assert first.interval_us == 100 * MS
    at(store, t0 + TTL_US)
    assert new.status().state.interval_us == 50 * MS
    assert [n.node for n in new.status().sources.nodes] == ["new@b"]
    started = new.start(first)
    assert started.authorized and started.interval_us == 50 * MS
    second = new.claim()
    at(store, t0 + TTL_US + 50 * MS)
    assert new.start(second).authorized  # 50 ms after the first start, not 100 ms


def test_a_combined_start_and_a_release_follow_the_expiry_too(store: Store) -> None:
    names = ["{g}s", "{g}d"]  # one hash slot on Redis Cluster
    backend = store.backend()
    fast, slow = (IntervalQueue(n, interval=i, backend=backend) for n, i in zip(names, ("50ms", "1s"), strict=True))
    t0 = store.clock.now_us
    fast.declare(node="new@b", ttl=3 * TTL)
    store.queue(names[0], interval="100ms").declare(node="old@a", ttl=TTL)  # killed
    slow.declare(node="new@b", ttl=3 * TTL)
    at(store, t0 + TTL_US)
    both = CombinedQueue([fast, slow])
    tickets = both.claim_tickets(1)
    decisions = both.ask(tickets, None, None, 1)
    assert [d.interval_us for d in decisions] == [50 * MS, 1000 * MS]
    assert fast.backend.release(fast.name, 1_000_000).tasks == []
    assert fast.status().state.interval_us == 50 * MS


def test_an_unreadable_override_is_dropped_with_a_warning_naming_the_queue(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    q = store.queue(interval="100ms")
    q.declare(node="w1@a", ttl=TTL)
    q.set_interval("200ms", origin="alice")
    if store.kind == "memory":
        pytest.skip("the memory store holds Python objects, it cannot be corrupted from outside")
    if store.kind == "sqlite":
        with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "UPDATE siq_interval_sources SET sources=? WHERE prefix=?", ('{"override_us": "2', store.prefix)
            )
        where = "siq_interval_sources"
    else:
        redis_client_from_url(store.url).hset(f"{store.prefix}:{{q}}:intervals", "override_us", "fast")
        where = f"{store.prefix}:{{q}}:intervals"
    with caplog.at_level(logging.WARNING, "siq_celery"):
        done = q.declare(node="w1@a", ttl=TTL, announce=False)  # a renewal
    assert done.interval_us == 100 * MS  # the override is gone: the declarations hold
    assert "queue 'q': the interval sources in " in caplog.text
    assert where in caplog.text and "`siq set-interval q INTERVAL`" in caplog.text, caplog.text


def test_a_queue_paused_before_any_worker_is_created_paused_and_the_first_declaration_keeps_it_so(
    store: Store,
) -> None:
    """Pausing first is how an operator prepares a deploy: the queue is created paused with
    no interval known yet; it cannot resume into no limit at all; the first worker's
    declaration sets the interval and the pause holds until the operator resumes."""
    from siq_celery import ConfigurationError
    from siq_celery.limits import NO_SPACING_US

    operator = store.queue("deploy", interval=None)
    assert operator.pause().paused
    again = operator.pause()  # a second pause changes nothing
    status = operator.status()
    assert status.state.paused and status.state.epoch == again.epoch
    assert (status.state.interval_us, status.state.limits, status.sources.declared_us) == (
        NO_SPACING_US, Limits(0, 0, 0, 0), 0
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="no interval"):
        operator.resume(grace=0)
    assert operator.status().state.paused
    worker = IntervalQueue("deploy", interval="100ms", concurrency=2, backend=store.backend())
    done = worker.declare(node="w1@a", ttl=TTL)
    assert not done.created and (done.declared_us, done.interval_us) == (100 * MS, 100 * MS)
    state = worker.status().state
    assert state.paused and state.interval_us == 100 * MS and state.concurrency == 2
    t1, t2 = worker.claim_many(2)
    at(store, store.clock.now_us + 1_000 * MS)
    assert worker.start(t1).verdict is Verdict.PAUSED
    operator.resume(grace=0)
    assert worker.start(t1).authorized
    d = worker.start(t2)
    assert d.verdict is Verdict.WAIT and d.wait_us == 100 * MS
    assert store.backend().queues() == ["deploy"]


def test_a_queue_paused_before_any_worker_may_resume_once_an_operator_set_its_interval(store: Store) -> None:
    operator = store.queue("deploy", interval=None)
    operator.pause()
    operator.set_interval("250ms")
    state = operator.resume(grace=0)
    assert not state.paused and state.interval_us == 250 * MS
