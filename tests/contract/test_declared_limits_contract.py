"""Where a queue's burst, window quota and concurrency cap come from, on every store: the
same deploy rules as the interval (docs/design.md, "The model": the interval's and the
limits' sources). The code declares them with the interval, under each worker node's name for a
TTL; in a rolling deploy the strictest live declaration holds, kind by kind; a dead node's
stops counting at its TTL; an operator's override of a kind wins until a deploy changes that
kind; a state created from nothing takes no limits from a lost one.

Pinned store clock, nothing sleeps.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest

from siq_celery import IntervalQueue, Verdict
from siq_celery.backends.redis import redis_client_from_url
from siq_celery.errors import ConfigurationError, QueueNotFoundError
from siq_celery.types import NO_LIMITS, Limits, LimitsOverride
from tests.conftest import Store

TTL = 30.0
TTL_US = 30_000_000
MS = 1_000
S = 1_000_000
MIN = 60 * S


def queue(store: Store, interval: Any = "100ms", name: str = "q", **limits: Any) -> IntervalQueue:
    return IntervalQueue(name, interval=interval, backend=store.backend(), **limits)


def at(store: Store, t_us: int) -> None:
    store.clock.now_us = t_us


def limits_of(q: IntervalQueue) -> Limits:
    return q.status().state.limits


def test_a_node_declaration_carries_the_queues_limits(store: Store) -> None:
    q = queue(store, burst=2, quota="100/1m", concurrency=5)
    done = q.declare(node="w1@a", ttl=TTL)
    expected = Limits(2, 100, MIN, 5)
    assert done.created and done.limits == expected and done.declared_limits == expected
    (node,) = q.status().sources.nodes
    assert (node.node, node.interval_us, node.limits) == ("w1@a", 100 * MS, expected)
    assert q.status().sources.declared_limits == expected and limits_of(q) == expected


def test_a_rolling_deploy_runs_at_the_strictest_live_declaration_kind_by_kind(store: Store) -> None:
    old = queue(store, burst=4, quota="100/1m", concurrency=5)
    new = queue(store, burst=1, quota="10/1s")
    old.declare(node="old@a", ttl=TTL)
    done = new.declare(node="new@b", ttl=TTL)
    # burst: the smaller; quota: the smallest N over the longest window (10 in any minute is
    # no more than either allows); concurrency: a cap is stricter than none
    assert done.declared_limits == Limits(1, 10, S, 0)
    assert done.limits == Limits(1, 10, MIN, 5) and limits_of(new) == Limits(1, 10, MIN, 5)
    # renewals from either side never flip the declaration, and the strictest still holds
    assert old.declare(node="old@a", ttl=TTL, announce=False).limits == Limits(1, 10, MIN, 5)
    assert new.declare(node="new@b", ttl=TTL, announce=False).declared_limits == Limits(1, 10, S, 0)
    # the old node stops and withdraws: the new code's limits hold at once
    gone = old.declare(node="old@a", ttl=0, announce=False)
    assert gone.limits == Limits(1, 10, S, 0) and limits_of(new) == Limits(1, 10, S, 0)


def test_the_strictest_live_concurrency_cap_is_the_one_enforced(store: Store) -> None:
    loose, strict = queue(store, None, concurrency=3), queue(store, None, concurrency=1)
    t0 = store.clock.now_us
    loose.declare(node="new@b", ttl=3 * TTL)
    strict.declare(node="old@a", ttl=TTL)  # then killed: never renewed, never withdrawn
    at(store, t0 + 10)
    first = loose.start(loose.claim(), task_id="a")
    at(store, t0 + 20)
    second = loose.start(loose.claim(), task_id="b")
    assert first.authorized and second.verdict is Verdict.WAIT and second.full  # the cap of one holds
    at(store, t0 + TTL_US)  # the dead node's declaration stops counting: its cap with it
    assert limits_of(loose).concurrency == 3
    assert loose.start(loose.claim(), task_id="b").authorized


def test_a_dead_nodes_limits_stop_counting_at_its_ttl_though_nobody_declares(store: Store) -> None:
    new, old = queue(store, quota="50/1s"), queue(store, burst=3, quota="5/1s", concurrency=2)
    t0 = store.clock.now_us
    new.declare(node="new@b", ttl=3 * TTL)
    old.declare(node="old@a", ttl=TTL)  # killed
    at(store, t0 + TTL_US - 1)
    assert limits_of(new) == Limits(0, 5, S, 2)
    ticket = new.claim()
    at(store, t0 + TTL_US)
    assert limits_of(new) == Limits(0, 50, S, 0)  # a status read shows what the next start uses
    assert new.start(ticket).authorized
    assert new.status().state.limits == Limits(0, 50, S, 0)
    assert [n.node for n in new.status().sources.nodes] == ["new@b"]


@pytest.mark.parametrize("read_status", [False, True])
def test_a_status_read_after_a_declaration_expired_changes_nothing(store: Store, read_status: bool) -> None:
    """A node's concurrency cap expires while a body holds its lease; the finish, then the
    next start. A status read in between reports the limits the next start will use and
    writes nothing (the memory and SQLite stores wrote what it recomputed, and the finish
    then gave the lease back under no cap, where Redis gave it back under the node's cap,
    shifting the line: found by the differential test, tests/test_differential.py)."""
    backend = store.backend()
    t0 = store.clock.now_us
    backend.declare("q", 10 * MS, "e1", origin="sync")  # the code: no cap
    backend.declare("q", 10 * MS, "e1", node="n1", ttl_us=S, announce=False, limits=Limits(concurrency=1))
    backend.claim("q", 2, 10 * MS, "e1")
    at(store, t0 + 10 * MS)
    first = backend.start("q", 1, "e1", task_id="t1", interval_us=10 * MS, new_epoch="x")
    assert first.authorized and first.lease == "t1"
    at(store, t0 + 3 * S)  # n1 stopped renewing: its cap no longer counts
    if read_status:
        status = backend.status("q")
        assert status is not None and status.state.concurrency == 0
    backend.finish("q", "t1")
    second = backend.start("q", 2, "e1", task_id="t2", interval_us=10 * MS, new_epoch="x")
    assert (second.verdict, second.slot_us) == (Verdict.AUTHORIZED, t0 + 3 * S)


def test_a_script_declaration_is_the_declaration_while_no_node_is_live(store: Store) -> None:
    q = queue(store, quota="10/1s")
    q.declare(origin="siq sync")
    assert limits_of(q) == Limits(0, 10, S, 0) and q.status().sources.nodes == ()
    done = queue(store, concurrency=4).declare(origin="siq sync")
    assert done.old_declared_limits == Limits(0, 10, S, 0) and done.limits == Limits(0, 0, 0, 4)


def test_an_override_wins_over_every_declaration_and_holds_across_restarts_with_the_same_code(store: Store) -> None:
    q = queue(store, burst=2, quota="100/1m", concurrency=5)
    q.declare(node="w1@a", ttl=TTL)
    queue(store, burst=1).declare(node="w2@b", ttl=TTL)
    operator = IntervalQueue("q", backend=store.backend())
    state = operator.set_limits(concurrency=9, quota="none", origin="alice@ops pid 7")
    assert state.limits == Limits(1, 0, 0, 9)  # looser or stricter, the operator's word holds
    src = q.status().sources
    assert src.limits_override == LimitsOverride(None, 0, 0, 9)
    assert (src.limits_override_by, src.limits_override_at_us) == ("alice@ops pid 7", store.clock.now_us)
    # a second override of another kind adds to the first
    assert operator.set_limits(burst=0).limits == Limits(0, 0, 0, 9)
    # the last node to announce restarts with the same code: the override stays, and so it
    # does through every renewal
    again = queue(store, burst=1).declare(node="w2@b", ttl=TTL)
    assert not again.limits_declaration_changed and not again.replaced_limits
    assert again.limits == Limits(0, 0, 0, 9)
    assert q.declare(node="w1@a", ttl=TTL, announce=False).limits == Limits(0, 0, 0, 9)
    cleared = operator.set_limits(clear=True)
    assert cleared.limits == Limits(1, 100, MIN, 5)  # the strictest live declaration again
    assert not q.status().sources.limits_override and q.status().sources.limits_override_by == ""


def test_a_deploy_that_changes_a_kind_replaces_that_kinds_override_and_says_so(store: Store) -> None:
    queue(store, burst=2, concurrency=5).declare(node="w1@a", ttl=TTL)
    IntervalQueue("q", backend=store.backend()).set_limits(burst=6, concurrency=1, origin="alice@ops")
    deploy = queue(store, burst=2, concurrency=3)  # the same node, restarted with a new cap
    done = deploy.declare(node="w1@a", ttl=TTL)
    assert done.replaced_limits == LimitsOverride(None, None, 0, 1) and done.replaced_limits_by == "alice@ops"
    assert (done.old_declared_limits, done.declared_limits) == (Limits(2, 0, 0, 5), Limits(2, 0, 0, 3))
    assert done.limits == Limits(6, 0, 0, 3)  # the burst's override stays: the code's burst did not change
    src = deploy.status().sources
    assert src.limits_override == LimitsOverride(6, None, 0, None) and src.limits_override_by == "alice@ops"
    # a change of the interval alone leaves the limits' override
    assert not queue(store, "200ms", burst=2, concurrency=3).declare(node="w1@a", ttl=TTL).replaced_limits


def test_an_override_needs_a_state_and_a_kind(store: Store) -> None:
    missing = IntervalQueue("nope", backend=store.backend())
    with pytest.raises(QueueNotFoundError):
        missing.set_limits(concurrency=2)
    assert store.backend().status("nope") is None
    q = queue(store)
    q.ensure()
    for bad in ({}, {"burst": 1, "clear": True}):
        with pytest.raises(ConfigurationError, match="burst=, quota=, concurrency= or margin=, or clear=True"):
            q.set_limits(**bad)
    with pytest.raises(ConfigurationError, match="quota 'lots'"):
        q.set_limits(quota="lots")
    assert limits_of(q) == NO_LIMITS and not q.status().sources.limits_override


def test_an_override_on_a_queue_nothing_declared_applies_to_the_limits_it_was_created_with(store: Store) -> None:
    q = queue(store, burst=1, quota="5/1s")
    q.ensure()
    assert IntervalQueue("q", backend=store.backend()).set_limits(concurrency=2).limits == Limits(1, 5, S, 2)


def _lose_state(store: Store, name: str) -> None:
    """The queue's state goes, its other records stay (an evicted key; a row deleted by hand
    or by an earlier version's delete, which knew no limits tables)."""
    if store.kind == "memory":
        backend = store.backend()
        del backend.store.states[name]  # type: ignore[attr-defined]
    elif store.kind == "sqlite":
        with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
            conn.execute("DELETE FROM siq_queues WHERE prefix=? AND queue=?", (store.prefix, name))
    else:
        redis_client_from_url(store.url).delete(f"{store.prefix}:{{{name}}}:state")


def test_a_state_created_after_a_loss_takes_no_limits_and_no_hold_from_the_lost_one(store: Store) -> None:
    q = queue(store, burst=3, quota="5/1s", concurrency=2)
    q.ensure()
    q.backoff(60)
    _lose_state(store, "q")
    plain = queue(store)
    plain.claim()  # a producer with no limits creates the state again
    status = plain.status()
    assert status.state.limits == NO_LIMITS and status.held_until_us == 0
    assert plain.status().state.limits == NO_LIMITS  # and the next read too


def test_a_reset_of_corrupt_state_takes_the_limits_it_is_given(store: Store) -> None:
    q = queue(store, burst=3, quota="5/1s", concurrency=2)
    q.ensure()
    store.corrupt("q", "paused", "7")
    state = store.backend().reset("q", 100 * MS, "e2")  # `siq reset --interval`: no limits of its own
    assert state.limits == NO_LIMITS and limits_of(q) == NO_LIMITS


def _old_sources(store: Store, name: str) -> None:
    """Rewrite the queue's sources as an earlier version kept them: a declaration and a node
    declaration of the interval alone, no limits."""
    now = store.clock.now_us
    if store.kind == "memory":
        from siq_celery.types import IntervalSources, NodeDeclaration

        backend = store.backend()
        backend.store.sources[name] = IntervalSources(  # type: ignore[attr-defined]
            100 * MS, "old", now, nodes=(NodeDeclaration("old@a", 100 * MS, now + TTL_US),)
        )
    elif store.kind == "sqlite":
        record = {"declared_us": 100 * MS, "declared_by": "old", "declared_at_us": now, "override_us": 0,
                  "override_by": "", "override_at_us": 0,
                  "nodes": [{"node": "old@a", "interval_us": 100 * MS, "expires_us": now + TTL_US}]}  # fmt: skip
        with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "UPDATE siq_interval_sources SET sources=? WHERE prefix=? AND queue=?",
                (json.dumps(record), store.prefix, name),
            )
    else:
        client, key = redis_client_from_url(store.url), f"{store.prefix}:{{{name}}}:intervals"
        client.delete(key)
        client.hset(key, mapping={"declared_us": 100 * MS, "declared_by": "old", "declared_at_us": now,
                                  "override_us": 0, "override_by": "", "override_at_us": 0,
                                  "n:old@a": 100 * MS, "e:old@a": now + TTL_US})  # fmt: skip
        client.hset(f"{store.prefix}:{{{name}}}:state", "until_us", now + TTL_US)


def test_sources_of_an_earlier_version_leave_the_stored_limits_in_force(store: Store) -> None:
    q = queue(store, quota="5/1s", concurrency=2)
    q.declare(origin="old code")
    _old_sources(store, "q")
    t0 = store.clock.now_us
    at(store, t0 + TTL_US)  # the old node's declaration expires: nothing declared limits
    assert limits_of(q) == Limits(0, 5, S, 2)
    q.claim()
    assert limits_of(q) == Limits(0, 5, S, 2)
    done = queue(store, quota="7/1s").declare(node="new@b", ttl=TTL)  # the first of the new version
    assert done.old_declared_limits is None and done.limits == Limits(0, 7, S, 0)
