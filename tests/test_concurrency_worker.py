"""The worker side of the concurrency cap: every way a run ends gives its lease back, and a
running body's lease is renewed from its process (client/leases.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from siq_celery import IntervalQueue, IntervalTask, Limit
from siq_celery.backends import backend_from_url
from siq_celery.client.leases import KEEPER, LeaseKeeper


def make_app(tmp_path: Any, **conf: Any) -> Celery:
    app = Celery("conc", broker="memory://", set_as_current=False)
    app.conf.update(siq_url=f"sqlite:///{tmp_path}/s.db", task_always_eager=True, **conf)
    return app


def test_success_failure_retry_and_ignore_each_give_the_lease_back(tmp_path: Any) -> None:
    app = make_app(tmp_path)
    seen: list[int] = []

    @app.task(base=IntervalTask, shared=False, concurrency=1, interval_queue="capped", bind=True, max_retries=1)
    def work(self: Any, how: str) -> str:
        seen.append(self.siq_queue().status().in_flight)
        assert KEEPER.held() == [("capped", self.request.siq_lease)]
        if how == "fail":
            raise ValueError("the body failed")
        if how == "retry" and self.request.retries == 0:
            raise self.retry(countdown=0)
        if how == "ignore":
            raise Ignore()
        return how

    assert work.delay("ok").get() == "ok"
    with pytest.raises(ValueError):
        work.delay("fail").get()
    assert work.delay("retry").get() == "retry"
    work.delay("ignore")
    q = work.siq_queue()
    assert q.status().state.concurrency == 1
    assert seen == [1, 1, 1, 1, 1] and q.status().in_flight == 0 and KEEPER.held() == []


def test_the_task_attribute_and_the_default_setting_declare_the_cap(tmp_path: Any) -> None:
    app = make_app(tmp_path, siq_default_concurrency=4)

    @app.task(base=IntervalTask, shared=False, interval="1s")
    def plain() -> None: ...

    @app.task(base=IntervalTask, shared=False, concurrency=2, interval_queue="two")
    def two() -> None: ...

    @app.task(base=IntervalTask, shared=False, interval_queue={"three": Limit(concurrency=3)})
    def three() -> None: ...

    assert plain.siq_queue().limits.concurrency == 4
    assert two.siq_queue().limits.concurrency == 2 and two.siq_queue().interval_us == 1  # no spacing of its own
    assert three.siq_queue().limits.concurrency == 3


def test_the_keeper_renews_the_leases_held_in_its_process(tmp_path: Any) -> None:
    backend = backend_from_url(f"sqlite:///{tmp_path}/k.db", lease_timeout_us=1_500_000)
    q = IntervalQueue("k", concurrency=1, backend=backend)
    keeper = LeaseKeeper()
    with q.slot() as d:  # the module's keeper renews it too: check a private one, by hand
        keeper.hold(backend, ["k"], d.lease)
        time.sleep(1.0)
        keeper.renew_now()
        time.sleep(1.0)  # past the first expiry: renewed, still held
        assert q.status().in_flight == 1
        keeper.drop(backend, ["k"], d.lease)
        assert keeper.held() == []
    assert q.status().in_flight == 0


def test_the_keeper_thread_renews_every_third_of_the_timeout(tmp_path: Any) -> None:
    backend = backend_from_url(f"sqlite:///{tmp_path}/t.db", lease_timeout_us=1_200_000)
    q = IntervalQueue("t", concurrency=1, backend=backend)
    with q.slot():
        time.sleep(2.0)  # 1.7 timeouts: alive only if the thread renewed it
        assert q.status().in_flight == 1
    assert q.status().in_flight == 0


def test_a_hold_after_the_keeper_went_idle_does_not_wake_its_thread_and_is_renewed(tmp_path: Any) -> None:
    """Every start holds its run's lease, and the held set empties with each finish: a hold
    that woke the keeper's thread would have it take the GIL just as the body's report is
    sent (the body waits milliseconds for it, on a loaded host). The thread keeps its period
    while nothing is held; a later hold is renewed within it, without a wake-up."""
    backend = backend_from_url(f"sqlite:///{tmp_path}/w.db", lease_timeout_us=1_200_000)
    q = IntervalQueue("w", concurrency=2, backend=backend)
    keeper = LeaseKeeper()
    with q.slot() as first:
        keeper.hold(backend, ["w"], first.lease)  # the first hold starts the thread
        keeper.drop(backend, ["w"], first.lease)
    time.sleep(0.5)  # idle past a period
    with q.slot() as later:
        keeper.hold(backend, ["w"], later.lease)
        assert not keeper._wake.is_set(), "a hold within the running period must not wake the keeper"
        KEEPER.drop(backend, ["w"], later.lease)  # only the private keeper renews it now
        time.sleep(2.0)  # 1.7 timeouts: alive only if the idle thread renewed it
        assert q.status().in_flight == 1
        keeper.drop(backend, ["w"], later.lease)
    shorter = backend_from_url(f"sqlite:///{tmp_path}/s.db", lease_timeout_us=600_000)
    s = IntervalQueue("s", concurrency=1, backend=shorter)
    with s.slot() as short:  # a backend that needs a shorter period wakes the thread to it
        keeper.hold(shorter, ["s"], short.lease)
        KEEPER.drop(shorter, ["s"], short.lease)
        time.sleep(1.0)  # 1.7 of its timeouts: alive only if renewed at the shorter period
        assert s.status().in_flight == 1
        keeper.drop(shorter, ["s"], short.lease)


def test_a_finish_the_store_did_not_take_is_retried_with_the_lease_held(tmp_path: Any) -> None:
    """The store misses a body's finish (unreachable, failing over): the keeper tries it
    again, renewing the run's lease meanwhile, so a redelivered copy is answered RUNNING
    and, once the finish is in, DUPLICATE; it never runs a second time."""
    from siq_celery import Verdict
    from siq_celery.client.leases import FINISH_RETRY_S, PendingFinish

    backend = backend_from_url(f"sqlite:///{tmp_path}/s.db", lease_timeout_us=2_000_000)
    q = IntervalQueue("outbox", interval="10ms", backend=backend)
    q.ensure()
    ticket = q.claim()
    run = q.wait_for_turn(ticket, task_id="a")
    assert run.lease == "a"
    down = {"store": True}

    def attempt() -> None:
        if down["store"]:
            raise ConnectionError("the store does not answer")
        q.finish("a")

    keeper = LeaseKeeper()
    keeper.finish_later(PendingFinish(backend, ["outbox"], "a", attempt, "the finish of a"))
    time.sleep(3)  # past the lease timeout: renewed by the keeper meanwhile
    assert keeper.pending_finishes() == 1 and keeper.held() == [("outbox", "a")]
    assert q.start(ticket, task_id="a").verdict is Verdict.RUNNING, "the copy waits"
    down["store"] = False
    deadline = time.monotonic() + 5 * FINISH_RETRY_S
    while keeper.pending_finishes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keeper.pending_finishes() == 0 and keeper.held() == []
    assert q.start(ticket, task_id="a").verdict is Verdict.DUPLICATE, "the copy is refused"


def test_the_keeper_names_each_kind_of_lease_it_could_not_renew(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A run lease (a start with a task id) and a concurrency lease (one without, under a
    cap) are two things: the keeper's log line says which it failed to renew, and a body's
    wait holds its lease under the right name (body.begin_body)."""
    backend = backend_from_url(f"sqlite:///{tmp_path}/n.db", lease_timeout_us=1_500_000)
    q = IntervalQueue("n", concurrency=3, backend=backend)
    keeper = LeaseKeeper()
    with q.slot(task_id="run-1") as run, q.slot() as bare:
        assert run.lease == "run-1" and bare.lease and bare.lease != "run-1"
        assert ("n", run.lease) in KEEPER.held() and ("n", bare.lease) in KEEPER.held()
        assert KEEPER.kinds([run.lease, bare.lease]) == "1 run lease and 1 concurrency lease"
        keeper.hold(backend, ["n"], run.lease)
        keeper.hold(backend, ["n"], bare.lease, run=False)
        keeper.hold(backend, ["n"], "run-2")

        def refuse(queue: str, members: Any) -> int:
            raise ConnectionError("the store is away")

        backend.renew_leases = refuse  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="siq_celery"):
            keeper.renew_now()
        assert "could not renew 2 run leases and 1 concurrency lease of 'n': the store is away" in caplog.text
        keeper.drop(backend, ["n"], bare.lease)
        assert keeper.kinds(["run-1", "run-2"]) == "2 run leases" and keeper._concurrency == set()
        for member in ("run-1", "run-2"):  # else its thread logs the refused renewal into later tests' logs
            keeper.drop(backend, ["n"], member)
