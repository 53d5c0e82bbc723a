"""Tests of ``tasks.py`` as its users write them: siq_celery's pytest plugin gives each
test a store of its own (``siq_store``) on a pinned clock, and Celery's in-process worker
(``celery_worker``) runs the tasks. No Redis, no sleeping: the store's clock moves only
when a task waits for its slot, so 200 ms intervals and a 30 s back-off take milliseconds,
and each start happens exactly at its slot."""

from __future__ import annotations

import email.message
import itertools
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest
import tasks

from siq_celery.pytest_plugin import SiqStore


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The geocoding service, faked: the answers it gives, in order (an HTTPError is raised),
    then coordinates for every address."""
    answers: list[Any] = []

    def lookup(address: str) -> dict[str, Any]:
        answer = answers.pop(0) if answers else {"address": address, "lat": 48.85, "lon": 2.35}
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    monkeypatch.setattr(tasks, "lookup", lookup)
    yield answers


def test_geocode_returns_the_services_answer(siq_store: SiqStore, celery_worker: Any, service: list[Any]) -> None:
    assert tasks.geocode.delay("1 Main St").get(timeout=10) == {"address": "1 Main St", "lat": 48.85, "lon": 2.35}


def test_calls_start_in_ticket_order_one_interval_apart(
    siq_store: SiqStore, celery_worker: Any, service: list[Any]
) -> None:
    results = [tasks.geocode.delay(f"{n} Main St") for n in range(5)]
    assert [r.get(timeout=10)["address"] for r in results] == [f"{n} Main St" for n in range(5)]
    starts = siq_store.starts("geocoder")
    assert siq_store.tickets("geocoder") == [1, 2, 3, 4, 5]
    assert [b.start_us - a.start_us for a, b in itertools.pairwise(starts)] == [200_000] * 4  # store clock, µs
    assert all(row.start_us == row.slot_us and row.outcome == "SUCCESS" for row in starts)


def test_a_429_holds_the_queue_and_the_call_runs_again_first(
    siq_store: SiqStore, celery_worker: Any, service: list[Any]
) -> None:
    service.append(too_many_requests(retry_after="30"))
    first, second = tasks.geocode.delay("1 Main St"), tasks.geocode.delay("2 Main St")
    assert first.get(timeout=10)["address"] == "1 Main St" and second.get(timeout=10)["address"] == "2 Main St"
    backed_off, again, next_one = siq_store.starts("geocoder")
    assert (backed_off.ticket, backed_off.outcome) == (1, "BACKOFF")
    assert (again.ticket, again.task_id, again.outcome) == (1, first.id, "SUCCESS")  # its own ticket, no retry used
    assert again.start_us - backed_off.start_us == 30_000_000  # the hold the service asked for, to the microsecond
    # The second call came for its slot while the queue was held: it was deferred (sent
    # back with a countdown to its new slot), then started one interval after the first.
    assert (next_one.ticket, next_one.deferrals, next_one.start_us - again.start_us) == (2, 1, 200_000)


def too_many_requests(retry_after: str) -> urllib.error.HTTPError:
    headers = email.message.Message()
    headers["Retry-After"] = retry_after
    return urllib.error.HTTPError(tasks.GEOCODER, 429, "Too Many Requests", headers, None)
