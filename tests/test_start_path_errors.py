"""An error on the way to a start never fails a task whose body did not run.

A Redis server that refuses a command with an error of its own (READONLY on a replica
after a failover behind a DNS name, MASTERDOWN, LOADING, BUSY, OOM) is the store
unavailable: the producer publishes without a ticket, the worker waits and asks again,
nothing is recorded as finished. Any other unexpected error of the store at the start is
asked again too, and a finish is remembered only for a body that started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Signature
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from kombu.exceptions import OperationalError

from siq_celery import ConfigurationError, IntervalQueue, IntervalTask, StoreUnavailableError
from siq_celery.backends import backend_from_url
from siq_celery.backends.memory import MemoryBackend
from siq_celery.client.waiting import SlotTimeoutError
from siq_celery.pytest_plugin import SiqStore
from siq_celery.tasks import gate
from siq_celery.types import Decision, Ticket, Verdict
from tests.faults.conftest import ControlledRedis

I = 100_000


@pytest.fixture
def read_only_store() -> Iterator[str]:
    """The URL of a private redis-server made a replica of another (REPLICAOF): every write
    it is sent, and so every script of siq_celery's, is answered READONLY."""
    with ControlledRedis() as master, ControlledRedis() as replica:
        client = redis.Redis(port=replica.port)
        client.execute_command("REPLICAOF", "127.0.0.1", str(master.port))
        deadline = time.monotonic() + 10
        while client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica did not connect to its master"
            time.sleep(0.05)
        yield replica.url(0)


def test_a_read_only_replica_is_the_store_unavailable(read_only_store: str) -> None:
    backend = backend_from_url(read_only_store)
    for name, call in [
        ("ensure", lambda: backend.ensure("q", I, "e1")),
        ("claim", lambda: backend.claim("q", 1, I, "e1")),
        ("start", lambda: backend.start("q", 1, "e1", task_id="t1", interval_us=I, new_epoch="e2")),
        ("finish", lambda: backend.finish("q", "t1")),
    ]:
        with pytest.raises(StoreUnavailableError, match="READONLY") as caught:
            call()
        print(f"{name}: {type(caught.value).__name__}: {caught.value}")
    with pytest.raises(StoreUnavailableError, match="READONLY"):
        backend.claim_later("q", 1, I, "e1").result()


def test_a_read_only_store_holds_the_start_and_publishes_without_a_ticket(
    read_only_store: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = IntervalQueue("q", url=read_only_store, interval="100ms")
    with caplog.at_level(logging.WARNING, logger="siq_celery"), pytest.raises(SlotTimeoutError):
        queue.wait_for_turn(task_id="t1", timeout=0.5)
    assert "state store unreachable, nothing starts" in caplog.text
    app = Celery("ro", broker="memory://", set_as_current=False)
    app.conf.update(siq_url=read_only_store)

    @app.task(base=IntervalTask, shared=False, interval="100ms", interval_queue="q")
    def work() -> None: ...

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="siq_celery"):
        work.delay()  # published all the same: the worker claims a ticket
    assert "state store unreachable at publish" in caplog.text


class Flaky:
    """Replaces MemoryBackend.start: the first ``failures`` calls raise ``error``."""

    def __init__(self, error: Exception, failures: int = 1) -> None:
        self.error, self.left, self.calls = error, failures, 0
        real = MemoryBackend.start

        def start(backend: MemoryBackend, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.left:
                self.left -= 1
                raise self.error
            return real(backend, *args, **kwargs)

        self.start = start


def apply_on_a_flaky_store(
    celery_app: Celery, monkeypatch: pytest.MonkeyPatch, flaky: Flaky, queue: str, task_id: str
) -> tuple[Any, list[int]]:
    """Apply (eagerly) ``work(7)`` of interval queue ``queue`` while the memory store's
    start is ``flaky``: the result, and the arguments of the bodies that ran."""
    monkeypatch.setattr(MemoryBackend, "start", flaky.start)
    ran: list[int] = []

    @celery_app.task(base=IntervalTask, shared=False, interval="10ms", interval_queue=queue)
    def work(n: int) -> int:
        ran.append(n)
        return n

    return work.apply((7,), task_id=task_id), ran


@pytest.mark.celery(task_always_eager=True)
@pytest.mark.parametrize("error", [redis.ResponseError("BUSY Redis is busy running a script"), RuntimeError("boom")])
def test_an_unexpected_error_of_the_store_at_the_start_is_asked_again_never_a_failure(
    celery_app: Celery, siq_store: SiqStore, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    flaky = Flaky(error)
    result, ran = apply_on_a_flaky_store(celery_app, monkeypatch, flaky, "flaky", "task-7")
    print(f"{type(error).__name__} at the start: {result.state}, bodies run: {ran}, asks: {flaky.calls}")
    assert (result.state, ran) == ("SUCCESS", [7])
    assert flaky.calls >= 2, "asked again after the error"


@pytest.mark.celery(task_always_eager=True)
def test_the_tasks_own_soft_time_limit_ends_the_wait_and_nothing_is_remembered_as_finished(
    celery_app: Celery, siq_store: SiqStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait asks again after any unexpected error of the store, but a soft time limit
    # (billiard raises it in the waiting process) is the task's own: the wait ends with it.
    flaky = Flaky(SoftTimeLimitExceeded(), failures=100)
    result, ran = apply_on_a_flaky_store(celery_app, monkeypatch, flaky, "soft", "task-soft")
    print(f"soft time limit in the wait: {result.state} {type(result.result).__name__}, asks: {flaky.calls}")
    assert (result.state, type(result.result), ran, flaky.calls) == ("FAILURE", SoftTimeLimitExceeded, [], 1)
    monkeypatch.undo()
    queue = IntervalQueue("soft", interval="10ms", backend=siq_store.backend)
    assert queue.start(queue.claim(), task_id="task-soft").verdict is not Verdict.DUPLICATE


@pytest.mark.celery(task_always_eager=True)
def test_a_task_that_failed_before_its_body_is_not_remembered_as_finished(
    celery_app: Celery, siq_store: SiqStore
) -> None:
    ran: list[int] = []

    def cost(args: Any, kwargs: Any) -> int:
        if kwargs.get("bad"):
            raise ValueError("no cost for this call")
        return 1

    @celery_app.task(base=IntervalTask, shared=False, interval="10ms", interval_queue="early", cost=cost)
    def work(bad: bool = False) -> None:
        ran.append(1)

    result = work.apply(kwargs={"bad": True}, task_id="task-early")
    assert result.state == "FAILURE" and isinstance(result.result, ConfigurationError) and ran == []
    queue = IntervalQueue("early", interval="10ms", backend=siq_store.backend)
    decision = queue.start(queue.claim(), task_id="task-early")
    print(f"failed before its body: {result.state}; a later start of its id: {decision.verdict.value}")
    assert decision.verdict is not Verdict.DUPLICATE, "its id is not remembered as finished"


# -- a broker that refuses the re-publish of a deferral or a back-off ---------------------


class RefusingBroker:
    """Replaces ``Signature.apply_async``: the first ``refusals`` publishes raise kombu's
    OperationalError (the broker refused or went away), the later ones are recorded."""

    def __init__(self, refusals: int) -> None:
        self.left, self.refused = refusals, 0
        self.sent: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **options: Any) -> None:
        if self.left:
            self.left -= 1
            self.refused += 1
            raise OperationalError("the broker refused the publish (test)")
        self.sent.append(options)


def deferral(task: Any, queue: str) -> tuple[Ticket, Decision]:
    ticket = Ticket(queue, 5, "e1", 0, 0)
    return ticket, Decision(Verdict.WAIT, 5, 1_700_000_000_000_000, 2_000_000, 1_700_000_002_000_000, 10_000)


@pytest.mark.parametrize("refusals", [2, 100])
def test_a_deferral_the_broker_refused_is_published_again_or_given_back_to_the_broker(
    celery_app: Celery, siq_store: SiqStore, monkeypatch: pytest.MonkeyPatch, refusals: int
) -> None:
    """A few refusals: published again after a pause, the delivery ends with Ignore. A
    broker that keeps refusing: the message goes back to the broker (Reject with requeue:
    the tasks are acknowledged late), never a failure."""
    broker = RefusingBroker(refusals)
    monkeypatch.setattr(Signature, "apply_async", lambda signature, *a, **kw: broker(*a, **kw))
    monkeypatch.setattr(gate, "REPUBLISH_RETRY_S", (0.0, 0.0, 0.0), raising=False)

    @celery_app.task(base=IntervalTask, shared=False, interval="1s", interval_queue="refused")
    def work(n: int) -> int:
        return n

    assert work.acks_late, "interval tasks are acknowledged after they ran"
    work.push_request(id="task-9", args=(9,), kwargs={}, headers={}, delivery_info={})
    try:
        with pytest.raises((Ignore, Reject)) as ended:
            gate.defer(work, *deferral(work, "refused"))
    finally:
        work.pop_request()
    print(f"{refusals} refusals: {type(ended.value).__name__}, refused {broker.refused}, sent {len(broker.sent)}")
    if refusals <= 3:
        assert type(ended.value) is Ignore and len(broker.sent) == 1, "published again: the deferral stands"
    else:
        assert isinstance(ended.value, Reject) and ended.value.requeue, "the message goes back to the broker"
