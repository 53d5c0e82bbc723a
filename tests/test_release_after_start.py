"""The fair release after a start, made by a thread (parking.ReleaseAfterStart): while asks
keep coming the thread looks for them on its own and an ask wakes no thread (a wake-up just
before a body is where a loaded host's scheduler may take the CPU from it); a start about
to be waited for makes the thread or wakes it (ready), so the ask after its report wakes
nothing; an ask after a quiet spell without one wakes it. Every ask is released, coalesced
per app and queue."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from siq_celery.tasks import parking
from siq_celery.tasks.parking import ReleaseAfterStart


class Queue:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    done: list[tuple[str, float]] = []
    monkeypatch.setattr(parking, "release_fair", lambda app, queue, who: done.append((queue.name, time.monotonic())))
    return done


def wait_for(released: list[Any], count: int, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while len(released) < count and time.monotonic() < deadline:
        time.sleep(0.002)
    assert len(released) >= count, released


def test_asks_that_keep_coming_wake_no_thread_and_are_all_released(
    released: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    keeper = ReleaseAfterStart()
    wakes: list[float] = []
    notify = keeper._lock.notify
    monkeypatch.setattr(keeper._lock, "notify", lambda n=1: (wakes.append(time.monotonic()), notify(n)))
    app = object()
    keeper.ask(app, Queue("a"), "t")  # starts the thread
    wait_for(released, 1)
    for i in range(5):  # a start every 30 ms
        asked = time.monotonic()
        keeper.ask(app, Queue("a"), "t")
        wait_for(released, 2 + i)
        assert released[-1][1] - asked < ReleaseAfterStart.POLL_S * 5
        time.sleep(0.03)
    assert wakes == [], "an ask while the thread polls must not wake it"


def test_the_first_ask_after_a_quiet_spell_wakes_the_thread(
    released: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ReleaseAfterStart, "IDLE_AFTER_S", 0.1)
    keeper = ReleaseAfterStart()
    app = object()
    keeper.ask(app, Queue("a"), "t")
    wait_for(released, 1)
    deadline = time.monotonic() + 2
    while not keeper._asleep and time.monotonic() < deadline:  # quiet past IDLE_AFTER_S: it sleeps
        time.sleep(0.01)
    assert keeper._asleep
    asked = time.monotonic()
    keeper.ask(app, Queue("b"), "t")
    wait_for(released, 2)
    assert released[-1][0] == "b" and released[-1][1] - asked < 0.5


def test_asks_of_one_queue_coalesce_and_two_apps_queues_of_one_name_are_two(
    released: list[tuple[str, float]],
) -> None:
    keeper = ReleaseAfterStart()
    first, second = object(), object()
    with keeper._lock:  # the thread cannot take the asks until all four are in
        for app in (first, first, second, second):
            keeper.ask(app, Queue("same"), "t")
    wait_for(released, 2)
    time.sleep(ReleaseAfterStart.POLL_S * 3)
    assert [name for name, _ in released] == ["same", "same"]


def test_a_start_about_to_wait_makes_or_wakes_the_thread_so_its_ask_wakes_nothing(
    released: list[tuple[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first fair start of a process, and the first after a quiet spell: the thread is
    made, or woken, as the wait begins (a thread started or woken before a body took the
    CPU from it on a loaded host), and the ask that follows the report finds it looking."""
    monkeypatch.setattr(ReleaseAfterStart, "IDLE_AFTER_S", 0.1)
    keeper = ReleaseAfterStart()
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), start(t)))
    wakes: list[float] = []
    notify = keeper._lock.notify
    monkeypatch.setattr(keeper._lock, "notify", lambda n=1: (wakes.append(time.monotonic()), notify(n)))
    app = object()
    keeper.ready()
    assert started == ["siq-fair-release"]  # made as the wait begins
    keeper.ask(app, Queue("a"), "t")
    wait_for(released, 1)
    assert started == ["siq-fair-release"] and wakes == []
    deadline = time.monotonic() + 2
    while not keeper._asleep and time.monotonic() < deadline:  # quiet past IDLE_AFTER_S: it sleeps
        time.sleep(0.01)
    assert keeper._asleep
    keeper.ready()  # the next start's wait begins: woken now
    assert len(wakes) == 1
    time.sleep(0.03)  # the wait
    keeper.ask(app, Queue("a"), "t")
    wait_for(released, 2)
    assert len(wakes) == 1, "the ask after the wait must not wake the thread again"
