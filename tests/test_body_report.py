"""The report a body sends as it begins (queue.body_may_begin), step by step, on a line
whose clock and store answers the test sets: sent without waiting for the answer (a
process blocked on it waits for the CPU after, on a loaded host), and again while its send
took long (the process stood still in it); an error in time lets the body begin (the
start stands as authorized); a body about to begin late waits for the answer, and an
error or a refusal then means it does not begin."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from siq_celery import green
from siq_celery.queue import LATE_BEGIN_S, REPORT_AGAIN_S, REPORTS, body_may_begin, report_again_if_late
from siq_celery.types import Decision, Verdict


@dataclass
class FakeLine:
    """A line whose reports take ``round_trips`` seconds each (in turn), answer ``held``
    or raise ``error``; its monotonic clock moves only by those round trips."""

    round_trips: list[float]
    held: bool = True
    error: Exception | None = None
    name: str = "q"
    now: float = 100.0
    reports: list[bool] = field(default_factory=list)  #: each report's ``wait``

    def _monotonic(self) -> float:
        return self.now

    def began(self, decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        self.reports.append(wait)
        self.now += self.round_trips[min(len(self.reports), len(self.round_trips)) - 1]
        if self.error is not None:
            raise self.error
        return self.held


def decision(asked_at: float) -> Decision:
    return Decision(Verdict.AUTHORIZED, 1, 5_000_000, slot_us=5_000_000, asked_at=asked_at)


@pytest.fixture(params=[False, True], ids=["prefork", "green"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(green, "GREEN", request.param)
    return bool(request.param)


def test_a_report_sent_quickly_is_sent_once_and_not_waited_for(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False]


def test_a_report_sent_slowly_is_sent_again_until_one_goes_quickly(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S * 4, REPORT_AGAIN_S * 4, REPORT_AGAIN_S / 2])  # slow, slow, then quick
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False] * 3
    line = FakeLine([REPORT_AGAIN_S * 4])  # every send slow: the process stands still each time
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert len(line.reports) == REPORTS


def test_a_process_that_stood_still_after_its_report_reports_again_as_its_body_begins(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    line.now += REPORT_AGAIN_S / 4  # the caller's own steps, quick: nothing more to say
    report_again_if_late()
    assert line.reports == [False]
    assert body_may_begin(line, decision(asked_at=line.now))  # type: ignore[arg-type]
    line.now += 0.002  # preempted between the report and the body (Celery's before_start, another thread)
    report_again_if_late()
    assert line.reports == [False] * 3  # reported again, not waited for: the store places the start now
    report_again_if_late()  # once per report
    assert len(line.reports) == 3


def test_a_report_waited_for_is_not_sent_again_as_the_body_begins(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    assert body_may_begin(line, decision(asked_at=100.0 - LATE_BEGIN_S - 0.01))  # type: ignore[arg-type]
    line.now += 0.002
    report_again_if_late()
    assert line.reports == [True]


def test_a_report_that_fails_in_time_lets_the_body_begin(
    pool: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("siq_celery"), "propagate", True)  # whatever an earlier test set
    caplog.set_level(logging.WARNING, logger="siq_celery")
    line = FakeLine([REPORT_AGAIN_S / 2], error=ConnectionError("reset by peer"))
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert len(line.reports) == 1 and "could not report a body's start: ConnectionError" in caplog.text


def test_a_late_body_waits_for_the_answer_and_does_not_begin_if_overtaken(pool: bool) -> None:
    late = decision(asked_at=100.0 - LATE_BEGIN_S - 0.01)
    line = FakeLine([REPORT_AGAIN_S / 2], held=False)
    assert not body_may_begin(line, late)  # type: ignore[arg-type]
    assert line.reports == [True]  # waited for, on every pool
    line = FakeLine([REPORT_AGAIN_S / 2], error=ConnectionError("reset by peer"))
    assert not body_may_begin(line, late)  # type: ignore[arg-type]
    line = FakeLine([REPORT_AGAIN_S / 2])
    assert body_may_begin(line, late)  # type: ignore[arg-type]


def test_a_report_sent_again_that_fails_leaves_the_first_one_standing(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S * 4])
    calls = 0

    def began(decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        nonlocal calls
        calls += 1
        line.now += REPORT_AGAIN_S * 4
        if calls > 1:
            raise ConnectionError("reset by peer")
        return True

    line.began = began  # type: ignore[method-assign]
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert calls == 2
