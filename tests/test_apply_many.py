"""``apply_many`` takes the options ``apply_async`` takes, checks them before it claims a
ticket, and publishes without tickets when the store cannot be reached, as ``apply_async``
does. Real messages in a private Redis broker; the store on the same server."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from siq_celery import ConfigurationError, IntervalTask
from siq_celery.embedded import free_port


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    broker = redis_url.rsplit("/", 1)[0] + "/6"
    client = redis.Redis.from_url(broker)
    client.flushdb()
    app = Celery("many", broker=broker, set_as_current=False)
    app.conf.update(siq_url=redis_url, broker_connection_retry_on_startup=False)
    yield app
    app.close()
    client.flushdb()
    client.close()


def sent(app: Celery) -> list[dict[str, Any]]:
    """The headers of the messages in the broker's ``celery`` list, oldest first."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(raw)["headers"] for raw in reversed(client.lrange("celery", 0, -1))]
    finally:
        client.close()


def job_of(app: Celery, queue: str) -> Any:
    @app.task(base=IntervalTask, shared=False, interval="100ms", interval_queue=queue, name=f"many.{queue}")
    def job(n: int) -> None: ...

    return job


@pytest.mark.parametrize("when", ["eta", "countdown"])
def test_apply_many_with_an_eta_or_countdown_publishes_every_call_with_a_ticket(app: Celery, when: str) -> None:
    job = job_of(app, f"many-{when}")
    later = datetime.now(UTC) + timedelta(seconds=30)
    option = {"eta": later} if when == "eta" else {"countdown": 30}
    try:
        results = job.apply_many([(n,) for n in range(3)], **option)
    except TypeError as exc:
        raise AssertionError(f"apply_many({when}=...) raised {exc!r} with {job.siq_queue().status().state.ticket} "
                             f"tickets claimed and {len(sent(app))} published") from exc  # fmt: skip
    headers = sent(app)
    assert len(results) == 3 and [h["siq_ticket"] for h in headers] == [1, 2, 3]
    etas = [datetime.fromisoformat(h["eta"]) for h in headers]
    assert all(abs((eta - later).total_seconds()) < 2 for eta in etas), "the caller's own ETA stands"


@pytest.mark.parametrize(
    ("option", "value"),
    [("task_id", "one-id"), ("eta", "tomorrow"), ("countdown", "soon"), ("countdown", float("nan")), ("args", [1])],
)
def test_apply_many_refuses_options_it_cannot_honour_before_claiming(app: Celery, option: str, value: Any) -> None:
    job = job_of(app, "many-refused")
    with pytest.raises(ConfigurationError, match=option) as refused:
        job.apply_many([(n,) for n in range(3)], **{option: value})
    assert "\n" not in str(refused.value)
    assert job.siq_queue().backend.status("many-refused") is None, "nothing claimed"
    assert sent(app) == [], "nothing published"


def test_apply_many_publishes_without_tickets_when_the_store_is_unreachable_as_apply_async_does(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.siq_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    job = job_of(app, "many-down")
    with caplog.at_level(logging.WARNING, logger="siq_celery"):
        job.apply_async((0,))
        results = job.apply_many([(n,) for n in range(1, 5)], chunk_size=2)
    headers = sent(app)
    warned = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    print(f"\n{len(headers)} published, {len(warned)} warnings")
    assert len(results) == 4 and len(headers) == 5, "every call published, as apply_async's"
    assert not any("siq_ticket" in h for h in headers), "without a ticket: the worker claims one"
    assert len(warned) == 3  # apply_async's, and one per chunk
