"""A script whose reply was lost may have run: redis-py must not send it again.

siq_celery turns redis-py's own retries off (``client_defaults``) and retries in its own
loops, which know what each operation means: a claim re-sent blindly after its reply was
lost claims a second ticket that nobody holds, and the line waits an interval for it.
On Redis Cluster the cluster client has a retry loop of its own around every command
(``cluster_error_retry_attempts``, 3, before redis-py 6.0; ruled by ``retry`` since): it
re-sends a command after a ConnectionError or a TimeoutError, as when the master of the
slot dies or hangs with the reply unread. Here the server runs the claim and the client
loses the reply (a TimeoutError raised after the reply was read off the socket).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from siq_celery import CombinedQueue, IntervalQueue, StoreUnavailableError, Verdict
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock
from tests.conftest import Store

I = 100_000


@pytest.fixture(params=["redis", pytest.param("redis-cluster", marks=pytest.mark.cluster)])
def redis_store(request: pytest.FixtureRequest, clock: PinnedClock) -> Store:
    kind = request.param
    url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster")
    return Store(kind, url if isinstance(url, str) else url.url, clock, "lost")


@pytest.fixture
def lose_next_evalsha_reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Arm with ``armed["left"] = 1``: the next EVALSHA runs on the server, its reply is
    read and dropped, and the client sees a TimeoutError. ``armed["sent"]`` counts EVALSHAs."""
    armed = {"left": 0, "sent": 0}
    parse = redis.Redis.parse_response

    def parse_response(self: redis.Redis, connection: Any, command_name: Any, **options: Any) -> Any:
        reply = parse(self, connection, command_name, **options)
        if str(command_name).upper() == "EVALSHA":
            armed["sent"] += 1
            if armed["left"]:
                armed["left"] -= 1
                raise redis.TimeoutError("the reply was lost (test)")
        return reply

    monkeypatch.setattr(redis.Redis, "parse_response", parse_response)
    yield armed


def test_a_claim_whose_reply_was_lost_is_not_sent_again(redis_store: Store, lose_next_evalsha_reply: dict) -> None:
    backend = redis_store.backend()
    state, _ = backend.ensure("q", I, "e1")
    assert backend.claim("q", 1, I, state.epoch).first == 1
    lose_next_evalsha_reply.update(left=1, sent=0)
    with pytest.raises(StoreUnavailableError):
        backend.claim("q", 1, I, state.epoch)
    assert lose_next_evalsha_reply["sent"] == 1, "the claim was sent once"
    status = backend.status("q")
    assert status is not None and status.state.ticket == 2, "the lost claim took one ticket, and only one"
    assert backend.claim("q", 1, I, state.epoch).first == 3, "the next claim goes on from there"


# -- a start whose reply was lost: the call that asked adopts it (every store) --
#
# A start takes the run's lease, named by its task id, so that a redelivered copy is
# answered RUNNING while it runs. The call that asked (wait_in_line, one token per call,
# sent with each of its asks) asks again when the reply was lost: its own start stands,
# given again as it was (same slot, same time, nothing charged twice), while any other
# asker of that task id is still answered RUNNING.


def lose_next_start_reply(backend: Any) -> dict[str, int]:
    """The next start (or start_all) commits in the store and its caller sees the store
    unreachable, as when the reply is lost on the way back. ``lost["left"]``: replies still to lose."""
    lost = {"left": 1}
    for name in ("start", "start_all"):
        real = getattr(backend, name)

        def lossy(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            reply = _real(*args, **kwargs)
            if lost["left"]:
                lost["left"] -= 1
                raise StoreUnavailableError("the reply was lost (test)")
            return reply

        setattr(backend, name, lossy)
    return lost


def pinned_queue(store: Store, name: str = "q", concurrency: int | None = None, **options: Any) -> IntervalQueue:
    return IntervalQueue(
        name, interval="100ms", concurrency=concurrency, backend=store.backend(**options), sleep=store.clock.sleep,
        monotonic=store.clock.monotonic,
    )  # fmt: skip


@pytest.mark.parametrize("concurrency", [None, 1])
def test_a_start_whose_reply_was_lost_is_adopted_by_the_call_that_asked(store: Store, concurrency: int | None) -> None:
    q = pinned_queue(store, concurrency=concurrency)
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I  # the first ticket is due at once
    lost = lose_next_start_reply(q.backend)
    asked = store.clock.now_us
    decision = q.wait_for_turn(task_id="t1", record=StartRecord.here("job", "t1"))
    after = (decision.now_us - asked) / 1e6
    print(f"\nauthorized {after:.1f} s (store clock) after its first ask; slot was due at once")
    assert lost["left"] == 0, "the reply was lost"
    assert decision.authorized and decision.now_us == asked, "the start the store recorded, given again"
    assert decision.slot_us <= asked and decision.lease == "t1"
    status = q.status()
    assert status.state.last_start_us == asked and status.state.current == 1, "charged once"
    assert status.counts.starts == 1, "counted once"
    if store.backend().ledger_max:
        assert [r.start_us for r in q.ledger()] == [asked], "one ledger row"


def test_another_asker_of_the_task_id_is_still_answered_running(store: Store) -> None:
    for concurrency in (0, 1):
        q = pinned_queue(store, f"q{concurrency}", concurrency=concurrency or None)
        t0 = q.ensure().last_start_us
        store.clock.now_us = t0 + I
        ticket = q.claim()
        first = q.start(ticket, task_id="t1", token="call-1")  # its reply was lost
        assert first.authorized
        store.clock.advance(us=I // 4)
        again = q.start(ticket, task_id="t1", token="call-1")
        assert again == first, "the same call adopts what it was given"
        assert q.start(ticket, task_id="t1", token="call-2").verdict is Verdict.RUNNING, "another delivery"
        assert q.start(ticket, task_id="t1").verdict is Verdict.RUNNING, "an asker without a token"
        assert q.status().state.last_start_us == first.now_us and q.status().counts.starts == 1
        q.finish("t1", lease=first.lease)
        assert q.start(ticket, task_id="t1", token="call-1").verdict is Verdict.DUPLICATE, "a finished task"


def test_a_lease_given_back_or_expired_is_adopted_no_more(store: Store) -> None:
    q = pinned_queue(store, lease_timeout_us=5 * I)
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    ticket = q.claim()
    first = q.start(ticket, task_id="t1", token="call-1")
    q.finish("t1", remember=False, lease=first.lease)  # a retry's finish: the run ended
    store.clock.advance(us=I)
    again = q.start(ticket, task_id="t1", token="call-1")
    assert again.authorized and again.now_us > first.now_us, "a new start, not the one given back"
    store.clock.advance(us=5 * I + 1)  # its lease expired (its process died)
    later = q.start(q.claim(), task_id="t1", token="call-1")
    assert later.authorized and later.now_us == store.clock.now_us, "a new start, not the expired one"


def test_a_combined_start_whose_reply_was_lost_is_adopted(store: Store) -> None:
    backend = store.backend()
    fast = IntervalQueue("{geo}per-second", interval="100ms", backend=backend, sleep=store.clock.sleep,
                         monotonic=store.clock.monotonic)  # fmt: skip
    slow = IntervalQueue("{geo}per-2s", interval="200ms", backend=backend, sleep=store.clock.sleep,
                         monotonic=store.clock.monotonic)  # fmt: skip
    fast.ensure()
    t0 = slow.ensure().last_start_us
    store.clock.now_us = t0 + 2 * I
    both = CombinedQueue([fast, slow])
    lost = lose_next_start_reply(backend)
    asked = store.clock.now_us
    decision = both.wait_for_turn(task_id="t1")
    print(f"\nauthorized {(decision.now_us - asked) / 1e6:.1f} s (store clock) after its first ask")
    assert lost["left"] == 0 and decision.authorized and decision.now_us == asked
    assert [q.status().counts.starts for q in (fast, slow)] == [1, 1], "charged once in each queue"
    ticket = both.claim()
    assert [d.verdict for d in both.start(ticket, task_id="t1")] == [Verdict.RUNNING] * 2, "another delivery"


def test_wait_for_turn_adopts_a_start_whose_redis_reply_was_lost(
    redis_store: Store, lose_next_evalsha_reply: dict
) -> None:
    q = pinned_queue(redis_store, "adopted", concurrency=1)
    t0 = q.ensure().last_start_us
    redis_store.clock.now_us = t0 + I
    ticket = q.claim()
    lose_next_evalsha_reply.update(left=1, sent=0)
    asked = redis_store.clock.now_us
    decision = q.wait_for_turn(ticket, task_id="t1")
    print(f"\nauthorized {(decision.now_us - asked) / 1e6:.1f} s (store clock) after its first ask")
    assert lose_next_evalsha_reply["sent"] == 2, "the lost start, then the ask that adopted it"
    assert decision.authorized and decision.now_us == asked and decision.lease == "t1"
    status = q.status()
    assert (status.counts.starts, status.in_flight, status.state.last_start_us) == (1, 1, asked), "charged once"
