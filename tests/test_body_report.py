"""The report a body sends as it begins (body.body_may_begin), step by step, on a line
whose clock and store answers the test sets: sent without waiting for the answer (a
process blocked on it waits for the CPU after, on a loaded host), and again while its send
took long (the process stood still in it); an error in time lets the body begin (the
start stands as authorized); a body about to begin late waits for the answer, and an
error or a refusal then means it does not begin."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import pytest

from siq_celery.broker import green
from siq_celery.client.body import (
    HOLD_SPIN_S,
    LATE_BEGIN_S,
    REPORT_AGAIN_S,
    REPORTS,
    body_may_begin,
    report_again_if_late,
    still_holds,
)
from siq_celery.types import Decision, Verdict


@dataclass
class FakeLine:
    """A line whose reports take ``round_trips`` seconds each (in turn), answer ``held``
    or raise ``error``; its monotonic clock moves only by those round trips."""

    round_trips: list[float]
    held: bool = True
    error: Exception | None = None
    error_if_asked: Exception | None = None  #: raised only by a report whose answer is waited for
    name: str = "q"
    now: float = 100.0
    reports: list[bool] = field(default_factory=list)  #: each report's ``wait``
    naps: list[float] = field(default_factory=list)  #: each sleep
    sent_at: list[float] = field(default_factory=list)  #: when each report was sent

    def _monotonic(self) -> float:
        return self.now

    def _nap(self, seconds: float, deadline: float | None) -> None:
        self.naps.append(seconds)
        self.now += seconds

    def began(self, decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        self.reports.append(wait)
        self.sent_at.append(self.now)
        self.now += self.round_trips[min(len(self.reports), len(self.round_trips)) - 1]
        if self.error is not None:
            raise self.error
        if wait and self.error_if_asked is not None:
            raise self.error_if_asked
        return self.held


def decision(asked_at: float) -> Decision:
    return Decision(Verdict.AUTHORIZED, 1, 5_000_000, slot_us=5_000_000, asked_at=asked_at)


@pytest.fixture(params=[False, True], ids=["prefork", "green"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(green, "GREEN", request.param)
    return bool(request.param)


def test_a_start_authorized_ahead_of_its_slot_holds_its_body_until_then(pool: bool) -> None:
    """The store authorized the start 3 ms ahead of its slot (the answer's wait): the
    report is sent 3 ms after the answer came back (the answer left the store before, so
    the body never begins before the slot on the store's clock, however long the ask took
    to get there); the process's own work since the answer (here 1 ms) is part of those 3 ms."""
    line = FakeLine([REPORT_AGAIN_S / 2], now=100.0015)
    ahead = Decision(Verdict.AUTHORIZED, 1, 5_003_000, 3_000, 5_003_000, asked_at=100.0, answered_at=100.0005)
    assert body_may_begin(line, ahead)  # type: ignore[arg-type]
    assert line.naps == [pytest.approx(0.002)] and line.sent_at == [pytest.approx(100.0035)]
    late = FakeLine([REPORT_AGAIN_S / 2], now=100.004)  # its work took longer than the lead: no hold
    assert body_may_begin(late, ahead) and late.naps == [] and late.sent_at == [100.004]  # type: ignore[arg-type]


def test_a_report_sent_quickly_is_sent_once_and_not_waited_for(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False]


def test_a_report_sent_slowly_asks_whether_the_start_holds_then_reports_again(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S * 4, REPORT_AGAIN_S * 4, REPORT_AGAIN_S / 2])  # slow, the answer, then quick
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False, True, False]  # the last quick send places the start
    line = FakeLine([REPORT_AGAIN_S * 4])  # every send slow: the process stands still each time
    assert body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False, True] * (REPORTS // 2)


def test_a_process_that_stood_still_in_its_report_while_a_later_start_came_does_not_begin(
    pool: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("siq_celery"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="siq_celery")
    line = FakeLine([0.05, REPORT_AGAIN_S / 2], held=False)  # 50 ms in its send: a later start came meanwhile
    assert not body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False, True]
    assert "stood still after its body's report, and a later start came" in caplog.text
    line = FakeLine([0.05], error_if_asked=ConnectionError("reset by peer"))  # no answer: fail closed
    assert not body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert line.reports == [False, True] and "could not ask whether a body's start still holds" in caplog.text


def test_a_process_that_stood_still_after_its_report_asks_then_reports_again_as_its_body_begins(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    one = decision(asked_at=99.99)
    assert body_may_begin(line, one)  # type: ignore[arg-type]
    line.now += REPORT_AGAIN_S / 4  # the caller's own steps, quick: nothing more to say
    assert still_holds(one)
    report_again_if_late(one)
    assert line.reports == [False]
    two = decision(asked_at=line.now)
    assert body_may_begin(line, two)  # type: ignore[arg-type]
    line.now += 0.002  # preempted after the report (a fair release's thread took the GIL)
    assert still_holds(two)
    assert line.reports == [False, False, True, False]  # asked, held: reported again without waiting
    line.now += 0.002  # preempted again, in Celery's before_start: too late to hold the body back
    report_again_if_late(two)
    assert line.reports == [False, False, True, False, False]
    report_again_if_late(two)  # once per report
    assert len(line.reports) == 5
    line.held = False  # stood still while a later start came: the body must not begin
    three = decision(asked_at=line.now)
    assert body_may_begin(line, three)  # type: ignore[arg-type]
    line.now += 0.03
    assert still_holds(one)  # another start's question says nothing (another greenlet's report is the last)
    assert not still_holds(three)


def test_a_report_waited_for_is_not_sent_again_as_the_body_begins(pool: bool) -> None:
    line = FakeLine([REPORT_AGAIN_S / 2])
    late = decision(asked_at=100.0 - LATE_BEGIN_S - 0.01)
    assert body_may_begin(line, late)  # type: ignore[arg-type]
    line.now += 0.002
    report_again_if_late(late)
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


def test_a_question_after_a_slow_report_that_fails_is_no_start(pool: bool) -> None:
    """After a slow send the process may have stood still while a later start came: the
    report that follows is a question, and without its answer the body does not begin
    (fail closed, as for a late body: the start is given back and the task waits again)."""
    line = FakeLine([REPORT_AGAIN_S * 4])
    asks: list[bool] = []

    def began(decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        asks.append(wait)
        line.now += REPORT_AGAIN_S * 4
        if len(asks) > 1:
            raise ConnectionError("reset by peer")
        return True

    line.began = began  # type: ignore[method-assign]
    assert not body_may_begin(line, decision(asked_at=99.99))  # type: ignore[arg-type]
    assert asks == [False, True]


def test_a_start_held_for_its_slot_is_held_by_the_store_clock_read_from_recent_answers(pool: bool) -> None:
    """The answer came back 0.5 ms after the store read its clock; recent answers place the
    store's clock 0.4 ms closer (``slot_at``, ReplyClock): the body is held until then, the
    last of it awake (``HOLD_SPIN_S``), not a whole way back later."""
    line = FakeLine([REPORT_AGAIN_S / 2], now=100.0005)
    ahead = Decision(Verdict.AUTHORIZED, 1, 5_003_000, 3_000, 5_003_000, asked_at=100.0, answered_at=100.0005,
                     slot_at=100.0031)  # fmt: skip
    assert body_may_begin(line, ahead)  # type: ignore[arg-type]
    awake = 0.0 if pool else HOLD_SPIN_S  # not on a green pool: its nap ends on time, and a wait awake holds the hub
    assert line.naps == [pytest.approx(0.0026 - awake)]
    later = replace(ahead, slot_at=100.009)  # never later than the answer alone places the slot
    line = FakeLine([REPORT_AGAIN_S / 2], now=100.0005)
    assert body_may_begin(line, later) and line.naps == [pytest.approx(0.003 - awake)]  # type: ignore[arg-type]
